"""The Python interpreters the checks run on: finding them, and saying how to get a missing one.

Standard library only. The noxfile imports it to put pyenv's interpreters on ``PATH`` and
warn about missing ones as it loads; ``run.py`` imports it (before nox is even installed)
to list, after nox has run, the sessions that did not run for want of an interpreter.
``tests/tools/test_interpreters.py`` drives it with a fake ``PATH`` and pyenv root.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "MISSING_INTERPRETER",
    "Interpreters",
    "find_interpreters",
    "install_hint",
    "missing_report",
    "pyenv_root",
    "sessions_missing_interpreters",
]

MISSING_INTERPRETER: Final = re.compile(r"Python interpreter (?P<version>\S+) not found")
"""The reason nox gives a session whose interpreter it cannot find (skipped or failed)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Interpreters:
    """Where each wanted ``X.Y`` was found.

    Attributes:
        found: ``X.Y`` to the executable that provides it.
        pyenv_bins: The pyenv ``bin`` folders of the versions found there, to put on
            ``PATH`` (pyenv's shims resolve only the versions ``PYENV_VERSION`` names).
        missing: The wanted versions found nowhere, in the order asked.
    """

    found: Mapping[str, str]
    pyenv_bins: tuple[str, ...]
    missing: tuple[str, ...]


def _newest_pyenv_bin(pyenv_root: Path, minor: str) -> Path | None:
    """The ``bin`` folder of the newest ``X.Y.Z`` pyenv holds for ``minor`` (``X.Y``), by
    version number (3.12.10 is newer than 3.12.9); builds such as ``3.12.1t`` or
    ``3.12-dev`` are not considered."""
    versions = pyenv_root / "versions"
    pattern = re.compile(rf"{re.escape(minor)}\.(\d+)")
    candidates: list[tuple[int, Path]] = []
    try:
        entries = list(versions.iterdir())
    except OSError:
        return None
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and (entry / "bin" / f"python{minor}").exists():
            candidates.append((int(match.group(1)), entry / "bin"))
    return max(candidates)[1] if candidates else None


def find_interpreters(minors: Sequence[str], *, path: str, pyenv_root: Path) -> Interpreters:
    """Find ``python X.Y`` for each of ``minors``: pyenv's newest ``X.Y.Z`` under
    ``pyenv_root/versions``, else ``pythonX.Y`` on ``path`` (a ``PATH`` string).

    Args:
        minors: The wanted versions, e.g. ``["3.11", "3.12", "3.13"]``.
        path: The search path, ``os.pathsep``-separated.
        pyenv_root: pyenv's root (``$PYENV_ROOT``, default ``~/.pyenv``); it need not exist.

    Returns:
        What was found where, and what is missing.
    """
    found: dict[str, str] = {}
    pyenv_bins: list[str] = []
    missing: list[str] = []
    for minor in minors:
        pyenv_bin = _newest_pyenv_bin(pyenv_root, minor)
        if pyenv_bin is not None:
            pyenv_bins.append(str(pyenv_bin))
            found[minor] = str(pyenv_bin / f"python{minor}")
            continue
        on_path = shutil.which(f"python{minor}", path=path)
        if on_path is not None:
            found[minor] = on_path
        else:
            missing.append(minor)
    return Interpreters(found=found, pyenv_bins=tuple(pyenv_bins), missing=tuple(missing))


def install_hint(missing: Iterable[str]) -> str:
    """How to install the ``missing`` versions so that the checks find them."""
    versions = list(missing)
    commands = " ".join(f"python{version}" for version in versions)
    return (
        f"install it with pyenv (`pyenv install {' '.join(versions)}`; the noxfile finds "
        "pyenv's versions without `pyenv global`), or from your system's packages (e.g. "
        f"`apt-get install {commands}`, from the deadsnakes PPA on Ubuntu) so that "
        f"{', '.join(f'`{command}`' for command in commands.split())} is on PATH"
    )


def sessions_missing_interpreters(report: Mapping[str, Any]) -> dict[str, list[str]]:
    """The sessions of a nox ``--report`` document that did not run because their Python
    interpreter is missing (nox skips them, or fails them on CI).

    Returns:
        ``X.Y`` to the names of its sessions, in report order.
    """
    missing: dict[str, list[str]] = {}
    for session in report.get("sessions", []):
        if session.get("result") not in {"skipped", "failed"}:
            continue
        match = MISSING_INTERPRETER.search(str(session.get("reason") or ""))
        if match:
            signatures = session.get("signatures") or [session.get("name")]
            missing.setdefault(match.group("version"), []).append(str(signatures[0]))
    return missing


def missing_report(missing: Mapping[str, Sequence[str]], *, ci: bool) -> str:
    """The closing message of a run in which sessions lacked their interpreter.

    Args:
        missing: ``X.Y`` to the sessions that did not run (from
            :func:`sessions_missing_interpreters`).
        ci: Whether this is CI (nox failed these sessions instead of skipping them).
    """
    count = sum(len(names) for names in missing.values())
    verb = "failed" if ci else "were skipped"
    lines = [
        f"run.py: {count} session(s) {verb} because their Python interpreter is missing; "
        "the other sessions ran (nox's summary is above), but not every check did:"
    ]
    lines.extend(f"  Python {version}: {', '.join(names)}" for version, names in missing.items())
    lines.append(f"  To run them, {install_hint(missing)}, then run the same command again.")
    return "\n".join(lines)


def pyenv_root() -> Path:
    """``$PYENV_ROOT``, else ``~/.pyenv``."""
    return Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
