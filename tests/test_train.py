"""The built-in recipe: every parallelism gives the single-process loss curve; MFU and LR by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO, Job
from phalanx.obs import read_jsonl
from phalanx.spec import parse_spec
from phalanx.spec.model import Optimizer
from phalanx.train.models.args import PRESETS, config_from
from phalanx.train.models.llama import Llama
from phalanx.train.recipe import model_config
from phalanx.train.trainer import lr_factor

STEPS = 12


def _train(
    job: Job,
    procs: int,
    parallel: str,
    micro_batch: int,
    held: str,
    steps: int = STEPS,
    extra: str = "",
    runs_as: str = "",
    checkpoint: str = "{}",
    model: str = "{preset: llama-tiny}",
):
    """Run the recipe through `phalanx run`; its metrics, one dict a step."""
    spec = job.spec(
        f"name: t\nresources: {{procs_per_node: {procs}, device: cpu}}\n"
        f"train: {{model: {model}, parallel: {parallel}, steps: {steps}, global_batch: 8,"
        f" micro_batch: {micro_batch}, seq_len: 32, optimizer: {{lr: 3.0e-3, warmup_steps: 2}}{extra}}}\n"
        f"checkpoint: {checkpoint}\n"
    )
    result = job.run(spec, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"rank 0 holds {held}" in result.stdout  # the parallelism really was applied
    assert f"blocks run as {runs_as}" in result.stdout
    return list(read_jsonl(job.run_dir() / "metrics.jsonl"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """Single process, the whole global batch in one micro-batch."""
    return _train(Job(tmp_path_factory.mktemp("ref")), 1, "{}", 8, "131,392 params (100.0%)")


@pytest.mark.parametrize(
    "procs, parallel, micro_batch, held",
    [
        (2, "{dp_shard: 2}", 4, "65,696 params (50.0%)"),  # FSDP2
        (4, "{dp_replicate: 2, dp_shard: 2}", 2, "65,696 params (50.0%)"),  # HSDP: sharded in 2, replicated x2
        (
            2,
            "{tp: 2}",
            4,
            "65,856 params (50.1%)",
        ),  # tensor + sequence parallel, with gradient accumulation (2 micro-batches)
        (4, "{dp_shard: 2, tp: 2}", 4, "32,928 params (25.1%)"),  # FSDP + TP
    ],
    ids=["fsdp2", "hsdp2x2", "tp2", "fsdp2_tp2"],
)
def test_parallel_loss_curve_matches_single_process(job: Job, reference, procs, parallel, micro_batch, held) -> None:
    _assert_same_curve(_train(job, procs, parallel, micro_batch, held), reference, procs)


def test_tensor_parallel_with_tied_embeddings_matches_single_process(job: Job, tmp_path_factory) -> None:
    """The embedding and the output projection share one matrix, sharded by vocabulary across the TP ranks."""
    tied = "{preset: llama-tiny, tie_embeddings: true}"
    reference = _train(Job(tmp_path_factory.mktemp("tied")), 1, "{}", 8, "115,008 params (100.0%)", model=tied)
    _assert_same_curve(_train(job, 2, "{tp: 2}", 4, "57,664 params (50.1%)", model=tied), reference, 2)
    presets = "name: t\nresources: {procs_per_node: 2}\ntrain: {model: {preset: llama3-1b}, parallel: {tp: 2}}\n"
    assert model_config(parse_spec(presets)).tie_embeddings  # llama3-1b and 3b take tp > 1


FOUR_BLOCKS = "{preset: llama-tiny, n_layers: 4}"  # room for 2 pipeline stages of 2 blocks, or 4 of 1


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory) -> list[dict]:
    """The pipeline tests' model on a single process, the whole global batch in one micro-batch."""
    return _train(Job(tmp_path_factory.mktemp("four")), 1, "{}", 8, "229,952 params (100.0%)", model=FOUR_BLOCKS)


