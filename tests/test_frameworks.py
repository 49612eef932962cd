"""Other frameworks' jobs under phalanx (phalanx.integrations): DeepSpeed's example at every ZeRO stage, killed,
torn inside a save and preempted, and Megatron's at tensor parallel 2, killed, against uninterrupted runs of the
same scripts; their checkpoints imported into the recipe's format, continued by the recipe and exported for
transformers, whose logits are the frameworks' own."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import REPO, Job
from phalanx.checkpoint import CheckpointDir
from phalanx.obs.events import read_jsonl
from phalanx.train.models.args import PRESETS
from phalanx.train.models.llama import Llama
from servers import PhalanxServer
from test_platform import steps, wait_for
from test_resilience import _launch, _when_attempt_progressed

EXAMPLE = REPO / "examples" / "deepspeed_zero.py"
STEPS, EVERY = 24, 4
Straight = Callable[[int], tuple[dict[int, float], Path]]  # a ZeRO stage's clean run: its losses, its checkpoints


def _spec(job: Job, where: Path, zero: int, script: Path = EXAMPLE, steps: int = STEPS) -> Path:
    return job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        f'command: [python, "{script}", --zero, "{zero}", --steps, "{steps}"]\n'
        f"checkpoint: {{dir: '{where}', every_steps: {EVERY}, keep_last: 3}}\n"
        "resilience: {max_restarts: 2, restart_backoff_s: 0, stop_grace_s: 60}\n"
    )


def _losses(run: Path) -> dict[int, float]:
    """Each step's loss, its last execution's (a step run again after a restart counts as run then)."""
    return {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Straight:
    """The example run through without a failure at a ZeRO stage, once per stage for the whole module."""
    done: dict[int, tuple[dict[int, float], Path]] = {}

    def run(zero: int) -> tuple[dict[int, float], Path]:
        if zero not in done:
            job = Job(tmp_path_factory.mktemp(f"straight-zero{zero}"))
            result = job.run(_spec(job, job.tmp / "ckpt", zero), timeout=300)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            (run,) = (job.runs / "t").iterdir()
            losses = _losses(run)
            assert sorted(losses) == list(range(STEPS))
            done[zero] = losses, job.tmp / "ckpt"
        return done[zero]

    return run


@pytest.mark.parametrize("zero", [1, 3])  # ZeRO-2's kill is the next test's, inside a save
def test_deepspeed_killed_resumes_with_the_losses_of_a_run_never_stopped(
    job: Job, tmp_path: Path, straight: Straight, zero: int
) -> None:
    """A rank killed at a step drawn after the first checkpoint: the job restarts, resumes at the newest
    checkpoint, and every step's loss equals the uninterrupted run's."""
    expected, _ = straight(zero)
    sup, run = _launch(job, _spec(job, tmp_path / "killed", zero))
    rng = random.Random(zero)
    pids = _when_attempt_progressed(sup, run, 0, rng.randint(EVERY + 1, STEPS - 8), committed=True)
    done = max(m["step"] for m in read_jsonl(run / "metrics.jsonl")) + 1
    os.kill(pids[rng.randint(0, 1)], signal.SIGKILL)
    out, _ = sup.communicate(timeout=300)
    assert sup.returncode == 0, out[-4000:]
    resumed = int(out.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert EVERY <= resumed <= done and resumed % EVERY == 0, out[-3000:]
    assert _losses(run) == expected


def test_deepspeed_kill_inside_a_save_skips_the_torn_checkpoint(job: Job, tmp_path: Path, straight: Straight) -> None:
    """ZeRO-2, rank 1 killed inside the save of step 8 (after writing a file of it): that checkpoint is never committed,
    the restart says it skips it and resumes at step 4, and nothing is lost: the losses equal a clean run's."""
    expected, _ = straight(2)
    spec = _spec(job, tmp_path / "torn", 2, script=REPO / "tests" / "workers" / "deepspeed_torn.py")
    spec.write_text(spec.read_text() + "env: {TEAR_STEP: '8'}\n")
    result = job.run(spec, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "step-00000008 skipped: no commit marker" in result.stdout, result.stdout[-4000:]
    assert "resumed from" in result.stdout and "at step 4" in result.stdout
    assert _losses(max((job.runs / "t").iterdir())) == expected
    assert CheckpointDir(tmp_path / "torn").latest_valid() == STEPS


def test_deepspeed_sigterm_commits_an_emergency_checkpoint(job: Job, tmp_path: Path) -> None:
    """SIGTERM during training (a preemption, a cancel): every rank stops at the same step after saving it, and
    that checkpoint is committed and verifies."""
    sup, run = _launch(job, _spec(job, tmp_path / "stopped", 3, steps=400))
    _when_attempt_progressed(sup, run, 0, 6)
    sup.send_signal(signal.SIGTERM)
    out, _ = sup.communicate(timeout=120)
    assert sup.returncode == 128 + signal.SIGTERM, out[-3000:]
    (stopped,) = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "preempted"]
    checkpoints = CheckpointDir(tmp_path / "stopped")
    assert checkpoints.latest_valid() == stopped["step"] > 6
    assert checkpoints.manifest(stopped["step"])["framework"] == "deepspeed"


