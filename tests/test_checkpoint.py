"""Checkpoints: atomic commit, retention, corruption fallback, kill-and-resume, resharding to other layouts.

Over 400 lines on purpose: the checkpoint's guarantees are one contract, and its tests share the trained runs
they resume and reshard (module-scoped fixtures), which one file lets them do without training again."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import json
import math
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, Job, wait_gone
from phalanx.checkpoint import CheckpointDir
from phalanx.checkpoint.export import read_model
from phalanx.checkpoint.interval import choose, default_mtbf_hours
from phalanx.checkpoint.writer import WINDOW, storage_writer
from phalanx.obs import read_jsonl
from phalanx.train.models.args import PRESETS, LlamaConfig
from phalanx.train.models.llama import Llama


def _spec(job: Job, ckpt: Path | str, procs: int = 2, parallel: str = "{}", steps: int = 12, extra: str = "") -> Path:
    return job.spec(
        f"name: t\nresources: {{procs_per_node: {procs}, device: cpu}}\n"
        f"train: {{model: {{preset: llama-tiny}}, parallel: {parallel}, steps: {steps}, global_batch: 8,"
        f" micro_batch: 2, seq_len: 32, optimizer: {{lr: 3.0e-3, warmup_steps: 2}}}}\n"
        f"checkpoint: {{dir: '{ckpt}', every_steps: 2, keep_last: 2{extra}}}\n"
    )


def _run(job: Job, spec: Path) -> subprocess.CompletedProcess[str]:
    result = job.run(spec, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def _weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{ckpt.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)["train"]["model"]


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run_dirs(job: Job) -> list[Path]:
    """The job's run directories in the order they were started."""
    return sorted((job.runs / "t").iterdir(), key=lambda d: next(read_jsonl(d / "events.jsonl"))["ts"])


def _start(job: Job, spec: Path) -> tuple[subprocess.Popen[str], dict[int, int]]:
    """Start ``phalanx run`` in the background; return it and its workers' pids once they are started."""
    before = set((job.runs / "t").iterdir()) if (job.runs / "t").is_dir() else set()
    sup = subprocess.Popen(job.argv(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    while True:
        new = set((job.runs / "t").iterdir()) - before if (job.runs / "t").is_dir() else set()
        for events in (d / "events.jsonl" for d in new):
            for e in read_jsonl(events) if events.is_file() else ():
                if e["kind"] == "attempt_started":
                    return sup, {int(rank): int(pid) for rank, pid in e["pids"].items()}
        assert sup.poll() is None and time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.01)


def test_commit_retention_and_manifest(job: Job, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(job, _spec(job, ckpt, steps=10, extra=", keep_every: 4"))
    (run,) = _run_dirs(job)
    ls = subprocess.run([sys.executable, "-m", "phalanx", "ckpt", "ls", str(run)], capture_output=True, text=True)
    assert ls.returncode == 0 and "no checkpoints in" in ls.stderr  # checkpoint.dir points outside the run dir
    verified = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "verify", str(ckpt)], capture_output=True, text=True
    )
    assert verified.returncode == 0 and verified.stdout.count(" valid ") == 3
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "step-00000004",
        "step-00000008",
        "step-00000010",
    ]  # last 2 (8, 10) plus every 4th (4, 8)
    manifest = json.loads((ckpt / "step-00000010" / "manifest.json").read_text())
    assert manifest["step"] == 10 and manifest["layout"] == {
        "pp": 1,
        "pp_schedule": "1F1B",
        "pp_stages_per_rank": 1,
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 1,
    }
    assert manifest["world_size"] == 2 and len(manifest["spec_hash"]) == 16
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    for name, described in manifest["files"].items():  # the shards hashed while written, .metadata read back
        data = (ckpt / "step-00000010" / name).read_bytes()
        assert described == {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}, name
    assert CheckpointDir(ckpt).verify(10) is None
    _rewrite_checksums(ckpt / "step-00000010", lambda data: {"sha256": hashlib.sha256(data).hexdigest()})
    assert CheckpointDir(ckpt).verify(10) is None  # written before xxh3_128: sha256 still verifies
    _rewrite_checksums(ckpt / "step-00000010", lambda data: {"sha256": hashlib.sha256(data + b"x").hexdigest()})
    assert CheckpointDir(ckpt).verify(10) == ".metadata does not match its sha256 in the manifest (corrupt)"
    _rewrite_checksums(ckpt / "step-00000010", lambda data: {"md5": hashlib.md5(data).hexdigest()})
    assert CheckpointDir(ckpt).verify(10) == "the manifest gives .metadata no checksum (one of sha256, xxh3_128)"
    shard = ckpt / "step-00000008" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    assert CheckpointDir(ckpt).verify(8) == f"__0_0.distcp is {size - 100} bytes, the manifest says {size}"
    (ckpt / "step-00000004" / "manifest.json").write_text("{}")
    assert CheckpointDir(ckpt).verify(4) == "manifest.json does not match the sha256 in COMMITTED (corrupt)"


