"""What the built-in recipe needs from a spec beyond the spec's own rules: the model architecture it names,
and whether the parallel degrees fit that architecture. Checked before any process starts."""

from __future__ import annotations

from phalanx.spec import JobSpec, SpecError, SpecIssue
from phalanx.train.models.args import PRESETS, LlamaConfig, config_from

TP_SPLIT_FIELDS = ("n_heads", "n_kv_heads", "dim", "ffn_dim", "vocab_size")


def model_config(spec: JobSpec) -> LlamaConfig:
    """The recipe's model, or a SpecError naming the field that makes it impossible."""
    assert spec.train is not None and spec.parallel is not None
    m, t, tp = spec.train.model, spec.train, spec.parallel.tp
    if m.preset not in PRESETS:
        raise SpecError(
            spec.name,
            [SpecIssue("train.model.preset", f"{m.preset!r} is not a preset; valid presets: {', '.join(PRESETS)}")],
        )
    try:
        cfg = config_from(m.preset, **m.model_dump(exclude={"preset"}))
    except ValueError as e:
        raise SpecError(spec.name, [SpecIssue("train.model", str(e))]) from None
    issues = [
        SpecIssue(
            "train.parallel.tp",
            f"{tp} does not divide model.{name} = {getattr(cfg, name)}; "
            f"tensor parallel splits it, so choose a tp that divides {getattr(cfg, name)}",
        )
        for name in TP_SPLIT_FIELDS
        if getattr(cfg, name) % tp
    ]
    if cfg.n_layers % spec.parallel.stages:
        issues.append(
            SpecIssue(
                "train.parallel.pp",
                f"pp x pp_stages_per_rank = {spec.parallel.pp} x {spec.parallel.pp_stages_per_rank} = "
                f"{spec.parallel.stages} stages do not divide model.n_layers = {cfg.n_layers}; each stage takes an "
                f"equal run of blocks, so choose stages that divide {cfg.n_layers}",
            )
        )
    if spec.parallel.pp > 1 and cfg.tie_embeddings:
        issues.append(
            SpecIssue(
                "train.parallel.pp",
                f"{spec.parallel.pp} with tied embeddings (preset {m.preset!r}): the embedding is in the first stage "
                "and the output projection in the last, on different ranks; use pp: 1 (tp or FSDP instead), or "
                "model.tie_embeddings: false",
            )
        )
    if t.seq_len > cfg.max_seq_len:
        issues.append(
            SpecIssue(
                "train.seq_len",
                f"{t.seq_len} is longer than the model's max_seq_len {cfg.max_seq_len}; use at most {cfg.max_seq_len}",
            )
        )
    if issues:
        raise SpecError(spec.name, issues)
    return cfg


def vocabulary_issue(vocab_size: int, data_vocab: int, data: str) -> SpecIssue | None:
    """The model's vocabulary must hold every token id of the data it trains on (``data``: which, in words)."""
    if data_vocab <= vocab_size:
        return None
    return SpecIssue(
        "train.model.vocab_size",
        f"{vocab_size} is less than the vocabulary of {data} ({data_vocab} ids); use vocab_size >= {data_vocab}",
    )
