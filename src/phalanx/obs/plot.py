"""The loss curve of a run, as a PNG in its run directory: a look at how training went without any tool.

Each attempt is drawn as its own line, so the steps a restart redid show as an overlap; bad steps (skipped or
rolled back) are marked where they happened."""

from __future__ import annotations

import math
from pathlib import Path

from phalanx.obs.events import BAD_STEPS, read_jsonl
from phalanx.obs.goodput import steps_by_attempt
from phalanx.obs.rundir import RunDir


def plot_loss(run: RunDir) -> Path | None:
    """Write ``loss.png`` from rank 0's metrics; None when no step reported a loss."""
    metrics = [m for m in read_jsonl(run.metrics) if m.get("loss") is not None] if run.metrics.is_file() else []
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    from matplotlib.figure import Figure

    events = list(read_jsonl(run.events))
    fig = Figure(figsize=(8, 4.5), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    attempts = steps_by_attempt(events, metrics)
    for attempt, records in sorted(attempts.items()):
        finite = [(m["step"] + 1, m["loss"]) for m in records if math.isfinite(m["loss"])]
        if finite:
            ax.plot(*zip(*finite, strict=True), linewidth=1.2, label=f"attempt {attempt}")
    bad = sorted({e["step"] for e in events if e["kind"] in BAD_STEPS})
    for step in bad:
        ax.axvline(step, color="red", alpha=0.5, linewidth=0.8, linestyle="--")
    ax.set(xlabel="step", ylabel="loss (global mean)", title=run.run_id + (" (red: bad steps)" if bad else ""))
    ax.grid(alpha=0.3)
    if len(attempts) > 1:
        ax.legend()
    out = run.root / "loss.png"
    fig.savefig(out)
    return out
