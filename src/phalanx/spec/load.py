"""Read a job spec from YAML and turn every problem into a message naming the field, the value and what is valid."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from phalanx.spec.model import JobSpec

# libyaml's parser and emitter where PyYAML was built with it (the wheels are): the same safe subset, 10x faster,
# which the server feels on every submission.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

MAX_SPEC_CHARS = 256 * 1024  # a spec is a page of YAML; this leaves room for long env and command lists
# Values in the document once YAML aliases are expanded. An alias is a reference, cheap to parse, but a
# validator walks the document as a tree: 7 levels of 9 aliases are 4.8 million values from 468 bytes.
MAX_VALUES = 100_000
EXCERPT_CHARS = 80  # of a value shown back in an error message


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters: what an error message shows of a value it was given,
    bounded whatever the value is (and ASCII-safe: repr escapes lone surrogates)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, limit, limit
    shown = short.repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


@dataclass(frozen=True)
class SpecIssue:
    path: str  # dotted field path, e.g. "train.parallel.dp_shard"; "" for the document itself
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class SpecError(ValueError):
    """A job spec that cannot run, with every issue found (not just the first)."""

    def __init__(self, source: str, issues: list[SpecIssue]):
        self.source = source
        self.issues = issues
        lines = "\n".join(f"  - {issue}" for issue in issues)
        super().__init__(f"invalid job spec {source}:\n{lines}")


def load_spec(path: str | Path) -> JobSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(str(path), [SpecIssue("", f"cannot read the file: {e.strerror}")]) from e
    return parse_spec(text, source=str(path))


def parse_spec(text: str, source: str = "<string>") -> JobSpec:
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(source, [SpecIssue("", f"{len(text):,} characters; a spec has at most {MAX_SPEC_CHARS:,}")])
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise SpecError(source, [SpecIssue("", f"not valid YAML: {e}")]) from e
    except (ValueError, RecursionError) as e:  # a scalar YAML cannot convert: an integer of 5,000 digits, say
        raise SpecError(source, [SpecIssue("", f"not valid YAML: {str(e)[:200]}")]) from None
    if not isinstance(data, dict):
        raise SpecError(source, [SpecIssue("", f"expected a mapping of fields at the top, got {type(data).__name__}")])
    if values_over(data, MAX_VALUES):
        raise SpecError(
            source,
            [SpecIssue("", f"more than {MAX_VALUES:,} values once YAML aliases (*name) are expanded; write them out")],
        )
    return validate_spec(data, source)


def values_over(data: Any, limit: int) -> bool:
    """Whether ``data``, walked as a tree (an alias counted each time it is used), has over ``limit`` values;
    the walk stops at the limit, so it costs at most ``limit`` steps whatever the aliases expand to."""
    todo, seen = [data], 0
    while todo:
        value = todo.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(value, dict):
            todo += value.keys()
            todo += value.values()
        elif isinstance(value, list | tuple | set):
            todo += value
    return False


def validate_spec(data: dict[str, Any], source: str = "<dict>") -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(source, [issue for err in e.errors() for issue in _issues(err)]) from None


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML, defaults filled in, keys as a user writes them."""
    return yaml.dump(spec.model_dump(mode="json", by_alias=True, exclude_none=True), Dumper=_Dumper, sort_keys=False)


def _issues(err: dict[str, Any]) -> list[SpecIssue]:
    loc = tuple(str(part) for part in err["loc"])
    path = ".".join(loc)
    if err["type"] == "value_error" and not loc:
        # JobSpec's cross-field rules: each line already starts with the field it blames.
        text = err["msg"].removeprefix("Value error, ")
        return [SpecIssue(*line.split(": ", 1)) for line in text.splitlines()]
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        return [SpecIssue(path, f"unknown key; valid keys here are: {', '.join(valid)}")]
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] != "missing":
        message = f"{message} (got {excerpt(err['input'])})"
    return [SpecIssue(path, message)]


def _valid_keys(loc: tuple[str, ...]) -> list[str]:
    """The field names accepted at ``loc``, found by walking the spec models along the path."""
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part) or next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            break  # a list index or dict key: stay at the model that holds it
        model = _model_in(field.annotation) or model
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _model_in(arg))), None)
