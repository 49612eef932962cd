"""The supervisor's terminal: the supervisor's and the workers' lines scroll by; on a terminal a live status
line (the job's progress) stays below them, redrawn in place. Off a terminal (a log file, CI) there is no
live line: the progress comes as a line per step instead, which is what a log wants. Every line shown is also
appended to ``copy`` (the run directory's supervisor.log), which the server serves: the same story, read
from anywhere."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import TextIO

from rich.console import Console as RichConsole
from rich.console import RenderableType
from rich.live import Live
from rich.text import Text


class Console:
    def __init__(self, out: TextIO = sys.stdout, live: bool | None = None, copy: Path | None = None):
        """``live``: show the status line in place (default: when ``out`` is a terminal)."""
        self.live = out.isatty() if live is None else live
        self._rich = RichConsole(
            file=out, markup=False, highlight=False, emoji=False, soft_wrap=True, force_terminal=self.live or None
        )
        self._copy = None
        if copy is not None:  # plain text, a line written as it is shown
            plain = copy.open("a", buffering=1)  # open as long as the console: closed with the process
            self._copy = RichConsole(file=plain, markup=False, highlight=False, emoji=False, soft_wrap=True,
                                     color_system=None, width=120)  # fmt: skip
        self._lock = threading.Lock()
        self._status: Live | None = None
        self._shown = ""  # the status line's text: redrawn only when it changes

    def line(self, text: str) -> None:
        """A line of output, above the status line if there is one. Safe from any thread."""
        self.show(Text(text))

    def show(self, renderable: RenderableType) -> None:
        with self._lock:
            self._rich.print(renderable)
            if self._copy is not None:
                self._copy.print(renderable)

    def status(self, text: str) -> None:
        """Set the live status line (ignored off a terminal)."""
        if not self.live or text == self._shown:
            return
        with self._lock:
            if self._status is None:
                self._status = Live(console=self._rich, transient=True, redirect_stdout=False, redirect_stderr=False)
                self._status.start()
            self._status.update(Text(text, style="bold"), refresh=True)
            self._shown = text

    def end_status(self) -> None:
        """Take the status line away (before the summary is shown in its place)."""
        with self._lock:
            if self._status is not None:
                self._status.stop()
                self._shown = ""
                self._status = None
