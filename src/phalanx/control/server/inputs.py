"""What a client can send, checked before a route sees it, and what an error may echo of it.

Python's JSON parser takes what JSON does not allow (NaN, Infinity, numbers that overflow to inf) and what
UTF-8 cannot carry (a lone surrogate, "\\ud800"); a value like that passed to a model, then echoed in the
422, could not be encoded, and the client got a 500. Here a body is parsed once, strictly, and refused with
a 422 naming where the bad value is; and every validation error echoes at most an excerpt of its input.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from phalanx.spec import excerpt

MAX_DEPTH = 32  # nesting of a JSON body; the API's deepest body has 2 levels
MAX_ERRORS = 20  # validation errors shown of one request


class _Refused(ValueError):
    def __init__(self, where: str, message: str):
        super().__init__(message)
        self.where = where


def _constant(name: str) -> float:
    raise _Refused("", f"{name} is not a JSON number; send a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused("", f"{excerpt(text, 40)} is out of range for a number (it overflows to infinity)")
    return value


def strict_json(body: bytes) -> Any:
    """The JSON value of ``body``: finite numbers only, strings UTF-8 can carry, at most MAX_DEPTH deep.
    Raises _Refused (``where``: the path of the value, as in a validation error's loc)."""
    try:
        value = json.loads(body, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise _Refused("", f"nested more than {MAX_DEPTH} levels deep") from None
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while todo:
        item, where = todo.pop()
        if len(where) > MAX_DEPTH:
            raise _Refused(".".join(map(str, where[:MAX_DEPTH])), f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            for key, inner in item.items():
                _utf8(key, where)
                todo.append((inner, (*where, key)))
        elif isinstance(item, list):
            todo += [(inner, (*where, i)) for i, inner in enumerate(item)]
        elif isinstance(item, str):
            _utf8(item, where)
    return value


def _utf8(text: str, where: tuple[str | int, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _Refused(
            ".".join(map(str, where)), f"{excerpt(text, 40)} has a lone UTF-16 surrogate, which is not Unicode text"
        ) from None


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by ``strict_json`` (FastAPI then reads the parsed value, which
    Starlette's Request keeps), so that a body a model cannot safely take never reaches it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if self.body_field is not None and "json" in request.headers.get("content-type", "json"):
                body = await request.body()
                if body:
                    try:
                        request._json = strict_json(body)
                    except _Refused as e:
                        loc = ["body", *(e.where.split(".") if e.where else [])]
                        return _invalid([{"loc": loc, "msg": str(e), "type": "value_error"}])
                    except (ValueError, UnicodeDecodeError) as e:  # not JSON at all: FastAPI says where
                        if not isinstance(e, json.JSONDecodeError):
                            return _invalid([{"loc": ["body"], "msg": f"not JSON: {e}"[:200], "type": "json_invalid"}])
            return await handle(request)

        return checked


def _invalid(errors: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse({"detail": errors}, status_code=422)


def validation_failed(_request: Request, e: Exception) -> JSONResponse:
    """FastAPI's 422, with each echoed input cut to an excerpt (it could be a megabyte, or not encodable)."""
    assert isinstance(e, RequestValidationError)
    errors = []
    for err in e.errors()[:MAX_ERRORS]:
        shown: dict[str, Any] = {
            "loc": [part if isinstance(part, int) else excerpt(part, 64).strip("'") for part in err.get("loc", ())],
            "msg": str(err.get("msg", ""))[:300],
            "type": str(err.get("type", "")),
        }
        if "input" in err and err["input"] is not None and err["type"] != "missing":
            shown["input"] = excerpt(err["input"])
        errors.append(shown)
    return _invalid(errors)
