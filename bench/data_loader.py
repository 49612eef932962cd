"""phalanx's loader against mosaicml-streaming (StreamingDataset) and torchdata (StatefulDataLoader), on the
same tokens, side by side, each set up as its docs recommend:

- phalanx: its loader as the trainer runs it (a prefetch thread, one vectorised gather per batch);
- mosaicml-streaming: ``StreamingDataLoader`` with ``--workers`` worker processes and ``batch_size`` given
  to the dataset too (its performance-tuning and FAQ pages); it reads sample by sample, by design;
- torchdata: ``StatefulDataLoader`` with ``--workers`` worker processes over a map-style dataset that
  implements ``__getitems__``, so each batch is one vectorised read (torch.utils.data's batched fetch).

Measured, ``--repeats`` times, the loaders interleaved:

- throughput: samples/s reading shuffled fixed-length samples, batch 64, in steady state (timed after the
  first batch, so that building a shuffle and starting workers are not counted);
- resume-to-first-batch: from nothing, restore the loader's state at sample position P and time until the
  first batch is in hand (workers started included), at P = 640 and P near the end of a 10M-sample epoch.

From object storage (the second section), phalanx against mosaicml-streaming, both reading the same tokens
from the same S3-API server on loopback (moto's) into a cold local cache, in shards of the same size:

- time to the first batch, from nothing, the cache empty;
- first-pass throughput: samples/s over the first ``--remote-batches`` batches from nothing, the first batch
  and every download included;
- resume near the end: from nothing, the cache empty, restore the state near the end of the epoch and time
  until the first batch is in hand.

    make bench-env && .venv-bench/bin/python bench/data_loader.py [--samples 10000000] [--workers N]

The peers need torchvision (mosaicml-streaming imports it), hence their own environment (`make bench-env`).
Datasets are written once into ~/.cache/phalanx/bench and reused. Prints each figure and phalanx's ratios,
with their medians and ranges.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _report import Report, spread

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import free_port, start_moto

BATCH = 64


def write_phalanx(root: Path, tokens: np.ndarray, shard_tokens: int | None = None) -> Path:
    """The tokens as phalanx shards (``shard_tokens`` each, default one), written in the documented format, with
    the chunk checksums that `data prepare` records (so a remote reader can check each chunk it fetches)."""
    from phalanx.data.shards import CHUNK_BYTES, FORMAT, INDEX, chunk_digests

    out = root / ("phalanx" if shard_tokens is None else f"phalanx-{shard_tokens}-{CHUNK_BYTES}")
    if (out / INDEX).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    step = shard_tokens or tokens.size
    shards = []
    for i, first in enumerate(range(0, tokens.size, step)):
        data = tokens[first : first + step].astype("<u2").tobytes()
        (out / (name := f"shard-{i:05d}.bin")).write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        shards.append(
            {"file": name, "tokens": len(data) // 2, "sha256": digest, "chunks": chunk_digests(data, CHUNK_BYTES)}
        )
    index = {
        "format": FORMAT,
        "dtype": "<u2",
        "vocab_size": 257,
        "eos_id": 256,
        "tokenizer": {"kind": "byte"},
        "documents": 1,
        "total_tokens": int(tokens.size),
        "chunk_bytes": CHUNK_BYTES,
        "chunk_digest": "xxh3_128",
        "shards": shards,
    }
    (out / INDEX).write_text(json.dumps(index))
    return out


def write_mds(root: Path, tokens: np.ndarray, n: int, seq_len: int, size_limit: str = "64mb") -> Path:
    from streaming import MDSWriter

    out = root / ("mds" if size_limit == "64mb" else f"mds-{size_limit}")
    if (out / "index.json").exists():
        return out
    with MDSWriter(out=str(out), columns={"tokens": f"ndarray:uint16:{seq_len + 1}"}, size_limit=size_limit) as w:
        for i in range(n):
            w.write({"tokens": tokens[i * seq_len : i * seq_len + seq_len + 1]})
    return out


class MemmapSamples:
    """The map-style dataset one hands to torchdata: sample i is a window of the same token file. A batch is
    read at once (``__getitems__``), as int64 token ids, what the trainer takes (phalanx's loader gives them)."""

    def __init__(self, path: Path, n: int, seq_len: int):
        self.path, self.n, self.seq_len = path, n, seq_len
        self.window = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices: list[int]):
        import torch

        tokens = np.memmap(self.path, dtype="<u2", mode="r")  # opened in the worker that reads
        return torch.from_numpy(tokens[np.asarray(indices)[:, None] * self.seq_len + self.window].astype(np.int64))


