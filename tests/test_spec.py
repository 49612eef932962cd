"""Job spec validation: good specs resolve, bad ones name the field, the value and what is valid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from phalanx.spec import JobSpec, SpecError, dump_spec, load_spec, parse_spec

ARCHITECTURE_SKETCH = """
name: tiny-llama
resources: {nodes: 1, procs_per_node: 2, device: auto}
train:
  model: {preset: llama-debug}
  parallel: {dp_replicate: 1, dp_shard: 2, tp: 1}
  steps: 200
  global_batch: 16
  micro_batch: 4
  seq_len: 256
  optimizer: {lr: 3.0e-4, warmup_steps: 20, schedule: cosine, weight_decay: 0.1, grad_clip: 1.0}
  precision: fp32
  seed: 1234
data: {sources: [{path: data/stdlib, weight: 1.0}]}
checkpoint: {dir: runs/tiny-llama/ckpt, every_steps: 50, async: true, keep_last: 3}
resilience: {max_restarts: 5, hang_timeout_s: auto, on_nan: rollback}
"""


def test_architecture_sketch_is_a_valid_spec() -> None:
    spec = parse_spec(ARCHITECTURE_SKETCH)
    assert spec.train is not None and spec.train.parallel.dp_shard == 2
    assert spec.checkpoint.async_save is True and spec.resilience.max_restarts == 5
    assert spec.data is not None and spec.data.sources[0].path == "data/stdlib"


def test_resolved_spec_round_trips_through_yaml() -> None:
    spec = parse_spec(ARCHITECTURE_SKETCH)
    again = parse_spec(dump_spec(spec))
    assert again == spec
    assert "async: true" in dump_spec(spec)  # written as the user writes it, not as the Python name


def test_dp_shard_minus_one_fills_the_world() -> None:
    spec = parse_spec("name: a\nresources: {procs_per_node: 8}\ntrain: {parallel: {dp_replicate: 2, tp: 2}}\n")
    assert spec.parallel is not None and (spec.parallel.dp_replicate, spec.parallel.dp_shard, spec.parallel.tp) == (
        2,
        2,
        2,
    )


def test_examples_are_valid() -> None:
    demo = load_spec(REPO / "examples" / "demo.yaml")
    assert demo.train is not None and demo.parallel is not None and demo.parallel.dp_shard == 2
    ddp = load_spec(REPO / "examples" / "torchrun_ddp.yaml")
    assert ddp.command is not None and ddp.resources.procs_per_node == 2


BAD = [
    ("name: a\ncommand: [x]\nresorces: {nodes: 1}\n", "resorces", "unknown key; valid keys here are: name, resources"),
    (
        "name: a\ncommand: [x]\nresources: {gpus: 2}\n",
        "resources.gpus",
        "valid keys here are: nodes, spare_nodes, procs_per_node, device",
    ),
    ("name: a\ncommand: [x]\ncheckpoint: {asynch: true}\n", "checkpoint.asynch", "every_steps, async, keep_last"),
    ("name: a\ncommand: [x]\ndata: {sources: [{path: p, wieght: 2}]}\n", "data.sources.0.wieght", "path, weight"),
    ("name: a\ncommand: [x]\nresources: {device: tpu}\n", "resources.device", "'cpu', 'cuda' or 'auto' (got 'tpu')"),
    ("name: a\ncommand: [x]\nresources: {procs_per_node: 0}\n", "resources.procs_per_node", "greater than 0 (got 0)"),
    ("name: a\ntrain: {optimizer: {lr: -1}}\n", "train.optimizer.lr", "greater than 0 (got -1)"),
    ("name: a\ntrain: {optimizer: {schedule: step}}\n", "train.optimizer.schedule", "'cosine', 'linear' or 'constant'"),
    ("name: a\ntrain: {parallel: {dp_shard: 0}}\n", "train.parallel", "dp_shard must be a positive degree, or -1"),
    ("name: a b\ncommand: [x]\n", "name", "got 'a b'"),
    ("name: a\ncommand: []\n", "command", "at least 1 item"),
    ("command: [x]\n", "name", "Field required"),
    ("name: a\n", "train|command", "give exactly one"),
    ("name: a\ncommand: [x]\ntrain: {}\n", "train|command", "give exactly one"),
    (
        "name: a\nresources: {procs_per_node: 2}\ntrain: {parallel: {dp_shard: 4}}\n",
        "train.parallel",
        "1 x 1 x 4 x 1 does not fit the world size nodes x procs_per_node = 1 x 2 = 2",
    ),
    (
        "name: a\nresources: {procs_per_node: 6}\ntrain: {parallel: {tp: 4}}\n",
        "train.parallel",
        "1 x 1 x -1 x 4 does not fit the world size nodes x procs_per_node = 1 x 6 = 6",
    ),
    (
        "name: a\nresources: {procs_per_node: 6}\ntrain: {parallel: {pp: 4}}\n",
        "train.parallel",
        "pp x dp_replicate x dp_shard x tp = 4 x 1 x -1 x 1 does not fit the world size",
    ),
    (  # a pipeline's micro-batches: global_batch / (micro_batch x dp) = 8 / (4 x 2) = 1, fewer than 2 stages
        "name: a\nresources: {procs_per_node: 4}\ntrain: {parallel: {pp: 2}, global_batch: 8, micro_batch: 4}\n",
        "train.micro_batch",
        "1 micro-batch(es) a step (global_batch / (micro_batch x data-parallel degree)) for pp = 2 stages with "
        "pp_schedule 1F1B, which needs at least one per stage",
    ),
    (
        "name: a\nresources: {procs_per_node: 2}\ntrain: {parallel: {pp: 2, pp_schedule: Interleaved1F1B, "
        "pp_stages_per_rank: 2}, global_batch: 5, micro_batch: 1}\n",
        "train.micro_batch",
        "in count // pp = 2 rounds, so the count must be a multiple of 2; valid counts near it: 2, 3, 4, 6",
    ),
    (
        "name: a\nresources: {procs_per_node: 2}\ntrain: {parallel: {pp: 2, pp_stages_per_rank: 2}}\n",
        "train.parallel",
        "pp_stages_per_rank = 2 with pp_schedule 1F1B, which runs one stage per rank",
    ),
    (
        "name: a\nresources: {procs_per_node: 2}\ntrain: {parallel: {pp: 2, pp_schedule: ZB}}\n",
        "train.parallel.pp_schedule",
        "'Interleaved1F1B', 'InterleavedZeroBubble' or 'ZBVZeroBubble'",
    ),
    (
        "name: a\nresources: {procs_per_node: 2}\ntrain: {parallel: {pp: 2, pp_schedule: ZBVZeroBubble}}\n",
        "train.parallel",
        "pp_stages_per_rank = 1 with pp_schedule ZBVZeroBubble, which runs two stages per rank",
    ),
    (
        "name: a\nresources: {procs_per_node: 4}\ntrain: {parallel: {pp: 2, pp_schedule: InterleavedZeroBubble}}\n",
        "train.parallel.pp_schedule",
        "InterleavedZeroBubble with a data-parallel degree of 2: FSDP reduces a block's gradients",
    ),
    (
        "name: a\nresources: {procs_per_node: 2}\ntrain: {parallel: {pp: 2}}\nresilience: {in_process: true}\n",
        "resilience.in_process",
        "in-process recovery does not rebuild pipeline stages yet",
    ),
    (
        "name: a\nresources: {procs_per_node: 2}\ntrain: {global_batch: 12, micro_batch: 4}\n",
        "train.global_batch",
        "12 is not a multiple of micro_batch x data-parallel degree = 4 x 2 = 8; valid values are multiples of 8",
    ),
    (
        "name: a\ntrain: {steps: 10, optimizer: {warmup_steps: 20}}\n",
        "train.optimizer.warmup_steps",
        "20 is longer than the run (train.steps = 10)",
    ),
    ("- just\n- a list\n", "", "expected a mapping of fields at the top, got list"),
    ("name: [unclosed\n", "", "not valid YAML"),
]


@pytest.mark.parametrize("text, path, fragment", BAD, ids=[b[1] or b[2][:20] for b in BAD])
def test_bad_spec_names_field_and_what_is_valid(text: str, path: str, fragment: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(text)
    matching = [i for i in e.value.issues if i.path == path]
    assert matching, f"no issue at {path!r} in {e.value.issues}"
    assert any(fragment in i.message for i in matching), matching


def test_every_issue_is_reported_not_just_the_first() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec("name: a\nresources: {device: tpu, nodes: -1}\ncommand: [x]\nbogus: 1\n")
    assert {i.path for i in e.value.issues} == {"resources.device", "resources.nodes", "bogus"}


def test_python_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match="give exactly one"):
        JobSpec(name="a")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", *args], capture_output=True, text=True, timeout=60)


def test_validate_command_prints_resolved_spec(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: a\nresources: {procs_per_node: 4}\ntrain: {parallel: {tp: 2}}\n")
    result = _cli("validate", str(path))
    assert result.returncode == 0, result.stderr
    assert parse_spec(result.stdout) == load_spec(path)  # the printed spec is itself a valid, equal spec
    assert "mesh: pp=1 dp_replicate=1 dp_shard=2 tp=2 (world size 4)" in result.stderr
    pipeline = "{pp: 2, pp_schedule: Interleaved1F1B, pp_stages_per_rank: 2}, global_batch: 16, micro_batch: 2"
    path.write_text(f"name: a\nresources: {{procs_per_node: 4}}\ntrain: {{parallel: {pipeline}}}\n")
    result = _cli("validate", str(path))
    assert result.returncode == 0, result.stderr
    assert "mesh: pp=2 dp_replicate=1 dp_shard=2 tp=1 (world size 4)" in result.stderr
    # 16 / (2 x 2) = 4 micro-batches, 2 ranks x 2 stages each: (2 - 1) / (2 x 4 + 2 - 1)
    assert "pipeline: Interleaved1F1B, 4 stages, 4 micro-batches a step, bubble 11.1% in theory" in result.stderr


def test_validate_command_reports_errors_with_exit_code_2(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: a\nresources: {procs_per_node: 2}\ntrain: {global_batch: 12}\n")
    result = _cli("validate", str(path))
    assert result.returncode == 2
    assert "train.global_batch: 12 is not a multiple" in result.stderr
    missing = _cli("validate", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "cannot read the file" in missing.stderr


def test_the_spec_reference_in_docs_is_generated_from_the_models() -> None:
    """docs/spec.md is `python -m phalanx.spec.reference`'s output: a field added or changed in the models
    without `make docs` fails here, so the reference never drifts from what validation accepts."""
    from phalanx.spec.model import JobSpec
    from phalanx.spec.reference import SECTIONS_BY_MODEL, markdown

    text = markdown()
    assert (Path(__file__).resolve().parent.parent / "docs" / "spec.md").read_text() == text, "run `make docs`"
    models = {"JobSpec", *JobSpec.model_json_schema()["$defs"]}
    assert models == set(SECTIONS_BY_MODEL) and text.count("\n## `") == len(models)  # a section per model
    assert '| `hang_timeout_s` | number > 0 \\| "auto" | `"auto"` |' in text
    assert "| `async` | boolean | `true` |" in text  # the YAML key (alias), not the Python name


def test_what_would_fail_in_the_workers_is_found_before_launch(tmp_path: Path) -> None:
    """A missing command, a path that is not a prepared dataset, a model vocabulary smaller than the dataset's:
    `phalanx validate` and `run` name the field at once, instead of a worker's traceback seconds later."""
    from phalanx.data.prepare import prepare

    (tmp_path / "in.txt").write_text("enough text for a few samples of eight tokens. " * 20)
    prepare([tmp_path / "in.txt"], tmp_path / "ds", progress=False)  # bytes: a vocabulary of 257
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: a\ntrain: {model: {preset: llama-tiny, vocab_size: 200}, seq_len: 8}\n"
        f"data: {{sources: [{{path: '{tmp_path / 'ds'}'}}, {{path: '{tmp_path}'}}]}}\n"
    )
    result = _cli("validate", str(path))
    assert result.returncode == 2
    assert "train.model.vocab_size: 200 is less than the vocabulary of" in result.stderr
    assert "(257 ids); use vocab_size >= 257" in result.stderr
    assert f"data.sources.1.path: {tmp_path}/index.json: not found" in result.stderr
    path.write_text("name: a\ncommand: [/not/here, --flag]\n")
    ran = _cli("run", str(path), "--runs-dir", str(tmp_path / "runs"))
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert "command: '/not/here': no such file" in ran.stderr and not (tmp_path / "runs").exists()


