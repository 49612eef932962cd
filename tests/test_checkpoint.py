"""Checkpoints: atomic commit, retention, corruption fallback, kill-and-resume, resharding to other layouts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, Job
from phalanx.checkpoint import verify
from phalanx.obs import read_jsonl


def _spec(job: Job, ckpt: Path, procs: int = 2, parallel: str = "{}", steps: int = 12, extra: str = "") -> Path:
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
    assert manifest["step"] == 10 and manifest["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert manifest["world_size"] == 2 and len(manifest["spec_hash"]) == 16
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert verify(ckpt / "step-00000010") is None


def test_sync_and_async_saves_hold_the_same_weights(job: Job, tmp_path: Path) -> None:
    _run(job, _spec(job, tmp_path / "async", steps=4))
    _run(job, _spec(job, tmp_path / "sync", steps=4, extra=", async: false"))
    _assert_same(
        _weights(tmp_path / "async" / "step-00000004", tmp_path),
        _weights(tmp_path / "sync" / "step-00000004", tmp_path),
    )


def test_kill_9_then_resume_ends_bitwise_identical(job: Job, tmp_path: Path) -> None:
    """kill -9 every process of a run once a checkpoint is committed; rerun; the weights end identical."""
    _run(job, _spec(job, tmp_path / "straight"))
    spec = _spec(job, tmp_path / "killed")
    sup = subprocess.Popen(job.argv(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    marker = tmp_path / "killed" / "step-00000004" / "COMMITTED"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert sup.poll() is None and time.monotonic() < deadline, "no checkpoint before the kill"
        time.sleep(0.01)
    events = list(read_jsonl(_run_dirs(job)[-1] / "events.jsonl"))
    pids = next(e["pids"] for e in events if e["kind"] == "attempt_started")
    for pid in [sup.pid, *pids.values()]:
        os.kill(int(pid), signal.SIGKILL)
    sup.wait()
    time.sleep(0.5)
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
    assert "__1_0.distcp does not match its sha256" in verify(ckpt / "step-00000006")
    cli = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "verify", str(ckpt)], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 1 and "1 invalid checkpoint(s)" in cli.stderr
    listed = [line.split()[:3] for line in cli.stdout.splitlines()[1:]]
    assert listed == [["4", "1.8", "MiB"], ["6", "1.8", "MiB"]] and "valid" in cli.stdout.splitlines()[1]
    assert "invalid: __1_0.distcp does not match its sha256" in cli.stdout.splitlines()[2]
    shutil.copytree(ckpt / "step-00000004", ckpt / "step-00000008")
    (ckpt / "step-00000008" / "COMMITTED").unlink()  # a save that died before its commit
    result = _run(job, _spec(job, ckpt, steps=7))
    assert "step-00000008 skipped: no commit marker" in result.stdout
    assert "step-00000006 skipped: __1_0.distcp does not match its sha256 in the manifest (corrupt)" in result.stdout
    assert "at step 4" in result.stdout


@pytest.mark.parametrize(
    "procs, parallel",
    [(1, "{}"), (2, "{tp: 2}"), (4, "{dp_replicate: 2, dp_shard: 2}"), (4, "{dp_shard: 4}")],
    ids=["1rank", "tp2", "hsdp2x2", "fsdp4"],
)
def test_checkpoint_reshards_into_another_layout(job: Job, tmp_path: Path, procs: int, parallel: str) -> None:
    """Saved by FSDP over 2 ranks at step 4; continued to step 6 by another layout: the same losses."""
    saved = tmp_path / "saved"
    _run(job, _spec(job, saved, steps=4))
    shutil.copytree(saved, tmp_path / "same")
    shutil.copytree(saved, tmp_path / "other")
    _run(job, _spec(job, tmp_path / "same", steps=6))
    _run(job, _spec(job, tmp_path / "other", procs=procs, parallel=parallel, steps=6))
    same, other = (_losses(d) for d in _run_dirs(job)[1:])
    assert sorted(other) == [4, 5]
    assert [other[s] for s in (4, 5)] == pytest.approx([same[s] for s in (4, 5)], rel=1e-5)
