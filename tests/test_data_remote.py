"""Datasets in object storage, against a real S3-API server on loopback (moto's): prepared there, read in checked
chunks through a node's cache, and trained on exactly as from local disk, through a kill, a store that goes away
mid-fetch, a cache smaller than the dataset, and two nodes that each fetch only their own ranks' chunks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest

from conftest import REPO, Job
from phalanx.data.loader import AHEAD, Prefetcher, TokenSource
from phalanx.data.prepare import STATE, prepare
from phalanx.data.remote import CacheSettings, DataFetchError, open_dataset
from phalanx.data.shards import DatasetError, TokenDataset
from phalanx.obs import read_jsonl
from phalanx.obs.digest import digest
from phalanx.obs.rundir import RunDir
from servers import free_port, start_moto

CHUNK = 1024
BUCKET = "phalanx-test"
SEED = 1234  # the recipe's train.seed, by default
TRAIN = (
    "train: {model: {preset: llama-tiny, vocab_size: 320}, steps: 24, global_batch: 8, micro_batch: 2, seq_len: 32,"
    " optimizer: {lr: 3.0e-3, warmup_steps: 2}}\n"
)


def _documents(root: Path) -> Path:
    """64 documents of random text, 16 KiB each: 2 MiB of tokens, 4 shards, 2048 chunks of 1 KiB."""
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": "".join(map(chr, rng.integers(32, 127, 16 << 10)))}) for _ in range(64)]
    (path := root / "docs.jsonl").write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("local")
    prepare([_documents(root)], root / "ds", shard_tokens=1 << 18, progress=False, chunk_bytes=CHUNK)
    return root / "ds"


def _s3() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("s3", skip_instance_cache=True)


def _upload(local: Path, prefix: str, fs: fsspec.AbstractFileSystem | None = None) -> str:
    fs = fs or _s3()
    for f in local.iterdir():
        fs.put_file(str(f), f"{BUCKET}/{prefix}/{f.name}")
    return f"s3://{BUCKET}/{prefix}"


def _source(url: str, cache: Path, budget: int = 1 << 30) -> TokenSource:
    settings = CacheSettings(cache, budget, fetch_timeout_s=20, sharers=2)
    return TokenSource([open_dataset(url, cache=settings)], [1.0], seq_len=32, seed=7)


def _chunks_of(local: Path, steps: range, rank: int, seed: int = 7) -> set[tuple[str, int]]:
    """(shard, chunk) of the chunks that ``rank`` of 2 reads at ``steps`` (batch 8), worked out from the local copy."""
    dataset = TokenDataset(local, verify="size")
    order = TokenSource([dataset], [1.0], seq_len=32, seed=seed)
    found = set()
    for step in steps:
        for sample in order.locate(step, 8, rank, 2)[1]:
            for token in (sample * 32, sample * 32 + 32):  # a window's first and last: 66 bytes span 2 chunks at most
                shard = int(np.searchsorted(dataset.offsets, token, side="right")) - 1
                found.add((f"shard-{shard:05d}", int(token - dataset.offsets[shard]) * 2 // CHUNK))
    return found


def _cached(cache: Path) -> dict[tuple[str, int], int]:
    """The chunks a node's cache holds, as (shard, chunk), and their sizes."""
    chunks = (f for f in cache.glob("*/*/*") if f.name.isdigit())  # not a temporary file being written
    return {(f"shard-{int(f.parent.name):05d}", int(f.name)): f.stat().st_size for f in chunks}