def test_a_default_never_makes_a_valid_looking_spec_invalid() -> None:
    short = parse_spec("name: a\ntrain: {steps: 12}\n")
    assert short.train is not None and short.train.optimizer.warmup_steps == 1  # a tenth of the run, not 20
    assert parse_spec("name: a\ntrain: {steps: 300}\n").train.optimizer.warmup_steps == 20  # type: ignore[union-attr]
    with pytest.raises(SpecError, match="warmup_steps: 20 is longer than the run"):  # written: checked
        parse_spec("name: a\ntrain: {steps: 12, optimizer: {warmup_steps: 20}}\n")


def test_a_jobs_kind_is_its_model_and_sequence_or_its_script_unless_named() -> None:
    """The speed table's class of a job (the server keeps 64 characters of it)."""
    recipe = "name: r\ntrain: {model: {preset: llama-debug, n_layers: 4}, seq_len: 128}\n"
    assert parse_spec(recipe).job_kind == "llama-debug-n_layers4-seq128"
    assert parse_spec(recipe + "kind: my-7b\n").job_kind == "my-7b"
    script = "name: s\ncommand: [python, {}]\n"
    assert parse_spec(script.format("-u, /src/train.py, --lr, '3e-4'")).job_kind == "train.py"
    assert parse_spec(script.format("-m, mypkg.pretrain")).job_kind == "mypkg.pretrain"
    assert parse_spec("name: b\ncommand: [/opt/bin/trainer]\n").job_kind == "trainer"
    with pytest.raises(SpecError, match="kind"):
        parse_spec(recipe + "kind: 'has spaces'\n")
