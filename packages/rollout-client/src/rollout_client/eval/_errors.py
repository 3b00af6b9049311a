"""The error hierarchy of ``rollout-eval``.

Every error a user can fix carries a message that says what was wrong and how to fix it;
the CLI prints ``str(error)`` and exits with :attr:`EvalError.exit_code`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "DatasetError",
    "EvalError",
    "EvalInputError",
    "JournalError",
    "ManifestMismatchError",
    "RowIssue",
    "RunStateError",
    "ServerUnavailableError",
]

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class EvalError(Exception):
    """Base class of every error ``rollout-eval`` reports to its user."""

    exit_code: int = EXIT_INCOMPLETE


class EvalInputError(EvalError, ValueError):
    """A command-line value, environment variable or file the user named is unusable."""

    exit_code = EXIT_BAD_INPUT


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RowIssue:
    """One problem in one dataset row: where it is (file, line, field) and what is wrong."""

    path: str
    line: int
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}"
        if self.field:
            return f"{where}: field {self.field!r}: {self.message}"
        return f"{where}: {self.message}"


class DatasetError(EvalInputError):
    """The dataset cannot be used; ``issues`` lists every bad row found (file, line, field)."""

    def __init__(self, message: str, issues: Sequence[RowIssue] = ()) -> None:
        self.issues = list(issues)
        lines = [message, *(f"  {issue}" for issue in self.issues)]
        super().__init__("\n".join(lines))


class ManifestMismatchError(EvalInputError):
    """An existing run was started with different inputs, so it cannot be resumed."""

    def __init__(self, message: str, changed: Sequence[str]) -> None:
        self.changed = list(changed)
        super().__init__(message)


class JournalError(EvalError):
    """The run's journal (``events.jsonl``) is unreadable or corrupt."""

    exit_code = EXIT_BAD_INPUT


class RunStateError(EvalInputError):
    """The run directory is not in the state the command needs (e.g. ``--resume`` with no run)."""


class ServerUnavailableError(EvalError):
    """The rollout server cannot be used (unreachable, refuses the key, wrong protocol)."""