def _rewrite_checksums(step_dir: Path, checksum: Callable[[bytes], dict[str, str]]) -> None:
    """Recommit ``step_dir`` with each file's checksum as ``checksum`` gives it, as another writer would."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (step_dir / name).read_bytes()
        manifest["files"][name] = {"size": len(data), **checksum(data)}
    (step_dir / "COMMITTED").unlink()
    CheckpointDir(step_dir.parent).commit(manifest["step"], manifest)


def test_a_file_written_out_of_order_is_not_hashed_in_writing(tmp_path: Path) -> None:
    writer, written = storage_writer(str(tmp_path), local=True)
    with writer.fs.create_stream(tmp_path / "appended", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(b"defg"))
    with writer.fs.create_stream(tmp_path / "rewritten", "wb") as stream:
        stream.write(b"abc")
        stream.seek(0)
        stream.write(b"x")
    assert written == {"appended": {"size": 7, "xxh3_128": xxhash.xxh3_128_hexdigest(b"abcdefg")}}
    assert (tmp_path / "rewritten").read_bytes() == b"xbc"  # left to be read back


def _cached_bytes(path: Path) -> int:
    """How much of ``path`` is in the page cache (mincore(2) over a mapping of it)."""
    size = path.stat().st_size
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        page = mmap.PAGESIZE
        vector = (ctypes.c_ubyte * ((size + page - 1) // page))()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(address), size, vector) == 0
        return sum(v & 1 for v in vector) * page


def test_a_checkpoint_file_is_written_through_a_small_window_of_the_page_cache(tmp_path: Path) -> None:
    """What the writer wrote leaves the page cache as it goes: at most ``WINDOW`` of a file stays cached, where
    a file written plainly stays cached whole (unless the file system keeps no cache apart, as tmpfs)."""
    data = os.urandom(1 << 20) * (WINDOW * 4 >> 20)
    plain = tmp_path / "plain"
    with plain.open("wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    if _cached_bytes(plain) < len(data) // 2:
        pytest.skip("this file system does not keep written files in the page cache")
    with plain.open("rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _cached_bytes(plain) > 0:
        pytest.skip("this file system keeps its files in memory (tmpfs): there is no page cache to spare")
    writer, written = storage_writer(str(tmp_path), local=True)
    with writer.fs.create_stream(tmp_path / "windowed", "wb") as stream:
        for chunk in range(0, len(data), 1 << 20):
            stream.write(data[chunk : chunk + (1 << 20)])
        os.fsync(stream.fileno())
    assert _cached_bytes(tmp_path / "windowed") <= WINDOW
    assert (tmp_path / "windowed").read_bytes() == data and written["windowed"]["size"] == len(data)


def test_sync_and_async_saves_hold_the_same_state(job: Job, tmp_path: Path) -> None:
    """Every checkpoint of an async run, the one of step 2 included, which training went on from (forward,
    backward and the optimizer step of steps 3 and 4 ran beside its write), holds exactly what a sync run's
    holds: the copy was taken before the optimizer changed the weights."""
    _run(job, _spec(job, tmp_path / "async", steps=4))
    _run(job, _spec(job, tmp_path / "sync", steps=4, extra=", async: false"))
    for step in (2, 4):
        saved = {}
        for mode in ("async", "sync"):
            out = tmp_path / f"{mode}-{step}.pt"
            dcp_to_torch_save(tmp_path / mode / f"step-{step:08d}", out)
            saved[mode] = torch.load(out, weights_only=False)
        assert saved["async"]["progress"] == saved["sync"]["progress"] == {"step": step}
        for part in ("model", "optim"):
            a, b = (dict(_flat(saved[mode]["train"][part])) for mode in ("async", "sync"))
            _assert_same(a, b)
            assert len(a) > 10  # every parameter (and, for the optimizer, every moment and step count)


def _flat(tree: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a nested state dict, keyed by their path."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, int | float):
        yield prefix, torch.tensor(tree)


def test_kill_9_then_resume_ends_bitwise_identical(job: Job, tmp_path: Path) -> None:
    """kill -9 every process of a run once a checkpoint is committed; rerun; the weights end identical."""
    _run(job, _spec(job, tmp_path / "straight"))
    spec = _spec(job, tmp_path / "killed")
    sup, pids = _start(job, spec)
    marker = tmp_path / "killed" / "step-00000004" / "COMMITTED"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert sup.poll() is None and time.monotonic() < deadline, "no checkpoint before the kill"
        time.sleep(0.01)
    for pid in [sup.pid, *pids.values()]:
        with contextlib.suppress(ProcessLookupError):  # a worker may be gone already: it dies with the supervisor
            os.kill(pid, signal.SIGKILL)
    sup.wait()
    wait_gone(list(pids.values()))  # no worker of the killed run still writes when the rerun starts
    resumed = _run(job, spec)
    assert "resumed from" in resumed.stdout
    start = int(resumed.stdout.split("resumed from")[1].split("at step ")[1].split()[0])
    assert start >= 4
    straight = _losses(_run_dirs(job)[0])
    again = _losses(_run_dirs(job)[-1])
    assert min(again) == start and all(again[s] == straight[s] for s in again)  # bitwise, step by step
    _assert_same(
        _weights(tmp_path / "straight" / "step-00000012", tmp_path),
        _weights(tmp_path / "killed" / "step-00000012", tmp_path),
    )


def test_corrupt_or_unfinished_newest_checkpoint_falls_back(job: Job, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(job, _spec(job, ckpt, steps=6))
    shard = ckpt / "step-00000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "__1_0.distcp does not match its xxh3_128" in CheckpointDir(ckpt).verify(6)
    cli = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "verify", str(ckpt)], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 1 and "1 invalid checkpoint(s)" in cli.stderr
    listed = [line.split()[:3] for line in cli.stdout.splitlines()[1:]]
    assert listed == [["4", "1.8", "MiB"], ["6", "1.8", "MiB"]] and "valid" in cli.stdout.splitlines()[1]
    assert "invalid: __1_0.distcp does not match its xxh3_128" in cli.stdout.splitlines()[2]
    shutil.copytree(ckpt / "step-00000004", ckpt / "step-00000008")
    (ckpt / "step-00000008" / "COMMITTED").unlink()  # a save that died before its commit
    result = _run(job, _spec(job, ckpt, steps=7))
    assert "step-00000008 skipped: no commit marker" in result.stdout
    assert "step-00000006 skipped: __1_0.distcp does not match its xxh3_128 in the manifest (corrupt)" in result.stdout
    assert "at step 4" in result.stdout


@pytest.fixture(scope="module")
def saved_by_fsdp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """A checkpoint of step 4 saved by FSDP over 4 ranks, and the losses of steps 4 and 5 that FSDP 4 goes on with."""
    job = Job(tmp_path_factory.mktemp("fsdp4"))
    saved = job.tmp / "saved"
    _run(job, _spec(job, saved, procs=4, parallel="{dp_shard: 4}", steps=4))
    shutil.copytree(saved, job.tmp / "same")
    _run(job, _spec(job, job.tmp / "same", procs=4, parallel="{dp_shard: 4}", steps=6))
    return saved, _losses(_run_dirs(job)[-1])


@pytest.mark.parametrize(
    "procs, parallel",
    [
        (1, "{}"),
        (2, "{}"),
        (2, "{tp: 2}"),
        (4, "{dp_replicate: 2, dp_shard: 2}"),
        (2, "{pp: 2}"),
        (4, "{pp: 2, dp_shard: 2}"),
    ],
    ids=["1rank", "fsdp2", "tp2", "hsdp2x2", "pp2", "pp2_fsdp2"],
)
def test_checkpoint_reshards_into_another_layout(
    job: Job, tmp_path: Path, saved_by_fsdp4: tuple[Path, dict[int, float]], procs: int, parallel: str
) -> None:
    """Saved by FSDP over 4 ranks at step 4; continued to step 6 by another layout: the same losses."""
    saved, same = saved_by_fsdp4
    shutil.copytree(saved, tmp_path / "other")
    result = _run(job, _spec(job, tmp_path / "other", procs=procs, parallel=parallel, steps=6))
    assert "at step 4" in result.stdout
    other = _losses(job.run_dir())
    assert sorted(other) == [4, 5]
    assert [other[s] for s in (4, 5)] == pytest.approx([same[s] for s in (4, 5)], rel=1e-5)


def test_a_pipeline_checkpoint_loads_into_layouts_without_one_and_exports(
    job: Job, tmp_path: Path, saved_by_fsdp4: tuple[Path, dict[int, float]]
) -> None:
    """Saved at step 4 by 2 pipeline stages (each rank wrote its stage's blocks under the whole model's names),
    continued by one rank and by FSDP 2: the losses FSDP 4 went on with. Exported as the whole model."""
    _, same = saved_by_fsdp4
    saved = tmp_path / "pp"
    _run(job, _spec(job, saved, parallel="{pp: 2}", steps=4))
    for procs, parallel in ((1, "{}"), (2, "{}")):
        shutil.copytree(saved, tmp_path / f"{procs}")
        result = _run(job, _spec(job, tmp_path / f"{procs}", procs=procs, parallel=parallel, steps=6))
        assert "at step 4" in result.stdout
        other = _losses(_run_dirs(job)[-1])
        assert [other[s] for s in (4, 5)] == pytest.approx([same[s] for s in (4, 5)], rel=1e-5)
    cli = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "export", str(saved), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "exported step 4" in cli.stderr, cli.stderr
    _, weights = read_model(CheckpointDir(saved), 4)
    whole = Llama(PRESETS["llama-tiny"])
    assert weights.keys() == whole.state_dict().keys()  # every stage's modules, under the whole model's names


def test_kill_9_a_rank_in_the_middle_of_a_save(job: Job, tmp_path: Path) -> None:
    """Rank 1 killed while a save is being written: that checkpoint never becomes valid, the one before it
    stays the latest valid, and the job resumes from it."""
    ckpt = tmp_path / "ckpt"
    spec = job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        "train: {model: {preset: llama-debug}, steps: 40, global_batch: 8, micro_batch: 4, seq_len: 32,"
        " optimizer: {warmup_steps: 2}}\n"
        f"checkpoint: {{dir: '{ckpt}', every_steps: 2, keep_last: 2}}\n"
        "resilience: {stop_grace_s: 5, max_restarts: 0}\n"
    )
    sup, pids = _start(job, spec)
    dirs, victim = CheckpointDir(ckpt), pids[1]
    deadline, caught = time.monotonic() + 240, None
    while caught is None:
        assert sup.poll() is None and time.monotonic() < deadline, "no save was caught in flight"
        steps = dirs.steps()
        writing = [s for s in steps if not dirs.committed(s) and any((ckpt / f"step-{s:08d}").glob("*.distcp"))]
        if writing and any(dirs.committed(s) for s in steps):
            os.kill(victim, signal.SIGSTOP)  # a stopped rank 1 cannot send the hashes the commit waits for
            if dirs.committed(writing[0]):
                os.kill(victim, signal.SIGCONT)  # too late: this save got its commit; catch the next one
            else:
                caught = writing[0]
                os.kill(victim, signal.SIGKILL)
        time.sleep(0.002)
    out, _ = sup.communicate(timeout=120)
    assert sup.returncode == 1 and "rank 1" in out and "SIGKILL" in out, out[-3000:]
    previous = max(s for s in dirs.steps() if dirs.committed(s))
    assert previous == caught - 2 and not dirs.committed(caught)
    assert "no commit marker" in dirs.verify(caught) and dirs.verify(previous) is None
    short = job.spec(spec.read_text().replace("steps: 40", f"steps: {previous + 1}"))
    result = _run(job, short)
    assert f"step-{caught:08d} skipped: no commit marker" in result.stdout
    assert f"resumed from {ckpt}/step-{previous:08d} at step {previous}" in result.stdout


def test_sigterm_saves_an_emergency_checkpoint_within_the_grace_period(job: Job, tmp_path: Path) -> None:
    """SIGTERM (preemption) mid-run: every rank stops after the same step, saves it, and exits 143; the run
    resumed from that checkpoint ends with the losses of a run never stopped."""
    _run(job, _spec(job, tmp_path / "straight", steps=30, extra=", every_steps: 100"))
    (straight_run,) = _run_dirs(job)
    spec = _spec(job, tmp_path / "stopped", steps=30, extra=", every_steps: 100")
    sup = subprocess.Popen(job.argv(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    while not any(
        (m := d / "metrics.jsonl").is_file() and len(m.read_text().splitlines()) >= 4
        for d in (job.runs / "t").iterdir()
        if d != straight_run
    ):
        assert sup.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    sup.send_signal(signal.SIGTERM)
    out, _ = sup.communicate(timeout=120)
    assert sup.returncode == 143, out[-3000:]
    logs = [(_run_dirs(job)[-1] / "logs" / f"rank-{r}.log").read_text() for r in range(2)]
    stopped_at = [int(log.split("emergency checkpoint of step ")[1].split()[0]) for log in logs]  # each rank's word
    saved = stopped_at[0]
    assert stopped_at == [saved, saved] and 4 <= saved < 30 and "(grace 30 s)" in out
    assert CheckpointDir(tmp_path / "stopped").steps() == [saved]
    assert CheckpointDir(tmp_path / "stopped").verify(saved) is None
    events = [e for e in read_jsonl(_run_dirs(job)[-1] / "events.jsonl") if e["kind"] == "preempted"]
    assert [e["step"] for e in events] == [saved]
    resumed = _run(job, spec)
    assert f"at step {saved}" in resumed.stdout
    straight, again = _losses(straight_run), _losses(_run_dirs(job)[-1])
    assert min(again) == saved and all(again[s] == straight[s] for s in again)


def test_s3_round_trip(job: Job, tmp_path: Path, s3_server: dict[str, str]) -> None:
    """Checkpoints written to, listed, verified, resumed and exported from a real S3-API server via s3fs."""
    url = "s3://phalanx-test/runs/t"
    _run(job, _spec(job, tmp_path / "local", steps=4))
    _run(job, _spec(job, url, steps=4))
    s3 = CheckpointDir(url)
    assert s3.steps() == [2, 4] and all(s3.verify(s) is None for s in (2, 4))
    assert s3.fs.exists("phalanx-test/runs/t/step-00000004/COMMITTED")
    verified = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "verify", url], capture_output=True, text=True, timeout=60
    )
    assert verified.returncode == 0 and f"{url}/step-00000004" in verified.stdout, verified.stderr
    _, from_s3 = read_model(s3, 4)
    _, from_disk = read_model(CheckpointDir(tmp_path / "local"), 4)
    _assert_same(from_s3, from_disk)
    result = _run(job, _spec(job, url, steps=8))
    assert f"resumed from {url}/step-00000004 at step 4" in result.stdout
    assert s3.steps() == [6, 8]  # keep_last 2: the older ones were deleted from the bucket
    local = _run(job, _spec(job, tmp_path / "local", steps=8))
    assert "at step 4" in local.stdout
    assert _losses(_run_dirs(job)[-2]) == _losses(_run_dirs(job)[-1])


@pytest.mark.parametrize(
    "procs, parallel, model",
    [
        (2, "{tp: 2}", "{preset: llama-tiny}"),
        (2, "{}", "{preset: llama-tiny, tie_embeddings: true}"),
        (2, "{tp: 2}", "{preset: llama-tiny, tie_embeddings: true}"),
    ],
    ids=["untied-from-tp2", "tied-from-fsdp2", "tied-from-tp2"],
)
def test_export_to_safetensors_reproduces_the_logits(
    job: Job, tmp_path: Path, procs: int, parallel: str, model: str
) -> None:
    import transformers  # a dev dependency

    ckpt = tmp_path / "ckpt"
    spec = _spec(job, ckpt, procs=procs, parallel=parallel, steps=4)
    spec.write_text(spec.read_text().replace("{preset: llama-tiny}", model))
    _run(job, spec)
    out = tmp_path / "hf"
    cli = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "export", str(ckpt), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "exported step 4" in cli.stderr, cli.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] == ("tie" in model)
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg, weights = read_model(CheckpointDir(ckpt), 4)
    ours = Llama(LlamaConfig(**{k: v for k, v in cfg.items() if k != "preset"}))
    ours.load_state_dict(weights)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(tokens), hf(tokens).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()
    assert hf.num_parameters() == LlamaConfig(**{k: v for k, v in cfg.items() if k != "preset"}).num_params()


def test_export_refuses_what_it_cannot_export(tmp_path: Path) -> None:
    (tmp_path / "step-00000002").mkdir()
    cli = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "export", str(tmp_path), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1 and "no valid checkpoint in" in cli.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "export", str(tmp_path), "--out", "hf", "--step", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1 and "no checkpoint of step 3" in cli.stderr and "steps there: 2" in cli.stderr
    assert not (tmp_path / "hf").exists()


def test_young_daly_interval_and_its_failure_rate() -> None:
    # sqrt(2 x 10 s x 5 h) = 600 s: 60 steps of 10 s.
    chosen = choose(cost_s=10.0, step_s=10.0, prior_mtbf_hours=5.0, failures=0, run_hours=0.0)
    assert chosen.seconds == pytest.approx(600.0) and chosen.steps == 60
    # Three failures in 15 h: (5 + 15) / 4 = 5 h between failures again, not the prior's 20 h.
    assert choose(10.0, 10.0, 5.0, failures=3, run_hours=15.0).mtbf_hours == pytest.approx(5.0)
    assert choose(10.0, 10.0, 5.0, failures=0, run_hours=15.0).mtbf_hours == pytest.approx(20.0)
    assert choose(1e-6, 100.0, 1.0, 0, 0.0).steps == 1  # never less than every step
    # The Llama 3 report's rate: 419 interruptions in 54 days on 16,384 GPUs, a 16k-GPU job fails every ~3 h.
    assert default_mtbf_hours(16_384) == pytest.approx(54 * 24 / 419)


def test_automatic_interval_is_chosen_from_measured_costs(job: Job, tmp_path: Path) -> None:
    """every_steps: auto saves every 10 steps until a save's cost is measured, then at Young/Daly's interval for
    that cost, the step time and resilience.mtbf_hours; the choice and why are printed and in the events."""
    spec = job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        "train: {model: {preset: llama-tiny}, steps: 120, global_batch: 8, micro_batch: 2, seq_len: 32}\n"
        f"checkpoint: {{dir: '{tmp_path / 'ckpt'}', every_steps: auto, keep_last: 2}}\n"
        "resilience: {mtbf_hours: 0.002}\n"  # 7 s: an interval of tens of steps at most, several in the run
    )
    result = _run(job, spec)
    assert result.returncode == 0, result.stdout[-3000:]
    events = list(read_jsonl(job.run_dir() / "events.jsonl"))
    chosen = [e for e in events if e["kind"] == "checkpoint_interval"]
    saved = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert chosen and saved[:2] == [10, 20], saved
    first = chosen[0]
    # No failure seen: the MTBF is the prior plus the hours run so far (this run lasts less than 3 minutes).
    assert first["failures"] == 0 and 0.002 < first["mtbf_hours"] < 0.002 + 0.05
    expected = max(1, round(math.sqrt(2 * first["cost_s"] * first["mtbf_hours"] * 3600) / first["step_s"]))
    assert first["steps"] == expected
    assert f"checkpoint every {first['steps']} step(s): Young/Daly" in result.stdout
    # After the first choice, saves are a chosen interval apart (but the last, at the end of the run).
    gaps = {b - a for a, b in itertools.pairwise(saved[1:]) if b != 120}
    assert gaps and gaps <= {e["steps"] for e in chosen}, (saved, chosen)