@pytest.mark.parametrize(
    "procs, parallel, held",
    [
        (2, "{pp: 2}", "114,944 params (50.0%)"),  # 1F1B, 4 micro-batches over 2 stages
        (2, "{pp: 2, pp_schedule: GPipe}", "114,944 params (50.0%)"),
        # rank 0 runs stages 0 and 2 of 4 (the embedding, blocks 0 and 2), rank 1 stages 1 and 3
        (2, "{pp: 2, pp_schedule: Interleaved1F1B, pp_stages_per_rank: 2}", "114,944 params (50.0%)"),
        (2, "{pp: 2, pp_schedule: InterleavedZeroBubble, pp_stages_per_rank: 2}", "114,944 params (50.0%)"),
        # V-shaped: rank 0 runs stages 0 and 3 (the embedding, blocks 0 and 3, the norm and the output)
        (2, "{pp: 2, pp_schedule: ZBVZeroBubble, pp_stages_per_rank: 2}", "131,392 params (57.1%)"),
        (4, "{pp: 2, dp_shard: 2}", "57,472 params (25.0%)"),  # each stage FSDP-sharded over 2 ranks
        (4, "{pp: 2, tp: 2}", "57,600 params (25.0%)"),  # each stage tensor-parallel over 2 ranks
        (8, "{pp: 2, dp_shard: 2, tp: 2}", "28,800 params (12.5%)"),  # the 4-D mesh: pp x dp_replicate x dp_shard x tp
    ],
    ids=[
        "pp2_1f1b",
        "pp2_gpipe",
        "pp2_interleaved",
        "pp2_interleaved_zb",
        "pp2_zbv",
        "pp2_fsdp2",
        "pp2_tp2",
        "pp2_fsdp2_tp2",
    ],
)
def test_pipeline_loss_curve_matches_single_process(job: Job, four_blocks, procs, parallel, held) -> None:
    got = _train(job, procs, parallel, 2, held, model=FOUR_BLOCKS)
    _assert_same_curve(got, four_blocks, procs)
    assert all(m["bubble"] is not None and 0 < m["bubble"] < 1 for m in got)


def _assert_same_curve(got: list[dict], reference: list[dict], procs: int) -> None:
    assert [m["step"] for m in got] == list(range(STEPS))
    want_loss = [m["loss"] for m in reference]
    assert want_loss[-1] < want_loss[0] - 0.05  # the run learns, so the comparison means something
    assert [m["loss"] for m in got] == pytest.approx(want_loss, rel=1e-5)
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in reference], rel=1e-4)
    assert [m["lr"] for m in got] == pytest.approx([m["lr"] for m in reference], rel=1e-12)
    assert all(m["tokens_per_s_per_device"] == pytest.approx(m["tokens_per_s"] / procs) for m in got)


@pytest.mark.parametrize(
    "option, rel, runs_as",
    [
        ("activation_checkpoint: full", 1e-6, "CheckpointWrapper, fp32"),  # recomputation: the same numbers
        ("activation_checkpoint: selective", 1e-6, "CheckpointWrapper, fp32"),
        ("compile: true", 1e-4, "OptimizedModule, fp32"),  # inductor fuses and reorders float ops
        ("precision: bf16", 1e-3, "Block, bf16"),  # bf16 autocast: close to fp32
    ],
)
def test_memory_and_speed_options_keep_the_loss_curve(job: Job, reference, option: str, rel: float, runs_as) -> None:
    got = [m["loss"] for m in _train(job, 1, "{}", 8, "131,392", steps=4, extra=f", {option}", runs_as=runs_as)]
    want = [m["loss"] for m in reference[:4]]
    assert got == pytest.approx(want, rel=rel)
    if "bf16" in option:
        assert got != want  # and not equal: autocast really ran in bf16


def test_throughput_is_tokens_over_the_wall_time_between_steps(job: Job) -> None:
    """A step's time is the wall time since the previous step ended, so what runs between steps is inside it:
    here a sync checkpoint after every second step, whose blocking the next step reports as checkpoint_s.
    tokens/s is the global batch's tokens over that time. (Per device, tokens/s is divided by the world size:
    test_parallel_loss_curve_matches_single_process.)"""
    got = _train(job, 1, "{}", 8, "131,392", steps=6, checkpoint="{every_steps: 2, async: false}")
    saves = [e for e in read_jsonl(job.run_dir() / "events.jsonl") if e["kind"] == "checkpoint_committed"]
    assert [e["step"] for e in saves] == [2, 4, 6]
    for save in saves[:2]:  # the one at the end has no step after it
        assert got[save["step"]]["checkpoint_s"] >= save["blocked_s"] > 0
    for m in got:
        assert m["step_time_s"] >= m["checkpoint_s"]
        assert m["tokens_per_s"] == pytest.approx(8 * 32 / m["step_time_s"])
        assert m["mfu"] is None  # a CPU has no datasheet peak unless train.peak_tflops is set


