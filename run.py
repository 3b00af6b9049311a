#!/usr/bin/env python3
"""The two commands of a fresh machine: ``python3 run.py demo`` and ``python3 run.py test``.

Needs only Python 3.11+ with pip and venv. It creates ``.venv-run/`` (once) holding nox
and uv, then runs nox:

* ``demo``: the main job on its embedded defaults (``nox -s demo``);
* ``test``: every CI check (``nox`` with its default sessions);
* anything else is passed to nox as is, e.g. ``python3 run.py -s compat``.

A session whose Python (3.11, 3.12 or 3.13) is missing is skipped (on CI, where ``CI`` is
set, it fails); the others still run, and the run ends with the list of sessions that did
not run, how to install their Python, and exit status 3 (1 when a check failed), never 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

# tools/ is put on sys.path just above: standard library only, importable before nox is.
from interpreters import missing_report, sessions_missing_interpreters  # noqa: E402

VENV = ROOT / ".venv-run"
EXIT_CHECKS_MISSING = 3
"""Exit status when every session that ran passed but some could not run (no Python)."""
# The linters are pinned in noxfile.py (LINT_DEPS) and installed by its lint session.
REQUIREMENTS = ["nox>=2024.10", "uv>=0.4"]


def _python() -> Path:
    return VENV / ("Scripts" if os.name == "nt" else "bin") / "python"


def _ensure_tools() -> None:
    stamp = VENV / ".installed"
    if stamp.exists() and stamp.read_text() == "\n".join(REQUIREMENTS):
        return
    if not _python().exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    subprocess.run(
        [
            str(_python()),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            *REQUIREMENTS,
        ],
        check=True,
    )
    stamp.write_text("\n".join(REQUIREMENTS))


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):
        print("run.py needs Python 3.11 or newer", file=sys.stderr)
        return 2
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)
        return 0 if argv else 2
    _ensure_tools()
    command, rest = argv[0], argv[1:]
    if command == "demo":
        nox_args = ["-s", "demo", *(["--", *rest] if rest else [])]
    elif command == "test":
        nox_args = rest
    else:
        nox_args = argv
    with tempfile.TemporaryDirectory(prefix="run-py-") as tmp:
        args, report = with_report(nox_args, Path(tmp) / "nox-report.json")
        status = subprocess.call(
            [str(_python()), "-m", "nox", "-f", str(ROOT / "noxfile.py"), *args], cwd=ROOT
        )
        return closing_status(status, report, ci="CI" in os.environ, err=sys.stderr)


def with_report(nox_args: list[str], default: Path) -> tuple[list[str], Path]:
    """``nox_args`` with ``--report default`` added (before any ``--``, which starts the
    sessions' own arguments), unless they name a report already; and the report's path."""
    end = nox_args.index("--") if "--" in nox_args else len(nox_args)
    options = nox_args[:end]
    for index, arg in enumerate(options):
        if arg == "--report" and index + 1 < len(options):
            return nox_args, Path(options[index + 1])
        if arg.startswith("--report="):
            return nox_args, Path(arg.removeprefix("--report="))
    return [*options, "--report", str(default), *nox_args[end:]], default


def closing_status(status: int, report: Path, *, ci: bool, err: TextIO) -> int:
    """The exit status of run.py after nox exited with ``status`` and wrote ``report``.

    Sessions that did not run because their Python interpreter is missing are listed on
    ``err`` with how to install it, and make the status non-zero: nox's own (1) when a
    session failed, else :data:`EXIT_CHECKS_MISSING`. No report (``-l``, a usage error):
    nox's status.
    """
    try:
        document = json.loads(report.read_text("utf-8"))
    except (OSError, ValueError):
        return status
    missing = sessions_missing_interpreters(document)
    if not missing:
        return status
    err.write(missing_report(missing, ci=ci) + "\n")
    return status or EXIT_CHECKS_MISSING


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
