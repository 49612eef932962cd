"""The token shard format and its reader.

    DIR/index.json          what the dataset is: dtype, vocab, EOS id, tokenizer, and per shard its file,
                            token count and sha256; written last, so a dataset without it is unfinished
    DIR/shard-00000.bin     raw little-endian token ids (uint16 when the vocabulary fits, else uint32),
                            documents joined with the EOS id; read through np.memmap
    DIR/tokenizer.json      the tokenizer, when it is not byte-level

The index also holds, per shard, the xxh3_128 checksum of each ``chunk_bytes`` piece of it (``chunks``), so that
a dataset in object storage can be fetched and checked a chunk at a time (``data/remote.py``). DIR is a local
directory or an fsspec URL (``s3://bucket/prefix``).

Samples are fixed-length windows over the whole token stream: sample i is tokens
[i·seq_len, i·seq_len + seq_len + 1) (inputs and the targets shifted by one), across shard boundaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError, model_validator

from phalanx.storage import bytes_digest, file_digest

FORMAT = "phalanx-tokens-v1"
INDEX = "index.json"
CHUNK_BYTES = 1 << 20  # 1 MiB: a GET moves far more than it waits for, and a batch's first fetch stays small


def is_url(path: str | Path) -> bool:
    return "://" in str(path)


def chunk_digests(data: bytes, chunk_bytes: int) -> list[str]:
    """The xxh3_128 checksum of each ``chunk_bytes`` piece of a shard's bytes, as the index records them."""
    view = memoryview(data)
    return [bytes_digest(view[i : i + chunk_bytes], "xxh3_128") for i in range(0, max(1, len(data)), chunk_bytes)]


def token_dtype(vocab_size: int) -> np.dtype:
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= 2**32:
        return np.dtype("<u4")
    raise ValueError(f"tokenizer vocabulary of {vocab_size} ids does not fit uint32 tokens")


class DatasetError(ValueError):
    """A dataset that cannot be read as it is: missing, unfinished, truncated or corrupt, naming the file."""


@dataclass(frozen=True)
class Shard:
    file: str
    tokens: int
    sha256: str
    chunks: tuple[str, ...] | None = None  # xxh3_128 of each chunk_bytes piece, where the index records them


class _ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: Annotated[str, Field(pattern=r"^[^/\x00]{1,255}$")]  # a file of the dataset's own directory
    tokens: NonNegativeInt
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    chunks: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] | None = None