def test_prepare_into_object_storage_resumes_and_verifies(tmp_path: Path, local: Path, s3_server) -> None:
    """A prepare into S3 stops at a bad document; `phalanx data prepare --out s3://...` resumes it from its state
    in the bucket to the very dataset prepared locally, and `phalanx data verify` checks it there."""
    src = _documents(tmp_path)
    lines = src.read_text().splitlines()
    src.write_text("\n".join([*lines[:40], "{broken", *lines[40:]]))
    url = f"s3://{BUCKET}/prepared"
    argv = [sys.executable, "-m", "phalanx", "data", "prepare", str(src), "--out", url, "--shard-tokens",
            str(1 << 18), "--chunk-bytes", str(CHUNK)]  # fmt: skip
    with pytest.raises(ValueError, match=r"docs.jsonl:41: not valid JSON"):  # after two shards were written
        prepare([src], url, shard_tokens=1 << 18, progress=False, batch_docs=4, chunk_bytes=CHUNK)
    assert _s3().exists(f"{BUCKET}/prepared/{STATE}") and not _s3().exists(f"{BUCKET}/prepared/index.json")
    with pytest.raises(DatasetError, match="did not finish"):
        open_dataset(url)
    src.write_text("\n".join(lines))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [s.sha256 for s in open_dataset(url).shards] == [s.sha256 for s in TokenDataset(local).shards]
    assert not _s3().exists(f"{BUCKET}/prepared/{STATE}")
    verified = subprocess.run([sys.executable, "-m", "phalanx", "data", "verify", url], capture_output=True, text=True)
    assert verified.returncode == 0 and "ok, 4 shard(s)" in verified.stderr
    job = Job(tmp_path)
    typo = job.spec(f"name: t\n{TRAIN}data: {{sources: [{{path: '{url}-typo'}}]}}\n")
    checked = subprocess.run([sys.executable, "-m", "phalanx", "validate", str(typo)], capture_output=True, text=True)
    assert checked.returncode == 2 and f"data.sources.0.path: {url}-typo/index.json: not found" in checked.stderr


def test_a_small_cache_reads_what_local_disk_does_and_a_resumed_rank_fetches_from_its_step(
    tmp_path: Path, local: Path, s3_server
) -> None:
    """Two ranks sharing a node's cache a tenth of the dataset's size read every batch exactly as from local disk,
    the cache staying within its bound; a loader started at step 500 fetches only its own rows' chunks from
    there on, and a chunk the disk corrupted since is fetched again; a remote source blends with a local one as
    a local one would."""
    url = _upload(local, "small-cache")
    budget = 192 << 10
    truth = TokenSource([TokenDataset(local)], [1.0], seq_len=32, seed=7)
    ranks = [_source(url, tmp_path / "node", budget) for _ in range(2)]
    loaders = [Prefetcher(source, 8, rank, 2, start_step=0) for rank, source in enumerate(ranks)]
    expected = [Prefetcher(truth, 8, rank, 2, start_step=0) for rank in range(2)]
    try:
        for _ in range(120):  # 960 samples: about 1 MiB of chunks, five times the cache
            for loader, reference in zip(loaders, expected, strict=True):
                assert np.array_equal(loader.next().numpy(), reference.next().numpy())
        fetched = sum(loader.figures()["data_fetched_bytes"] for loader in loaders)
    finally:
        for loader in [*loaders, *expected]:
            loader.close()
    held = sum(_cached(tmp_path / "node").values())
    assert fetched > 4 * budget and held <= budget * 1.1  # it evicted, and overshoots by a tenth at most

    source = _source(url, tmp_path / "resumed")
    loader = Prefetcher(source, 8, 1, 2, start_step=500)
    loader.next()
    loader.close()
    fetched = set(_cached(tmp_path / "resumed"))
    assert _chunks_of(local, range(500, 501), 1) <= fetched <= _chunks_of(local, range(500, 500 + AHEAD + 3), 1)
    shard, chunk = sorted(_chunks_of(local, range(500, 501), 1))[0]
    (cached,) = (tmp_path / "resumed").glob(f"*/{int(shard.removeprefix('shard-')):05d}/{chunk:06d}")
    good = cached.read_bytes()
    cached.write_bytes(bytes(b ^ 0xFF for b in good))  # the disk gives back other bytes
    again = _source(url, tmp_path / "resumed").local_batch(500, 8, 1, 2)  # a new process maps and checks it
    assert np.array_equal(again.numpy(), truth.local_batch(500, 8, 1, 2).numpy()) and cached.read_bytes() == good

    settings = CacheSettings(tmp_path / "blend", 1 << 30, fetch_timeout_s=20, sharers=1)
    blends = [[TokenDataset(local), open_dataset(url, cache=settings)], [TokenDataset(local), TokenDataset(local)]]
    mixed, plain = (TokenSource(d, [0.7, 0.3], seq_len=32, seed=7) for d in blends)
    for step in range(0, 400, 40):  # a local and a remote source blend as two local ones do
        assert np.array_equal(mixed.local_batch(step, 8, 0, 1).numpy(), plain.local_batch(step, 8, 0, 1).numpy())


