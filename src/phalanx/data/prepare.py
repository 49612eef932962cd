"""``phalanx data prepare``: tokenize documents into shards, resumable if interrupted.

Shards hold whole documents, each followed by the EOS id, and are flushed once they pass ``shard_tokens``.
A shard is written whole (locally: to a temporary name, fsynced and renamed; in object storage: one PUT); then
``.prepare-state.json`` records it and how many documents it used. A rerun with the same arguments skips
those documents and continues; the index is written (atomically) last. ``out`` is a directory or an fsspec URL
(``s3://bucket/prefix``), written directly.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from phalanx.data.documents import documents, input_files
from phalanx.data.remote import open_dataset
from phalanx.data.shards import CHUNK_BYTES, FORMAT, INDEX, TokenDataset, chunk_digests, token_dtype
from phalanx.data.tokenize import TOKENIZER_FILE, resolve_tokenizer
from phalanx.storage import write_atomic

STATE = ".prepare-state.json"


def prepare(
    sources: Sequence[str | Path],
    out: str | Path,
    tokenizer: str = "byte",
    field: str = "text",
    shard_tokens: int = 1 << 26,
    eos_token: str | None = None,
    dtype: str | None = None,
    progress: bool = True,
    batch_docs: int = 256,
    chunk_bytes: int = CHUNK_BYTES,
) -> TokenDataset:
    if chunk_bytes <= 0 or chunk_bytes % 4:
        raise ValueError(f"--chunk-bytes {chunk_bytes}: must be a positive multiple of 4")
    fs, root = url_to_fs(str(out))
    files = input_files(sources)
    args = {
        "files": [str(f.absolute()) for f in files],
        "tokenizer": tokenizer,
        "field": field,
        "shard_tokens": shard_tokens,
        "eos_token": eos_token,
        "dtype": dtype,
        **({"chunk_bytes": chunk_bytes} if chunk_bytes != CHUNK_BYTES else {}),  # the default: as before it was one
    }
    args_hash = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    if fs.exists(f"{root}/{INDEX}"):
        prepared = json.loads(fs.cat_file(f"{root}/{INDEX}"))
        if prepared.get("args_hash") != args_hash:
            raise ValueError(
                f"{out} already holds a dataset prepared from other inputs or settings; "
                "choose another --out or delete it"
            )
        return open_dataset(out)
    fs.makedirs(root, exist_ok=True)
    state = json.loads(fs.cat_file(f"{root}/{STATE}")) if fs.exists(f"{root}/{STATE}") else None
    if state is not None and state["args_hash"] != args_hash:
        raise ValueError(f"{out} holds an unfinished prepare of other inputs or settings; delete it to start over")
    state = state or {"args_hash": args_hash, "docs_done": 0, "shards": []}

    corpus = (d for f in files for d in documents(f, field))
    if isinstance(fs, LocalFileSystem):
        tok = resolve_tokenizer(tokenizer, Path(root), corpus, eos_token)
    else:  # the tokenizer is made (or, on a rerun, found) in a local directory and uploaded
        with tempfile.TemporaryDirectory() as local:
            if fs.exists(remote := f"{root}/{TOKENIZER_FILE}"):
                fs.get_file(remote, f"{local}/{TOKENIZER_FILE}")
            tok = resolve_tokenizer(tokenizer, Path(local), corpus, eos_token)
            if Path(made := f"{local}/{TOKENIZER_FILE}").exists():
                fs.put_file(made, remote)
    np_dtype = token_dtype(tok.vocab_size)
    if dtype is not None:
        np_dtype = np.dtype(dtype).newbyteorder("<")
        if tok.vocab_size - 1 > np.iinfo(np_dtype).max:
            raise ValueError(
                f"--dtype {dtype}: the tokenizer has {tok.vocab_size} ids, more than {dtype} holds "
                f"(max id {np.iinfo(np_dtype).max}); use uint32"
            )

    def flush(buffer: list[np.ndarray], docs_done: int) -> None:
        tokens = np.concatenate(buffer).astype(np_dtype)
        name = f"shard-{len(state['shards']):05d}.bin"
        data = tokens.tobytes()
        write_atomic(f"{root}/{name}", data, fs)
        state["shards"].append(
            {
                "file": name,
                "tokens": int(tokens.size),
                "sha256": hashlib.sha256(data).hexdigest(),
                "chunks": chunk_digests(data, chunk_bytes),
            }
        )
        state["docs_done"] = docs_done
        write_atomic(f"{root}/{STATE}", json.dumps(state).encode(), fs)

    buffer: list[np.ndarray] = []
    buffered, docs_seen = 0, state["docs_done"]
    eos = np.array([tok.eos_id], dtype=np.int64)
    with Progress(
        TextColumn("[bold]prepare[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not progress,
    ) as bar:
        task = bar.add_task("files", total=len(files))
        for batch in _batches(files, field, state["docs_done"], batch_docs, bar, task):
            for ids in tok.encode_batch(batch):
                buffer += [ids.astype(np.int64, copy=False), eos]
                buffered += ids.size + 1
                docs_seen += 1
                if buffered >= shard_tokens:
                    flush(buffer, docs_seen)
                    buffer, buffered = [], 0
        if buffer:
            flush(buffer, docs_seen)
    if not state["shards"]:
        raise ValueError(f"no documents found in {', '.join(map(str, sources))}")
    index = {
        "format": FORMAT,
        "dtype": np_dtype.str,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": tok.meta,
        "args_hash": args_hash,
        "sources": args["files"],
        "documents": state["docs_done"],
        "total_tokens": sum(s["tokens"] for s in state["shards"]),
        "chunk_bytes": chunk_bytes,
        "chunk_digest": "xxh3_128",
        "shards": state["shards"],
    }
    write_atomic(f"{root}/{INDEX}", json.dumps(index, indent=1).encode(), fs)
    fs.rm_file(f"{root}/{STATE}")
    return open_dataset(out)


def _batches(files: list[Path], field: str, skip: int, size: int, bar: Progress, task) -> Iterator[list[str]]:
    """Batches of document texts (to tokenize together), after the first ``skip`` documents."""
    seen, batch = 0, []
    for f in files:
        for text in documents(f, field):
            seen += 1
            if seen <= skip:
                continue
            batch.append(text)
            if len(batch) == size:
                yield batch
                batch = []
        bar.advance(task)
    if batch:
        yield batch
