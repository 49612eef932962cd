"""What the commands that talk to the server share: the client, from the saved login, and one way to say its
errors (exit 2 for a request the server refused as invalid, 1 for the rest)."""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any, NoReturn

import typer

from phalanx.cli.common import err
from phalanx.client import Client, ClientError


def connect() -> Client:
    try:
        return Client()
    except ClientError as e:
        fail(e)


def fail(e: ClientError) -> NoReturn:
    err.print(f"[bold red]error[/] ({e.status or 'no connection'}):", highlight=False)
    for line in str(e).splitlines():
        err.print(f"  {line}", highlight=False)
    raise typer.Exit(2 if e.status in (400, 413, 422) else 1)


def call(fn, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ClientError as e:
        fail(e)


def when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def parse_since(text: str) -> float:
    """24h, 7d, 30m, a date (2026-12-01), or Unix seconds."""
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text):
        return time.time() - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give 24h, 7d, 30m, a date such as 2026-12-01, or Unix seconds") from None
