"""What a benchmark found, as markdown: a setup paragraph, tables, and ratios against the peer measured in the
same run, each with its median and range over the repeated runs and whether it met its goal. A script prints
it; with ``--out`` it also writes it, for ``bench/run.py`` to gather into bench/RESULTS.md."""

from __future__ import annotations

import operator
import statistics
from dataclasses import dataclass, field
from pathlib import Path

COMPARE = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


def shown(value: float, digits: int = 3) -> str:
    """``digits`` significant digits, without an exponent: 0.0232, 1.00, 12.1, 466, 1,055."""
    return f"{value:,.0f}" if abs(value) >= 10**digits else f"{value:#.{digits}g}".rstrip(".")


@dataclass(frozen=True)
class Ratio:
    what: str
    values: list[float]  # one per repeated run
    goal: str = ""  # "<= 1.03", "> 1", ...: an operator and a bound, or none
    unit: str = "x"

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def met(self) -> bool | None:
        """Whether every run met the goal: a ratio whose range crosses its goal has not met it."""
        if not self.goal:
            return None
        op, bound = self.goal.split()
        return all(COMPARE[op](v, float(bound)) for v in self.values)

    def _bound(self, value: float) -> str:
        """``value`` with as many digits as it takes not to read as the goal's bound (1.0302 against 1.03)."""
        bound = float(self.goal.split()[1]) if self.goal else None
        text = shown(value)
        for digits in range(4, 7):
            if bound is None or float(text.replace(",", "")) != bound or value == bound:
                break
            text = shown(value, digits)
        return text

    def row(self) -> str:
        lo, hi = (self._bound(v) for v in (min(self.values), max(self.values)))
        spread = f"{lo} to {hi}" if len(self.values) > 1 else "one run"
        met = {None: "", True: "met", False: "**not met**"}[self.met()]
        goal = f"{self.goal}{self.unit}" if self.goal else ""
        return f"| {self.what} | **{shown(self.median)}{self.unit}** | {spread} | {goal} | {met} |"


@dataclass
class Report:
    title: str  # "Step overhead"
    command: str  # how to run this benchmark alone
    setup: str  # what was measured, on what, how many times
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, headers: list[str], rows: list[list[object]]) -> None:
        self.tables.append((headers, [[str(cell) for cell in row] for row in rows]))

    def ratio(self, what: str, values: float | list[float], goal: str = "", unit: str = "x") -> None:
        """A ratio against the peer: one value per repeated run (the median and the range are shown)."""
        self.ratios.append(Ratio(what, values if isinstance(values, list) else [values], goal, unit))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def markdown(self) -> str:
        parts = [f"## {self.title}", f"`{self.command}`", self.setup]
        for headers, rows in self.tables:
            lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            parts.append("\n".join(lines))
        if self.ratios:
            lines = ["| ratio | median | range | goal | goal met |", "|---|---|---|---|---|"]
            parts.append("\n".join(lines + [r.row() for r in self.ratios]))
        parts += self.notes
        return "\n\n".join(parts) + "\n"

    def finish(self, out: Path | None) -> None:
        """Print the report; write it to ``out`` too when given."""
        text = self.markdown()
        print("\n" + text, flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """The median of repeated measurements, with their range: '438.5 (431.0 to 446.2)'."""
    med, lo, hi = (fmt.format(v * scale) for v in (statistics.median(values), min(values), max(values)))
    return med if len(values) == 1 else f"{med} ({lo} to {hi})"