def test_a_corrupt_truncated_or_refused_object_is_a_clear_error(tmp_path: Path, local: Path, s3_server) -> None:
    fs = _s3()
    url = _upload(local, "corrupt")
    shard = f"{BUCKET}/corrupt/shard-00002.bin"
    data = bytearray(fs.cat_file(shard))
    data[5000] ^= 0xFF  # inside chunk 4 of the shard
    fs.pipe_file(shard, bytes(data))
    source = _source(url, tmp_path / "cache")
    loader = Prefetcher(source, 64, 0, 1, start_step=0)
    with pytest.raises(DatasetError, match=r"s3://phalanx-test/corrupt/shard-00002.bin \(bytes 4096-5120\): checksum"):
        for _ in range(300):  # 19,200 of the 32,770 samples: the 16 in that chunk are not all missed
            loader.next()
    loader.close()
    cached = _cached(tmp_path / "cache")
    assert ("shard-00002", 3) in cached and ("shard-00002", 4) not in cached  # its bytes were never kept
    verified = subprocess.run([sys.executable, "-m", "phalanx", "data", "verify", url], capture_output=True, text=True)
    assert verified.returncode == 1 and "shard-00002.bin: checksum mismatch" in verified.stderr
    fs.pipe_file(shard, bytes(data[:-2]))
    with pytest.raises(DatasetError, match=r"shard-00002.bin: \d+ bytes, expected \d+ .*truncated"):
        open_dataset(url)
    anonymous = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"}
    anonymous.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    refused = subprocess.run(
        [sys.executable, "-m", "phalanx", "data", "verify", url], capture_output=True, text=True, env=anonymous
    )
    assert refused.returncode == 1 and "the store refused it (NoCredentialsError" in refused.stderr  # at once


def _spec(job: Job, data: str, ckpt: Path, extra: str = "") -> Path:
    return job.spec(
        f"name: t\nresources: {{procs_per_node: 2, device: cpu}}\n{TRAIN}"
        f"checkpoint: {{dir: '{ckpt}', every_steps: 4}}\ndata: {{sources: [{{path: '{data}'}}]{extra}}}\n"
    )


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}  # a restart's steps replace