def test_deepspeed_job_through_the_server_is_cancelled_with_a_checkpoint_and_resumed(server: PhalanxServer) -> None:
    """The platform runs a DeepSpeed job as any job: submitted to `phalanx server` and cancelled mid-run, it saves
    first (the server lists that checkpoint, valid); resumed, it goes on from it to the end, each step once."""
    client = server.member("ml", 2, "erin")
    spec = (
        "name: ds\nresources: {procs_per_node: 2, device: cpu}\n"
        f'command: [python, "{EXAMPLE}", --zero, "2", --steps, "300"]\ncheckpoint: {{every_steps: 1000}}\n'
    )
    job_id = client.submit(spec)["id"]
    wait_for(client, job_id, steps=5)
    client.cancel(job_id)
    done = wait_for(client, job_id, {"CANCELLED"})
    (saved,) = client.checkpoints(job_id)  # the emergency save, the only one
    assert saved["problem"] is None and saved["step"] == done["steps_done"] < 300
    again = wait_for(client, client.submit(None, resume_from=job_id)["id"], {"SUCCEEDED"})
    assert again["resumed_from"] == job_id
    assert [s for _, s in steps(client, again["id"])] == list(range(saved["step"], 300))


def test_importing_what_is_no_checkpoint_says_what_was_looked_for(tmp_path: Path) -> None:
    said = _phalanx("ckpt", "import", str(tmp_path), "--out", str(tmp_path / "out"))
    assert said.returncode == 1 and "no DeepSpeed (*model_states.pt) or Megatron" in said.stderr, said.stderr
    assert not (tmp_path / "out").exists()


def _phalanx(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", *argv], capture_output=True, text=True, timeout=300)


def _continues(job: Job, imported: Path, step: int) -> None:
    """The built-in recipe (llama-tiny, FSDP over 2 processes) goes on from the imported checkpoint of ``step``."""
    spec = job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        f"train: {{model: {{preset: llama-tiny}}, steps: {step + 2}, global_batch: 4, micro_batch: 2, seq_len: 16}}\n"
        f"checkpoint: {{dir: '{imported}', every_steps: 100}}\n"
    )
    continued = job.run(spec, timeout=300)
    assert continued.returncode == 0, continued.stdout[-3000:]
    assert "resumed from" in continued.stdout and f"at step {step}" in continued.stdout, continued.stdout[-3000:]


@pytest.mark.parametrize("zero", [1, 3])  # DeepSpeed's universal format keeps stages 1-2 and 3 apart
def test_deepspeed_checkpoint_imported_continues_in_the_recipe_and_exports(
    job: Job, tmp_path: Path, straight: Straight, zero: int
) -> None:
    """`phalanx ckpt import` of the clean run's checkpoint: the recipe continues it at FSDP 2 from its step (ZeRO-3's),
    and `phalanx ckpt export` gives transformers the logits of DeepSpeed's own consolidation of the same checkpoint."""
    import transformers
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, ckpt = straight(zero)
    imported, hf = tmp_path / "imported", tmp_path / "hf"
    said = _phalanx("ckpt", "import", str(ckpt), "--out", str(imported))
    assert said.returncode == 0 and f"imported step {STEPS} of" in said.stderr and "(deepspeed)" in said.stderr, (
        said.stderr[-3000:]
    )

    if zero == 3:  # the layout change is the same whatever the stage: once is enough
        _continues(job, imported, STEPS)

    said = _phalanx("ckpt", "export", str(imported), "--out", str(hf), "--step", str(STEPS))
    assert said.returncode == 0, said.stderr[-3000:]
    model = Llama(PRESETS["llama-tiny"])
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=f"step-{STEPS:08d}"))
    tokens = torch.randint(0, PRESETS["llama-tiny"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    exported = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model.eval()(tokens), atol=1e-5, rtol=1e-5)


SHIMMED = REPO / "tests" / "workers" / "megatron_cpu.py"  # the test harness's CPU shim, then the example
MEGATRON_STEPS = 16


def _megatron_spec(job: Job, where: Path) -> Path:
    return job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        f'command: [python, "{SHIMMED}", --tp, "2", --steps, "{MEGATRON_STEPS}"]\n'
        f"checkpoint: {{dir: '{where}', every_steps: 4}}\n"
        "resilience: {max_restarts: 2, restart_backoff_s: 0}\n"
    )