class _Index(BaseModel):
    """What a reader relies on in index.json (prepare writes more: sources, documents, the tokenizer)."""

    model_config = ConfigDict(extra="allow")
    format: Literal[FORMAT]
    dtype: Literal["<u2", "<u4"]
    vocab_size: PositiveInt
    eos_id: NonNegativeInt
    shards: list[_ShardEntry]
    chunk_bytes: Annotated[int, Field(gt=0, multiple_of=4)] | None = None
    chunk_digest: Literal["xxh3_128"] = "xxh3_128"

    @model_validator(mode="after")
    def _chunks_cover_shards(self) -> _Index:
        width = 2 if self.dtype == "<u2" else 4
        for i, shard in enumerate(self.shards):
            if shard.chunks is None:
                continue
            if self.chunk_bytes is None:
                raise ValueError(f"shards.{i}.chunks without chunk_bytes")
            if len(shard.chunks) != max(1, -(-shard.tokens * width // self.chunk_bytes)):
                raise ValueError(f"shards.{i}.chunks: {len(shard.chunks)} checksums for {shard.tokens} tokens")
        return self


def read_index(path: str | Path, data: bytes | None = None) -> dict[str, Any]:
    """index.json (read from ``path``, or given as ``data``), checked: a DatasetError naming the file and the
    first fields that are wrong, never a KeyError or a traceback from a hand-edited or foreign file."""
    try:
        data = json.loads(Path(path).read_bytes() if data is None else data)
        _Index.model_validate(data)
    except (OSError, ValueError) as e:
        if isinstance(e, ValidationError):
            wrong = [".".join(map(str, err["loc"])) + ": " + err["msg"] for err in e.errors()[:3]]
            raise DatasetError(f"{path}: not a phalanx dataset index ({'; '.join(wrong)})") from None
        why = e.strerror if isinstance(e, OSError) else f"not JSON ({e})"
        raise DatasetError(f"{path}: cannot be read: {why}") from None
    return data


class TokenDataset:
    """A prepared dataset in a local directory, memory-mapped; or, made by ``over``, one whose shards another
    reader gives (``data/remote.py``: a dataset in object storage, read in checked chunks)."""

    def __init__(self, root: str | Path, verify: Literal["full", "size"] = "full"):
        if is_url(root):
            raise ValueError(f"{root}: a URL; open it with phalanx.data.remote.open_dataset")
        self.root: str | Path = Path(root)
        index_path = self.root / INDEX
        try:
            found = index_path.is_file()
        except OSError as e:  # a name too long, say: is_file() raises what it cannot ask the filesystem
            raise DatasetError(f"{self.root}: not a usable path ({e.strerror})") from None
        if not found:
            raise DatasetError(
                f"{index_path}: not found; {self.root} is not a prepared dataset, or its "
                "`phalanx data prepare` did not finish (run it again to resume)"
            )
        self.index = read_index(index_path)
        self.shards = shards_of(self.index)
        self._describe(self.index)
        self.reader: ShardReader = LocalShards([self._open(s, verify) for s in self.shards])

    @classmethod
    def over(cls, root: str, index: dict[str, Any], reader: ShardReader) -> TokenDataset:
        """The dataset at ``root`` whose shards ``reader`` reads."""
        dataset = cls.__new__(cls)
        dataset.root, dataset.index, dataset.shards, dataset.reader = root, index, shards_of(index), reader
        dataset._describe(index)
        return dataset

    def _describe(self, index: dict[str, Any]) -> None:
        self.dtype = np.dtype(index["dtype"])
        self.vocab_size: int = index["vocab_size"]
        self.eos_id: int = index["eos_id"]
        self.offsets = np.cumsum([0] + [s.tokens for s in self.shards])
        self.total_tokens = int(self.offsets[-1])

    def _open(self, shard: Shard, verify: str) -> np.memmap:
        path = self.root / shard.file
        if not path.is_file():
            raise DatasetError(f"{path}: shard missing (listed in {self.root / INDEX})")
        expected = shard.tokens * self.dtype.itemsize
        if (size := path.stat().st_size) != expected:
            raise DatasetError(
                f"{path}: {size} bytes, expected {expected} ({shard.tokens} tokens): truncated or "
                "overwritten; prepare the dataset again"
            )
        if verify == "full" and (digest := file_digest(path)) != shard.sha256:
            raise DatasetError(
                f"{path}: checksum mismatch (sha256 {digest}, index says {shard.sha256}): the "
                "shard is corrupt; prepare the dataset again"
            )
        return np.memmap(path, dtype=self.dtype, mode="r")

    def num_samples(self, seq_len: int) -> int:
        return max(0, (self.total_tokens - 1) // seq_len)

    def samples(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """Samples ``indices`` as rows [len(indices), seq_len + 1]: one gather per shard for the windows inside
        it, a stitched read for the few that cross a shard boundary."""
        starts = np.asarray(indices, dtype=np.int64) * seq_len
        out = np.empty((starts.size, seq_len + 1), dtype=self.dtype)
        shard_of = np.searchsorted(self.offsets, starts, side="right") - 1
        inside = starts + seq_len + 1 <= self.offsets[shard_of + 1]
        window = np.arange(seq_len + 1)
        for shard in np.unique(shard_of[inside]):
            rows = np.flatnonzero(inside & (shard_of == shard))
            out[rows] = self.reader.take(int(shard), (starts[rows] - self.offsets[shard])[:, None] + window)
        for row in np.flatnonzero(~inside):
            out[row] = self.sample(int(indices[row]), seq_len)
        return out

    def sample(self, i: int, seq_len: int) -> np.ndarray:
        """seq_len + 1 tokens starting at i·seq_len, read across shard boundaries."""
        start, stop = i * seq_len, i * seq_len + seq_len + 1
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts, shard = [], first
        while start < stop:
            local = start - self.offsets[shard]
            take = min(stop - start, self.shards[shard].tokens - local)
            parts.append(self.reader.take(shard, np.arange(local, local + take)))
            start += take
            shard += 1
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])

    def chunks(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """The ids of the chunks that samples ``indices`` lie in (a remote dataset's unit of fetching)."""
        first = np.asarray(indices, dtype=np.int64) * seq_len
        ends = [self._chunk_of(first), self._chunk_of(first + seq_len)]  # chunk ids rise with the position
        spans = ends[1] - ends[0] + 1
        within = np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans)  # 0, 1, .. in each span
        return np.unique(np.repeat(ends[0], spans) + within)

    def _chunk_of(self, positions: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(self.offsets, positions, side="right") - 1
        return self.reader.chunk_ids(shard, positions - self.offsets[shard])


def shards_of(index: dict[str, Any]) -> list[Shard]:
    return [Shard(**{**s, "chunks": tuple(s["chunks"]) if s.get("chunks") else None}) for s in index["shards"]]


class ShardReader(Protocol):
    """Where a dataset's tokens come from: local memory maps, or a remote store's chunks (``RemoteShards``)."""

    def take(self, shard: int, positions: np.ndarray) -> np.ndarray: ...

    def chunk_ids(self, shard: np.ndarray, local: np.ndarray) -> np.ndarray: ...


class LocalShards:
    """A local dataset's shards, memory-mapped: the page cache is its cache, and a shard is its one chunk."""

    def __init__(self, maps: list[np.memmap]):
        self.maps = maps

    def take(self, shard: int, positions: np.ndarray) -> np.ndarray:
        return self.maps[shard][positions]

    def chunk_ids(self, shard: np.ndarray, local: np.ndarray) -> np.ndarray:
        return shard


def too_short(dataset: TokenDataset, seq_len: int) -> str | None:
    """Why ``dataset`` cannot give one sample of ``seq_len``, or None if it can."""
    if dataset.num_samples(seq_len) > 0:
        return None
    return (
        f"{dataset.total_tokens} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}; use a shorter "
        "train.seq_len or more data"
    )
