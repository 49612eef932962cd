"""Names a package exports but imports only on first use, so that importing the package (the CLI, the server)
does not import what those names need: torch, above all (PEP 562's module ``__getattr__``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: each name of ``where`` from its module, imported when first read."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
