"""Built-in datasets, named ``builtin:NAME`` in a spec and prepared on first use into the cache
(``$PHALANX_CACHE``, default ``~/.cache/phalanx``). ``builtin:stdlib`` is the Python standard library's own
source files on this machine, byte-tokenized: real text that every machine has."""

from __future__ import annotations

import fcntl
import sysconfig
from pathlib import Path

from phalanx.data.cache import cache_root
from phalanx.data.shards import INDEX, is_url

PREFIX = "builtin:"
BUILTINS = ("stdlib",)


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, without its test suite (a third of it, and mostly fixtures)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def resolve(path: str) -> str | Path:
    """The directory (or URL) of a dataset path; a built-in one is prepared first if needed (once, under a file
    lock, so every rank may call this)."""
    if not path.startswith(PREFIX):
        return path if is_url(path) else Path(path)
    name = path.removeprefix(PREFIX)
    if name not in BUILTINS:
        raise ValueError(
            f"data source {path!r}: no such built-in dataset; valid: {', '.join(PREFIX + b for b in BUILTINS)}"
        )
    out = cache_root() / "datasets" / f"{name}-byte"
    if not (out / INDEX).exists():
        from phalanx.data.prepare import prepare

        out.parent.mkdir(parents=True, exist_ok=True)
        with (out.parent / f".{name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / INDEX).exists():
                prepare(stdlib_sources(), out, tokenizer="byte", shard_tokens=1 << 22, progress=False)
    return out