@pytest.fixture(scope="module")
def megatron_straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    """examples/megatron_gpt.py at tensor parallel 2, run through without a failure: its losses, its checkpoints."""
    job = Job(tmp_path_factory.mktemp("megatron-straight"))
    result = job.run(_megatron_spec(job, job.tmp / "ckpt"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    losses = _losses(next((job.runs / "t").iterdir()))
    assert sorted(losses) == list(range(MEGATRON_STEPS))
    return losses, job.tmp / "ckpt"


def test_megatron_tensor_parallel_killed_resumes_with_the_losses_of_a_run_never_stopped(
    job: Job, tmp_path: Path, megatron_straight: tuple[dict[int, float], Path]
) -> None:
    """examples/megatron_gpt.py at tensor parallel 2 under the test harness's CPU shim: a rank killed after the
    first checkpoint; the job resumes from Megatron's dist_checkpointing files with every step's loss of a run
    never stopped."""
    expected, _ = megatron_straight
    sup, run = _launch(job, _megatron_spec(job, tmp_path / "killed"))
    os.kill(_when_attempt_progressed(sup, run, 0, 6, committed=True)[1], signal.SIGKILL)
    out, _ = sup.communicate(timeout=300)
    assert sup.returncode == 0, out[-4000:]
    assert "resumed from" in out, out[-3000:]
    assert _losses(run) == expected
    assert CheckpointDir(tmp_path / "killed").manifest(MEGATRON_STEPS)["framework"] == "megatron"


def test_megatron_checkpoint_imported_continues_in_the_recipe_and_exports(
    job: Job, tmp_path: Path, megatron_straight: tuple[dict[int, float], Path]
) -> None:
    """`phalanx ckpt import` of the TP-2 run's checkpoint: the recipe continues it at FSDP 2 from its step, and
    `phalanx ckpt export` gives transformers the logits of Megatron's own forward of the same checkpoint (built
    at TP 1: dist_checkpointing reshards it)."""
    import transformers

    _, ckpt = megatron_straight
    imported, hf, tokens = tmp_path / "imported", tmp_path / "hf", tmp_path / "tokens.pt"
    said = _phalanx("ckpt", "import", str(ckpt), "--out", str(imported))
    assert said.returncode == 0 and f"imported step {MEGATRON_STEPS} of" in said.stderr, said.stderr[-3000:]
    assert "(megatron)" in said.stderr
    _continues(job, imported, MEGATRON_STEPS)

    said = _phalanx("ckpt", "export", str(imported), "--out", str(hf), "--step", str(MEGATRON_STEPS))
    assert said.returncode == 0, said.stderr[-3000:]
    torch.save(
        torch.randint(0, PRESETS["llama-tiny"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)), tokens
    )
    logits = {**os.environ, "SCRIPT": str(REPO / "tests" / "workers" / "megatron_logits.py")}  # Megatron's forward
    step_dir = CheckpointDir(ckpt).path(MEGATRON_STEPS)
    argv = [sys.executable, str(SHIMMED), step_dir, str(tokens), str(tmp_path / "ref.pt")]
    reference = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=logits)
    assert reference.returncode == 0, reference.stderr[-3000:]
    exported = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(torch.load(tokens)).logits, torch.load(tmp_path / "ref.pt"), atol=1e-5, rtol=1e-5
        )
