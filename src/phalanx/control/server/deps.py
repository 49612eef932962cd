"""What every route depends on (the FastAPI template's deps): the server's shared parts and the caller's token."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from phalanx.control.scheduler import GpuType
from phalanx.control.server import auth
from phalanx.control.store import Scope, Store

MAX_INT = 2**31 - 1
MAX_TOKEN_S = 365 * 86400  # the longest a token may live, whoever makes it (phalanx server --max-token-days)


class Server:
    """What the routes need: the store, where jobs' files go, the cluster's GPUs of each type and what they
    count (GPUs, or CPU slots: ``unit``), a way to wake the loop, the longest a token may live, the GPU
    types as described (their peaks seed the speed table), and whether its executor runs shares of a GPU."""

    def __init__(
        self,
        store: Store,
        jobs_dir: Path,
        types: dict[str, int],
        wake: Callable[[], None],
        max_token_s: float = MAX_TOKEN_S,
        unit: str = "GPUs",
        described: Mapping[str, GpuType] | None = None,
        shares: bool = True,
    ):
        self.store, self.jobs_dir, self.types, self.wake = store, jobs_dir, types, wake
        self.capacity = sum(types.values())
        self.max_token_s, self.unit, self.shares = max_token_s, unit, shares
        self.described = described if described is not None else {name: GpuType.named(name) for name in types}

    @contextlib.contextmanager
    def scope(self, authorization: str | None, write: bool = False) -> Iterator[Scope]:
        """The caller's view of the store, in one transaction: committed when the block ends (``write``),
        rolled back when it raises; 401 unless the token is valid."""
        with self.store.write() if write else self.store.read() as s:
            yield Scope(s, auth.authenticate(s, authorization, time.time()))


def _server(request: Request) -> Server:
    return request.app.state.server


_bearer = HTTPBearer(auto_error=False, description="an API token: phx_...")


async def _authorization(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str | None:
    return f"{credentials.scheme} {credentials.credentials}" if credentials else None


ServerDep = Annotated[Server, Depends(_server)]
Token = Annotated[str | None, Depends(_authorization)]