def phalanx_opener(ds_dir: Path, seq_len: int):
    from phalanx.data.loader import Prefetcher, TokenSource
    from phalanx.data.shards import TokenDataset

    def open_at(position: int) -> Iterator:
        source = TokenSource([TokenDataset(ds_dir, verify="size")], [1.0], seq_len, seed=0)
        loader = Prefetcher(source, BATCH, 0, 1, start_step=position // BATCH)  # the step is the whole state
        try:
            while True:
                yield loader.next()
        finally:
            loader.close()

    return open_at


def streaming_opener(local: Path, workers: int, remote: str | None = None):
    """mosaicml-streaming over the MDS shards in ``local``, or downloaded into it from ``remote``."""
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    def open_at(position: int) -> Iterator:
        clean_stale_shared_memory()
        ds = StreamingDataset(
            remote=remote, local=str(local), shuffle=True, shuffle_seed=0, batch_size=BATCH, num_canonical_nodes=1
        )
        if position:
            ds.load_state_dict(
                {
                    "epoch": 0,
                    "sample_in_epoch": position,
                    "num_canonical_nodes": 1,
                    "shuffle_seed": 0,
                    "initial_physical_nodes": 1,
                }
            )
        return iter(StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers))

    return open_at


def torchdata_opener(tokens_file: Path, n: int, seq_len: int, workers: int):
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(
            MemmapSamples(tokens_file, n, seq_len),
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            collate_fn=lambda batch: batch,  # __getitems__ returns the batch ready
            generator=torch.Generator().manual_seed(0),
        )

    template = make()
    next(iter(template))
    saved = template.state_dict()  # after one batch; moved to the position below, as a checkpoint would hold it

    def open_at(position: int) -> Iterator:
        loader = make()
        if position:
            loader.load_state_dict(_at_position(saved, position, workers))
        return iter(loader)

    return open_at


def _at_position(state: dict, position: int, workers: int) -> dict:
    """A StatefulDataLoader state as saved after ``position`` samples (the counters scale with it; with worker
    processes, the main process's snapshot holds them and the workers took batches in turn)."""
    batches = position // BATCH
    main = state["_snapshot"]["_main_snapshot"] if workers else state
    outer = main["_sampler_iter_state"]
    sampler = {
        **outer,
        "samples_yielded": batches * BATCH,
        "sampler_iter_state": {**outer["sampler_iter_state"], "yielded": batches * BATCH},
    }
    moved = {**main, "_sampler_iter_state": sampler, "_sampler_iter_yielded": batches}
    if not workers:
        return {**moved, "_num_yielded": batches}
    snapshot = {
        **state["_snapshot"],
        "_snapshot_step": batches,
        "_last_yielded_worker_id": (batches - 1) % workers,
        "_main_snapshot": moved,
    }
    return {**state, "_snapshot": snapshot}


def throughput(open_at, batches: int) -> float:
    """Samples/s in steady state: timed after the first batch, so set-up costs are left out."""
    it = open_at(0)
    next(it)
    gc.collect()
    started = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * BATCH / (time.perf_counter() - started)


def resume_latency(open_at, position: int) -> float:
    """Seconds from nothing to the first batch after restoring the state at ``position``."""
    gc.collect()
    started = time.perf_counter()
    it = open_at(position)
    next(it)
    took = time.perf_counter() - started
    del it  # stopping the loader is not part of its resume
    return took


@dataclass
class Cold:
    """A loader reading from object storage: ``empty`` clears its local cache, ``open_at`` starts it at a sample
    position (the loader's state restored there)."""

    empty: Callable[[], None]
    open_at: Callable[[int], Iterator]


def start_store() -> subprocess.Popen:
    """moto's S3-API server on loopback, and the environment both loaders take it from (phalanx through s3fs:
    AWS_ENDPOINT_URL; mosaicml-streaming through boto3: S3_ENDPOINT_URL)."""
    port = free_port()
    server = start_moto(port)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            "S3_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    return server


def upload(local: Path, url: str) -> str:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for f in local.iterdir():
        fs.put_file(str(f), f"{bucket}/{prefix}/{f.name}")
    return url


