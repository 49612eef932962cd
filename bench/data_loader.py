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

    make bench-env && .venv-bench/bin/python bench/data_loader.py [--samples 10000000] [--workers N]

The peers need torchvision (mosaicml-streaming imports it), hence their own environment (`make bench-env`).
Datasets are written once into ~/.cache/phalanx/bench and reused. Prints each figure and phalanx's ratios,
with their medians and ranges.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from _report import Report, spread

BATCH = 64


def write_phalanx(root: Path, tokens: np.ndarray) -> Path:
    """The tokens as one phalanx shard, written in the documented format (what `data prepare` produces)."""
    from phalanx.data.shards import FORMAT, INDEX
    from phalanx.storage import file_digest

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
            {"file": "shard-00000.bin", "tokens": int(tokens.size), "sha256": file_digest(out / "shard-00000.bin")}
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


def streaming_opener(mds: Path, workers: int):
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
    next(open_at(position))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batches", type=int, default=500, help="batches read for throughput")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="the peers' processes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "phalanx" / "bench")
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = parser.parse_args()
    n, seq = args.samples, args.seq_len
    root = args.cache / f"tokens-{n}-{seq}"
    tokens = np.random.default_rng(0).integers(0, 256, n * seq + 1, dtype=np.uint16)
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
    report.finish(args.out)


if __name__ == "__main__":
    main()
