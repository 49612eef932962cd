"""Documents from the inputs of ``phalanx data prepare``, in one deterministic order: text files (a file is a
document), JSON lines (one document per line, from a named field), Parquet (one per row, from a column)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".rs", ".go", ".js", ".ts", ".java", ".tex"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
PARQUET_SUFFIXES = {".parquet"}


def input_files(sources: Sequence[str | Path]) -> list[Path]:
    """Files named, and the known kinds of file under directories named, sorted so the order never varies."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in known)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"input {source}: no such file or directory")
    if not files:
        raise ValueError(
            f"no input files found in {', '.join(map(str, sources))} (known kinds: "
            f"{', '.join(sorted(TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES))})"
        )
    return files


def documents(path: Path, field: str) -> Iterator[str]:
    if path.suffix in JSONL_SUFFIXES:
        yield from _jsonl(path, field)
    elif path.suffix in PARQUET_SUFFIXES:
        yield from _parquet(path, field)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{line_no}: no text field {field!r} (found: {keys}); choose it with --field")
            yield record[field]


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {field!r} (columns: {', '.join(table.schema_arrow.names)}); choose it with --field"
        )
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)