class _Store:
    """A moto server of this test's own, which it can kill and start again on the same port. moto keeps objects
    in memory: started again, it is given the dataset again, as S3 itself would still hold it."""

    def __init__(self, local: Path):
        self.local, self.port = local, free_port()
        self.env = {
            **os.environ,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_ACCESS_KEY_ID": "phalanx",
            "AWS_SECRET_ACCESS_KEY": "store-secret-never-written",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.start()

    def start(self) -> None:
        self.server = start_moto(self.port)
        fs = fsspec.filesystem(
            "s3", skip_instance_cache=True, endpoint_url=self.env["AWS_ENDPOINT_URL"], key="phalanx",
            secret=self.env["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip
        fs.mkdir(BUCKET)
        _upload(self.local, "ds", fs)

    def kill(self) -> None:
        self.server.kill()
        self.server.wait()


@pytest.fixture
def store(local: Path) -> Iterator[_Store]:
    started = _Store(local)
    yield started
    started.kill()


def _wait(what: str, done, sup: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert sup.poll() is None and time.monotonic() < deadline, f"{what}: {sup.stdout.read()[-3000:]}"
        time.sleep(0.01)


def test_training_from_object_storage_equals_local_disk_through_a_kill_and_a_store_restart(
    tmp_path: Path, local: Path, store: _Store
) -> None:
    """The recipe on the dataset in S3, through a cache a tenth of its size, trains bitwise as on local disk,
    though the store is killed mid-fetch and comes back 2 s later, and rank 1 is killed after a checkpoint."""
    job = Job(tmp_path)
    reference = job.run(_spec(job, str(local), tmp_path / "ckpt-local"), timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    (local_run,) = (job.runs / "t").iterdir()

    cache = tmp_path / "cache"
    spec = _spec(job, "s3://phalanx-test/ds", tmp_path / "ckpt", f", cache_dir: '{cache}', cache_bytes: 128KiB")
    sup = subprocess.Popen(
        job.argv(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=store.env
    )
    runs = lambda: [d for d in (job.runs / "t").iterdir() if d != local_run]  # noqa: E731
    try:
        _wait("no step", lambda: any((d / "metrics.jsonl").exists() for d in runs()), sup)
        (run,) = runs()
        store.kill()  # mid-fetch: the look-ahead fetches as training goes, the cache being small
        time.sleep(2)
        store.start()
        _wait("no checkpoint", lambda: (tmp_path / "ckpt" / "step-00000016" / "COMMITTED").exists(), sup)
        started = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "attempt_started"]
        os.kill(int(started[-1]["pids"]["1"]), signal.SIGKILL)
        out, _ = sup.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            sup.kill()
    assert sup.returncode == 0, out[-3000:]
    assert "SIGKILL" in out and "resumed from" in out
    logs = "".join(p.read_text() for p in (run / "logs").glob("rank-*.log"))
    assert "not fetched" in logs and "trying again" in logs  # the outage hit fetches, which were tried again
    assert _losses(run) == _losses(local_run)  # every step, bitwise
    needed = _chunks_of(local, range(24), 0, SEED) | _chunks_of(local, range(24), 1, SEED)
    assert sum(_cached(cache).values()) <= (128 << 10) * 1.1 < len(needed) * CHUNK  # it evicted to stay bounded
    metrics = list(read_jsonl(run / "metrics.jsonl"))
    assert all(m["data_fetched_bytes"] >= 0 and 0 <= m["data_cache_hit_rate"] <= 1 for m in metrics)
    said = digest(RunDir(run))
    assert said.data.fetched_bytes > 0 and said.data.wait_s > 1  # the loader waited out the outage
    # The ledger counts as data what the steps waited for their batches, which the look-ahead may have hidden.
    assert said.ledger.seconds["data"] == pytest.approx(sum(m["data_wait_s"] for m in metrics), abs=0.05)
    written = b"".join(p.read_bytes() for p in run.rglob("*") if p.is_file())
    assert store.env["AWS_SECRET_ACCESS_KEY"].encode() not in written


@pytest.mark.timeout(20)  # the budget and one request's bound, not botocore's 60 s read timeout, tried 5 times
def test_a_frozen_store_fails_the_fetch_by_its_budget(
    tmp_path: Path, store: _Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that is frozen (SIGSTOP: connections still accepted by the kernel, never answered) is a try that
    fails by the request's bound, then a DataFetchError naming what was not fetched, not a wait."""
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(key, store.env[key])
    settings = CacheSettings(tmp_path / "cache", 1 << 30, fetch_timeout_s=2, sharers=1)
    open_dataset("s3://phalanx-test/ds", cache=settings)  # answering
    os.kill(store.server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(DataFetchError, match=r"s3://phalanx-test/ds/index.json: not fetched in 2 s") as failed:
            open_dataset("s3://phalanx-test/ds", cache=settings)
        assert type(failed.value.__cause__).__name__ == "ReadTimeoutError"  # each try ended by its own bound
    finally:
        os.kill(store.server.pid, signal.SIGCONT)


def test_two_local_nodes_fetch_disjoint_chunks(tmp_path: Path, local: Path, s3_server) -> None:
    """Under --local-nodes each node has its own cache, and fetches the chunks of its own rank's rows alone."""
    url = _upload(local, "nodes")
    job = Job(tmp_path)
    cache = tmp_path / "cache"
    spec = job.spec(
        f"name: t\nresources: {{nodes: 2, procs_per_node: 1, device: cpu}}\n{TRAIN.replace('steps: 24', 'steps: 4')}"
        f"data: {{sources: [{{path: '{url}'}}], cache_dir: '{cache}'}}\n"
    )
    result = subprocess.run([*job.argv(spec), "--local-nodes"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    fetched = [set(_cached(cache / f"local-node-{n}")) for n in range(2)]
    for node in range(2):
        needed, reach = _chunks_of(local, range(4), node, SEED), _chunks_of(local, range(4 + AHEAD + 3), node, SEED)
        assert needed <= fetched[node] <= reach
    assert not fetched[0] & fetched[1]
