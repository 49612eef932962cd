"""What a failure was, and whether running the job again can help.

A failure is classified from its first failed rank (the root cause; the others' exits are consequences):

- user: the code or the spec is wrong (an exception such as ImportError, TypeError, ValueError, AssertionError,
  or phalanx's own SpecError / DatasetError / BadLoss). Running it again fails the same way, so it is not retried.
- infrastructure: the process was killed by a signal (the OOM killer, a lost node, a driver fault), a
  collective or the network failed, the job hung, or a process exited non-zero without saying why. Restarting
  from the last good checkpoint can help, so it is retried while the restart budget lasts.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from phalanx.resilience.hang import Stall

USER_ERRORS = frozenset(
    {
        "SyntaxError",
        "ImportError",
        "ModuleNotFoundError",
        "NameError",
        "AttributeError",
        "TypeError",
        "ValueError",
        "KeyError",
        "IndexError",
        "AssertionError",
        "NotImplementedError",
        "ZeroDivisionError",
        "FileNotFoundError",
        "SpecError",
        "DatasetError",
        "BadLoss",
    }
)
BACKOFF_CAP_S = 60.0


class Kind(enum.StrEnum):
    USER = "user"
    INFRASTRUCTURE = "infrastructure"


@dataclass(frozen=True)
class Failure:
    kind: Kind
    why: str  # one line: what happened, for the console, the events and result.json
    category: str = "crash"  # crash | killed | hang | node_lost | user_error | regrow: few values, for metrics

    @property
    def retryable(self) -> bool:
        return self.kind is Kind.INFRASTRUCTURE


def exception_type(recorded: str) -> str:
    """The exception's class name in a message recorded by ``@record`` ("ValueError: ..."), or ""."""
    head = recorded.split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1] if head.replace(".", "").replace("_", "").isalnum() else ""


def classify_exit(returncode: int, recorded: str) -> Failure:
    """Classify a rank's non-zero exit from its return code and the root cause it recorded (may be "")."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        return Failure(Kind.INFRASTRUCTURE, f"killed by {name}", "killed")
    if exception_type(recorded) in USER_ERRORS:
        return Failure(Kind.USER, f"{recorded} (an error in the code or spec: not retried)", "user_error")
    if recorded:
        return Failure(Kind.INFRASTRUCTURE, recorded)
    return Failure(Kind.INFRASTRUCTURE, f"exited with code {returncode} without recording an error")


def hang(stall: Stall) -> Failure:
    return Failure(
        Kind.INFRASTRUCTURE,
        f"hung: no progress past step {stall.step} for {stall.silent_s:.1f} s (hang timeout {stall.timeout_s:.1f} s)",
        "hang",
    )


def backoff_s(restart: int, base_s: float) -> float:
    """Wait before restart number ``restart`` (1, 2, ...): base, 2x base, 4x base, ... capped at a minute."""
    return min(base_s * 2 ** (restart - 1), BACKOFF_CAP_S) if base_s > 0 else 0.0
