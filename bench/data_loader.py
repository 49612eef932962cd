"""phalanx's loader against mosaicml-streaming (StreamingDataset) and torchdata (StatefulDataLoader), on the
same tokens, in one process, side by side:

- throughput: samples/s reading shuffled fixed-length samples, batch 64, single process, in steady state
  (timed after the first batch, so that building a shuffle is not counted);
- resume-to-first-batch: from a fresh process state, restore the loader's state at sample position P and time
  until the first batch is in hand, at P = 640 and P near the end of a 10M-sample epoch.

    make bench-env && .venv-bench/bin/python bench/data_loader.py [--samples 10000000]

The peers need torchvision (mosaicml-streaming imports it), hence their own environment (`make bench-env`).
Datasets are written once into ~/.cache/phalanx/bench and reused. Prints each figure and phalanx's ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from _report import Report

BATCH = 64


def write_phalanx(root: Path, tokens: np.ndarray) -> Path:
    """The tokens as one phalanx shard, written in the documented format (what `data prepare` produces)."""
    from phalanx.data.shards import FORMAT, INDEX
    from phalanx.storage import sha256_file

    out = root / "phalanx"
    if (out / INDEX).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokens.astype("<u2").tofile(out / "shard-00000.bin")
    index = {
        "format": FORMAT,
        "dtype": "<u2",
        "vocab_size": 257,
        "eos_id": 256,
        "tokenizer": {"kind": "byte"},
        "documents": 1,
        "total_tokens": int(tokens.size),
        "shards": [
            {"file": "shard-00000.bin", "tokens": int(tokens.size), "sha256": sha256_file(out / "shard-00000.bin")}
        ],
    }
    (out / INDEX).write_text(json.dumps(index))
    return out


def write_mds(root: Path, tokens: np.ndarray, n: int, seq_len: int) -> Path:
    from streaming import MDSWriter

    out = root / "mds"
    if (out / "index.json").exists():
        return out
    with MDSWriter(out=str(out), columns={"tokens": f"ndarray:uint16:{seq_len + 1}"}, size_limit="64mb") as w:
        for i in range(n):
            w.write({"tokens": tokens[i * seq_len : i * seq_len + seq_len + 1]})
    return out


class MemmapSamples:
    """The map-style dataset one hands to torchdata: sample i is a window of the same token file."""

    def __init__(self, path: Path, n: int, seq_len: int):
        self.tokens = np.memmap(path, dtype="<u2", mode="r")
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array(self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1])


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


def streaming_opener(mds: Path):
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    def open_at(position: int) -> Iterator:
        clean_stale_shared_memory()
        ds = StreamingDataset(local=str(mds), shuffle=True, shuffle_seed=0, batch_size=BATCH, num_canonical_nodes=1)
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
        return iter(StreamingDataLoader(ds, batch_size=BATCH, num_workers=0))

    return open_at


def torchdata_opener(tokens_file: Path, n: int, seq_len: int):
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(
            MemmapSamples(tokens_file, n, seq_len),
            batch_size=BATCH,
            shuffle=True,
            num_workers=0,
            generator=torch.Generator().manual_seed(0),
        )

    template = make()
    next(iter(template))
    saved = template.state_dict()  # after one batch; moved to the position below, as a checkpoint would hold it

    def open_at(position: int) -> Iterator:
        loader = make()
        if position:
            loader.load_state_dict(_at_position(saved, position))
        return iter(loader)

    return open_at


def _at_position(state: dict, position: int) -> dict:
    """A StatefulDataLoader state as saved after ``position`` samples (the counters scale with it)."""
    batches = position // BATCH
    outer = state["_sampler_iter_state"]
    sampler = {
        **outer,
        "samples_yielded": batches * BATCH,
        "sampler_iter_state": {**outer["sampler_iter_state"], "yielded": batches * BATCH},
    }
    return {**state, "_num_yielded": batches, "_sampler_iter_yielded": batches, "_sampler_iter_state": sampler}


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
    next(open_at(position))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batches", type=int, default=500, help="batches read for throughput")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "phalanx" / "bench")
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = parser.parse_args()
    n, seq = args.samples, args.seq_len
    root = args.cache / f"tokens-{n}-{seq}"
    tokens = np.random.default_rng(0).integers(0, 256, n * seq + 1, dtype=np.uint16)
    ds_dir = write_phalanx(root, tokens)
    mds = write_mds(root, tokens, n, seq)
    near_end = (n // BATCH - 2) * BATCH
    rows = []
    for name, open_at in [
        ("phalanx", phalanx_opener(ds_dir, seq)),
        ("mosaicml-streaming", streaming_opener(mds)),
        ("torchdata StatefulDataLoader", torchdata_opener(ds_dir / "shard-00000.bin", n, seq)),
    ]:
        rows.append(
            (
                name,
                throughput(open_at, args.batches),
                resume_latency(open_at, BATCH * 10),
                resume_latency(open_at, near_end),
            )
        )
    import streaming
    import torch
    import torchdata

    ours = rows[0]
    report = Report(
        "Data loader",
        "python bench/data_loader.py",
        f"torch {torch.__version__}, mosaicml-streaming {streaming.__version__}, torchdata {torchdata.__version__}. "
        f"{n:,} shuffled samples of {seq + 1} tokens (uint16), batch {BATCH}, one process, no loader worker "
        "processes, the same tokens for every loader. Throughput is steady state (timed after the first batch); "
        "resume is from nothing to the first batch after restoring the loader's state at that position.",
    )
    report.table(
        ["loader", "samples/s", "resume at 640", f"resume at {near_end:,}"],
        [[name, f"{rate:,.0f}", f"{early * 1e3:.1f} ms", f"{late * 1e3:.1f} ms"] for name, rate, early, late in rows],
    )
    for (name, rate, _, late), goals in zip(rows[1:], [(">= 2x", ">= 10x"), ("", "")], strict=True):
        report.ratio(f"phalanx / {name}, throughput", ours[1] / rate, goals[0])
        report.ratio(f"{name} / phalanx, resume time near the end", late / ours[3], goals[1])
    report.finish(args.out)

if __name__ == "__main__":
    main()