def test_peak_memory_is_the_process_peak(reference) -> None:
    """On CPU the figure is the process's peak resident memory: it never falls from step to step, and it grows
    by what the process touches."""
    import torch

    from phalanx.obs.metrics import peak_memory_bytes

    peaks = [m["peak_memory_bytes"] for m in reference]
    assert peaks == sorted(peaks)
    before = peak_memory_bytes(torch.device("cpu"))
    held = torch.ones(before // 8 + 2**26, dtype=torch.float64)  # 512 MiB more than the peak so far, written
    assert peak_memory_bytes(torch.device("cpu")) >= held.numel() * 8 > before


def test_flops_per_token_by_hand() -> None:
    cfg = PRESETS["llama-tiny"]  # dim 64, 2 layers, 4 heads (head dim 16), 2 kv heads, ffn 192, vocab 256
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # wq, wk, wv (2 kv heads x 16), wo
    ffn = 3 * 64 * 192
    block = attention + ffn + 2 * 64  # and two RMSNorm weights
    non_embedding = 2 * block + 64 + 256 * 64  # final norm and the output projection
    assert cfg.num_params() == non_embedding + 256 * 64 == sum(p.numel() for p in Llama(cfg).parameters())
    seq = 32
    assert cfg.flops_per_token(seq) == 6 * non_embedding + 12 * 2 * 4 * 16 * seq


def test_real_presets_have_the_published_sizes() -> None:
    billions = {
        name: round(PRESETS[name].num_params() / 1e9, 2)
        for name in ("llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b")
    }
    assert billions == {"llama3-1b": 1.24, "llama3-3b": 3.21, "llama3-8b": 8.03, "llama3-70b": 70.55}


def test_mfu_uses_the_configured_peak(job: Job) -> None:
    got = _train(job, 1, "{}", 8, "131,392", steps=2, extra=", peak_tflops: 0.5")
    cfg = PRESETS["llama-tiny"]
    for m in got:
        assert m["mfu"] == pytest.approx(cfg.flops_per_token(32) * m["tokens_per_s_per_device"] / 0.5e12)


def test_lr_schedule() -> None:
    opt = Optimizer(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(opt, 110, s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(opt, 110, 10) == pytest.approx(1.0)
    assert lr_factor(opt, 110, 60) == pytest.approx(0.55)  # halfway down the cosine
    assert lr_factor(opt, 110, 110) == pytest.approx(0.1)
    linear = opt.model_copy(update={"schedule": "linear"})
    assert lr_factor(linear, 110, 35) == pytest.approx(1 - 0.9 * 0.25)
    assert math.isclose(lr_factor(opt.model_copy(update={"schedule": "constant"}), 110, 100), 1.0)


@pytest.mark.parametrize(
    "train, path, fragment",
    [
        (
            "{model: {preset: llama-tiny}, parallel: {tp: 4}}",
            "train.parallel.tp",
            "4 does not divide model.n_kv_heads = 2",
        ),
        ("{model: {preset: gpt2}}", "train.model.preset", "'gpt2' is not a preset; valid presets: llama-tiny"),
        (
            "{model: {preset: llama-tiny, n_layers: 3}, parallel: {pp: 2}}",
            "train.parallel.pp",
            "pp x pp_stages_per_rank = 2 x 1 = 2 stages do not divide model.n_layers = 3",
        ),
        (
            "{model: {preset: llama3-1b}, parallel: {pp: 2}}",
            "train.parallel.pp",
            "the embedding is in the first stage and the output projection in the last",
        ),
        ("{model: {preset: llama-tiny, n_heads: 3}}", "train.model", "must be divisible by model.n_heads = 3"),
        ("{model: {preset: llama-tiny}, seq_len: 4096}", "train.seq_len", "longer than the model's max_seq_len 2048"),
    ],
)
def test_recipe_checks_the_model_against_the_spec(tmp_path, train: str, path: str, fragment: str) -> None:
    from phalanx.spec import SpecError
    from phalanx.train.recipe import model_config

    text = f"name: t\nresources: {{procs_per_node: 4}}\ntrain: {train}\n"
    with pytest.raises(SpecError) as e:
        model_config(parse_spec(text))
    assert any(i.path == path and fragment in i.message for i in e.value.issues), e.value.issues
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    cli = subprocess.run([sys.executable, "-m", "phalanx", "validate", str(spec)], capture_output=True, text=True)
    assert cli.returncode == 2 and path in cli.stderr


def test_sdk_runs_a_script_without_the_launcher(tmp_path) -> None:
    script = tmp_path / "solo.py"
    script.write_text(
        "import phalanx, torch, torch.distributed as dist\n"
        "ctx = phalanx.init(device='cpu')\n"
        "t = torch.ones(1); dist.all_reduce(t)\n"
        "print(ctx.rank, ctx.world_size, t.item(), ctx.run_dir)\nctx.report(0, loss=1.0)\nctx.close()\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "PHALANX_RUN_DIR")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "1.0", "None"]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_init_on_one_rank_gives_the_same_weights_as_whole_init(tie: bool) -> None:
    """What a one-GPU run does (build on the meta device, materialise, init) against building whole, in one
    process. With more ranks the sharded init draws its numbers per shard, which only CUDA's DTensor RNG
    makes equal to the whole init; test_built_model_at_world_size checks what holds on CPU there."""
    import torch
    import torch.distributed as dist

    from phalanx.train.parallelize import build_mesh, build_model

    spec = parse_spec(
        f"name: t\nresources: {{procs_per_node: 1}}\ntrain: {{model: {{preset: llama-tiny, tie_embeddings: {tie}}}}}\n"
    )
    cfg = model_config(spec)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = build_mesh("cpu", spec.parallel)
        whole, _ = build_model(cfg, mesh, spec.train, torch.device("cpu"), on_meta=False)
        meta, _ = build_model(cfg, mesh, spec.train, torch.device("cpu"), on_meta=True)
    finally:
        dist.destroy_process_group()
    a, b = whole.state_dict(), meta.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(whole.rope, meta.rope)
    assert sum(p.numel() for p in meta.parameters()) == cfg.num_params()
    assert (meta.output.weight is meta.tok_embeddings.weight) == tie


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def built(request, tmp_path_factory) -> list[dict]:
    """tests/workers/model_build.py run by `phalanx run` on 1 and 2 ranks: what each rank saw."""
    job = Job(tmp_path_factory.mktemp("build"))
    out = job.tmp / "out"
    out.mkdir()
    result = job.run(job.command_spec("model_build.py", str(out), procs=request.param))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(request.param)]


def test_meta_init_keeps_tied_embeddings_one_parameter(built: list[dict]) -> None:
    """Materialising a meta-device model gives each module a tensor of its own; the tie must be restored, or
    llama3-1b trains 1.50B parameters instead of 1.24B, with a separate output matrix."""
    for seen in built:
        for path in ("meta", "whole"):
            assert seen[path]["tied"], (path, seen)
            assert seen[path]["params"] == seen["expected_params"], (path, seen)


def test_bf16_keeps_the_rotary_table_fp32(built: list[dict]) -> None:
    """bf16 on one rank (autocast: activations stay fp32 between the bf16 matmuls) and with FSDP2's bf16
    parameters on two (activations in bf16): either way the rotary table reaches attention in fp32, where
    FSDP would cast every floating-point input of a block."""
    activations = "torch.float32" if len(built) == 1 else "torch.bfloat16"
    for seen in built:
        for path in ("meta", "whole"):
            assert seen[path]["attention_inputs"] == [[activations, "torch.float32"]] * 2, (path, seen)


def test_pipeline_ranks_build_their_stages_both_ways(job: Job) -> None:
    """Each of 2 pipeline ranks holds its stage's modules under the whole model's names, the two ranks all of
    them and nothing twice, built on the meta device or whole; nothing is left on the meta device, and each
    stage computes with the rotary table."""
    out = job.tmp / "out"
    out.mkdir()
    result = job.run(job.command_spec("pipeline_build.py", str(out), procs=2))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    whole = sorted(Llama(config_from("llama-tiny", n_layers=4)).state_dict())
    for path in ("meta", "whole"):
        first, second = (set(seen[path]["names"]) for seen in ranks)
        assert not first & second and sorted(first | second) == whole, path
        assert "tok_embeddings.weight" in first and "output.weight" in second
        assert not any(seen[path]["on_meta"] for seen in ranks) and all(seen[path]["rope"] for seen in ranks)