def phalanx_remote(url: str, seq_len: int, cache: Path) -> Cold:
    from phalanx.data.loader import Prefetcher, TokenSource
    from phalanx.data.remote import CacheSettings, open_dataset

    def open_at(position: int) -> Iterator:
        dataset = open_dataset(url, cache=CacheSettings(cache, 64 << 30, 300.0, sharers=1))
        loader = Prefetcher(TokenSource([dataset], [1.0], seq_len, seed=0), BATCH, 0, 1, position // BATCH)
        try:
            while True:
                yield loader.next()
        finally:
            loader.close()

    return Cold(lambda: shutil.rmtree(cache, ignore_errors=True), open_at)


def streaming_remote(url: str, cache: Path, workers: int) -> Cold:
    return Cold(lambda: shutil.rmtree(cache, ignore_errors=True), streaming_opener(cache, workers, remote=url))


def first_pass(loader: Cold, batches: int) -> tuple[float, float]:
    """(seconds to the first batch, samples/s over ``batches`` batches), both from nothing with the cache empty."""
    loader.empty()
    gc.collect()
    started = time.perf_counter()
    it = loader.open_at(0)
    next(it)
    first = time.perf_counter() - started
    for _ in range(batches - 1):
        next(it)
    rate = batches * BATCH / (time.perf_counter() - started)
    del it
    return first, rate


def resume_at(loader: Cold, position: int, cold: bool) -> float:
    """Seconds from nothing to the first batch at ``position``, the cache emptied first (a fresh node) or kept
    (the same node, restarting)."""
    if cold:
        loader.empty()
    gc.collect()
    started = time.perf_counter()
    it = loader.open_at(position)
    next(it)
    took = time.perf_counter() - started
    del it  # stopping the loader is not part of its resume
    return took


def remote_section(args: argparse.Namespace, tokens: np.ndarray) -> Report:
    n, seq = args.remote_samples or args.samples, args.seq_len
    root = args.cache / f"tokens-{n}-{seq}"
    shard_tokens = args.shard_mib << 19  # uint16: two bytes a token
    phalanx_dir = write_phalanx(root, tokens[: n * seq + 1], shard_tokens)
    mds = write_mds(root, tokens, n, seq, f"{args.shard_mib}mb")
    server = start_store()
    try:
        loaders = {
            "phalanx": phalanx_remote(upload(phalanx_dir, "s3://bench/phalanx"), seq, args.cache / "cold-phalanx"),
            "mosaicml-streaming": streaming_remote(
                upload(mds, "s3://bench/mds"), args.cache / "cold-streaming", args.workers
            ),
        }
        near_end = (n // BATCH - 2) * BATCH
        figures = {name: {"first": [], "rate": [], "cold": [], "warm": []} for name in loaders}
        for _ in range(args.repeats):
            for name, loader in loaders.items():
                first, rate = first_pass(loader, args.remote_batches)
                figures[name]["first"].append(first)
                figures[name]["rate"].append(rate)
                figures[name]["cold"].append(resume_at(loader, near_end, cold=True))
                figures[name]["warm"].append(resume_at(loader, near_end, cold=False))
    finally:
        server.terminate()
        server.wait(timeout=30)
    report = Report(
        "Data loader from object storage",
        "python bench/data_loader.py",
        f"The same {n:,} samples of {seq + 1} tokens (uint16), in shards of {args.shard_mib} MiB for both loaders, "
        "in one bucket of moto's S3-API server on loopback (which reads a whole object for each ranged GET: "
        "the reason for shards this small), read into a local cache emptied before each figure. phalanx: its "
        "loader as the trainer runs it, fetching the chunks (1 MiB) of the coming steps' samples; "
        f"mosaicml-streaming: its `remote` and `local` settings with {args.workers} worker processes, otherwise "
        f"its defaults. First pass: samples/s over the first {args.remote_batches:,} batches of {BATCH} from "
        "nothing, the first batch and every download included. Resume: from nothing to the first batch, the "
        f"state restored at sample {near_end:,}, the cache emptied first (a new node) or, right after, kept (the "
        f"node restarting). {args.repeats} rounds, the loaders "
        "interleaved: medians, with the range.",
    )
    report.table(
        ["loader", "first batch, ms", "first pass, samples/s", "resume, cache empty, ms", "resume, cache kept, ms"],
        [
            [
                name,
                spread(f["first"], 1e3),
                spread(f["rate"], fmt="{:,.0f}"),
                spread(f["cold"], 1e3),
                spread(f["warm"], 1e3),
            ]
            for name, f in figures.items()
        ],
    )
    ours, theirs = figures["phalanx"], figures["mosaicml-streaming"]
    ratios = [
        ("phalanx / mosaicml-streaming, first-pass throughput", ours["rate"], theirs["rate"], ">= 2"),
        ("mosaicml-streaming / phalanx, resume near the end, cache empty", theirs["cold"], ours["cold"], ">= 10"),
        ("mosaicml-streaming / phalanx, resume near the end, cache kept", theirs["warm"], ours["warm"], ">= 10"),
        ("mosaicml-streaming / phalanx, time to the first batch", theirs["first"], ours["first"], ""),
    ]
    for what, a, b, goal in ratios:
        report.ratio(what, [x / y for x, y in zip(a, b, strict=True)], goal)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batches", type=int, default=500, help="batches read for throughput")
    parser.add_argument("--remote-samples", type=int, default=None, help="in object storage; default --samples")
    parser.add_argument("--remote-batches", type=int, default=1500, help="batches of the first pass from it")
    parser.add_argument("--shard-mib", type=int, default=8, help="shard size in object storage, both loaders")
    parser.add_argument("--sections", default="local,remote", help="local, remote, or both")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="the peers' processes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "phalanx" / "bench")
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = parser.parse_args()
    tokens = np.random.default_rng(0).integers(0, 256, args.samples * args.seq_len + 1, dtype=np.uint16)
    sections = args.sections.split(",")
    reports = [local_section(args, tokens)] if "local" in sections else []
    reports += [remote_section(args, tokens)] if "remote" in sections else []
    text = "\n".join(report.markdown() for report in reports)
    print("\n" + text, flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


def local_section(args: argparse.Namespace, tokens: np.ndarray) -> Report:
    n, seq = args.samples, args.seq_len
    root = args.cache / f"tokens-{n}-{seq}"
    ds_dir = write_phalanx(root, tokens)
    mds = write_mds(root, tokens, n, seq)
    near_end = (n // BATCH - 2) * BATCH
    loaders = {
        "phalanx": phalanx_opener(ds_dir, seq),
        "mosaicml-streaming": streaming_opener(mds, args.workers),
        "torchdata StatefulDataLoader": torchdata_opener(ds_dir / "shard-00000.bin", n, seq, args.workers),
    }
    figures: dict[str, dict[str, list[float]]] = {name: {"rate": [], "early": [], "late": []} for name in loaders}
    for _ in range(args.repeats):
        for name, open_at in loaders.items():
            figures[name]["rate"].append(throughput(open_at, args.batches))
            figures[name]["early"].append(resume_latency(open_at, BATCH * 10))
            figures[name]["late"].append(resume_latency(open_at, near_end))
    import streaming
    import torch
    import torchdata

    report = Report(
        "Data loader",
        "python bench/data_loader.py",
        f"torch {torch.__version__}, mosaicml-streaming {streaming.__version__}, torchdata {torchdata.__version__}. "
        f"{n:,} shuffled samples of {seq + 1} tokens (uint16), batch {BATCH}, the same tokens for every loader. "
        f"phalanx: its prefetch thread and batched gathers; the peers: {args.workers} worker processes each, "
        "torchdata's dataset reading a batch at once (`__getitems__`), mosaicml-streaming sample by sample as "
        "it is built to. Throughput is steady state (timed after the first batch); resume is from nothing to "
        "the first batch after restoring the loader's state at that position, starting its workers included. "
        f"{args.repeats} rounds, the loaders interleaved: medians, with the range.",
    )
    report.table(
        ["loader", "samples/s", "resume at 640, ms", f"resume at {near_end:,}, ms"],
        [
            [name, spread(f["rate"], fmt="{:,.0f}"), spread(f["early"], 1e3), spread(f["late"], 1e3)]
            for name, f in figures.items()
        ],
    )
    ours = figures["phalanx"]
    for name, goals in [("mosaicml-streaming", (">= 2", ">= 10")), ("torchdata StatefulDataLoader", ("", ""))]:
        theirs = figures[name]
        rate = [a / b for a, b in zip(ours["rate"], theirs["rate"], strict=True)]
        late = [b / a for a, b in zip(ours["late"], theirs["late"], strict=True)]
        report.ratio(f"phalanx / {name}, throughput", rate, goals[0])
        report.ratio(f"{name} / phalanx, resume time near the end", late, goals[1])
    return report


if __name__ == "__main__":
    main()
