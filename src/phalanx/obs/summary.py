"""How a run ended, said once when it ends, from its run directory: the outcome, how far training got,
each restart and its cause, where the time went (goodput), and where to look next."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from phalanx.obs.events import RESTARTS, Event, read_jsonl
from phalanx.obs.goodput import Ledger
from phalanx.obs.progress import clock
from phalanx.obs.rundir import RunDir

OUTCOME_STYLE = {"succeeded": "bold green", "failed": "bold red", "stopped": "bold yellow"}


def summary(
    run: RunDir, ledger: Ledger, last: dict[str, Any] | None, total_steps: int | None, plot: Path | None
) -> RenderableType:
    """``last``: the run's last step record (the supervisor followed metrics.jsonl; no need to read it again)."""
    result = run.read_result()
    assert result is not None, "the summary of a run that has ended"
    events = list(read_jsonl(run.events))
    lines = [Text(f"── phalanx run {run.run_id} ──", style="bold")]

    def row(label: str, *value: str | Text) -> None:
        lines.append(Text.assemble((f"{label:<11}", "dim"), *value))

    row(
        "outcome",
        (result.outcome, OUTCOME_STYLE.get(result.outcome, "bold")),
        f" (exit code {result.exit_code}): {result.reason}",
    )
    if last is not None:
        done = f"{last['step'] + 1}" + (f" of {total_steps}" if total_steps else "")
        row("steps", done + (f", last loss {last['loss']:.4f}" if last.get("loss") is not None else ""))
    restarts = [e for e in events if e["kind"] in RESTARTS]
    recovered = {(e["attempt"], e["generation"]): e for e in events if e["kind"] == Event.RECOVERED_IN_PROCESS}
    row("restarts", f"{len(restarts)}" + (":" if restarts else ""))
    for e in restarts:
        how = ""
        if e["kind"] == Event.RECOVERY_STARTED:
            done = recovered.get((e["attempt"], e["generation"]))
            took = f"node {e['node']}'s ranks on spare node {e['spare_node']}" if "node" in e else f"rank {e['rank']}"
            how = ", in process: " + (
                f"warm spares took {took}, step {done['step']} from "
                f"{'the storage checkpoint' if done.get('source') == 'storage' else 'memory'} in {done['took_s']:.2f} s"
                if done is not None
                else "not finished"
            )
        row("", f"  {e['restart']}. {e.get('reason') or e['cause']} ({e['failure']}){how}")
    for e in events:
        if e["kind"] == Event.SHRUNK:
            row("", f"  shrunk to {e['procs']} process(es) without slot {e['slot']}")
        elif e["kind"] == Event.GROWN:
            row("", f"  grew back to {e['procs']} process(es)")
        elif e["kind"] == Event.NODES_CHANGED:
            row("", f"  {e['change']}")
    row("wall time", clock(ledger.wall_s))
    row("goodput", ledger.summary().removeprefix("goodput "))
    if plot is not None:
        row("loss curve", str(plot))
    row("run dir", f"{run.root}  (logs/, metrics.jsonl, events.jsonl, goodput.json)")
    return Group(*lines)
