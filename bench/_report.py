"""What a benchmark found, as markdown: a setup paragraph, tables, and ratios against the peer measured in the
same run, each next to its goal. A script prints it; with ``--out`` it also writes it, for ``bench/run.py``
to gather into bench/RESULTS.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def shown(value: float) -> str:
    """Three significant digits, without an exponent: 0.0232, 12.1, 1,055."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


@dataclass
class Report:
    title: str  # "Step overhead"
    command: str  # how to run this benchmark alone
    setup: str  # what was measured, on what, how many times
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)
    ratios: list[tuple[str, float, str, str]] = field(default_factory=list)  # (what, value, goal, unit)
    notes: list[str] = field(default_factory=list)

    def table(self, headers: list[str], rows: list[list[object]]) -> None:
        self.tables.append((headers, [[str(cell) for cell in row] for row in rows]))

    def ratio(self, what: str, value: float, goal: str = "", unit: str = "x") -> None:
        self.ratios.append((what, value, goal, unit))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def markdown(self) -> str:
        parts = [f"## {self.title}", f"`{self.command}`", self.setup]
        for headers, rows in self.tables:
            lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            parts.append("\n".join(lines))
        if self.ratios:
            lines = ["| ratio | value | goal |", "|---|---|---|"]
            lines += [f"| {what} | **{shown(value)}{unit}** | {goal} |" for what, value, goal, unit in self.ratios]
            parts.append("\n".join(lines))
        parts += self.notes
        return "\n\n".join(parts) + "\n"

    def finish(self, out: Path | None) -> None:
        """Print the report; write it to ``out`` too when given."""
        text = self.markdown()
        print("\n" + text, flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
