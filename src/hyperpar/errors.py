"""One exception type per kind of user mistake.

The CLI prints these as a single line with a hint and exits non-zero; anything else is our bug
and keeps its traceback.
"""

from __future__ import annotations


class HyperparError(Exception):
    """Base class for user-facing errors; ``hint`` is shown after the message."""

    kind = "error"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def one_line(self) -> str:
        text = f"{self.kind} error: {self}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return " ".join(text.split())


class ConfigError(HyperparError):
    kind = "config"


class PlanError(HyperparError):
    kind = "plan"


class DataError(HyperparError):
    kind = "data"


class CheckpointError(HyperparError):
    kind = "checkpoint"


class MissingKeyError(CheckpointError, KeyError):
    """A tensor the checkpoint does not hold; a KeyError too, so an adapter can try another layout and a
    shape check can list every missing one (any other CheckpointError, a damaged file, stops at once)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class TrainingError(HyperparError):
    """The run itself went wrong in a way the user must act on (e.g. non-finite loss)."""

    kind = "training"


class WorkerError(HyperparError):
    """A worker process died (a signal: out of memory, killed) or crashed; its own output says more.
    Not a user mistake: exit code 1, but one line rather than the launcher's traceback."""

    kind = "worker"
    exit_code = 1
