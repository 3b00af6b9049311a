#!/usr/bin/env python3
"""The two commands of a fresh machine: ``python3 run.py demo`` and ``python3 run.py test``.

Needs only Python 3.11+ with pip and venv. It creates ``.venv-run/`` (once) holding nox
and uv, then runs nox:

* ``demo``: the main job on its embedded defaults (``nox -s demo``);
* ``test``: every CI check (``nox`` with its default sessions), as two nox processes at once:
  the sessions that mostly compute, and those that mostly wait on servers, a Ray cluster
  and a browser (``tools/ci_sessions.py``; ``ROLLOUT_CI_SERIAL=1`` runs them one after the
  other); the waiting group's output follows the other's;
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
from ci_sessions import CI_COMPUTE_SESSIONS, CI_WAITING_SESSIONS  # noqa: E402
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
        if command == "test" and not rest and not os.environ.get("ROLLOUT_CI_SERIAL"):
            return _test_in_two_groups(Path(tmp))
        args, report = with_report(nox_args, Path(tmp) / "nox-report.json")
        status = subprocess.call(_nox(args), cwd=ROOT)
        return closing_status(status, report, ci="CI" in os.environ, err=sys.stderr)


def _nox(args: list[str]) -> list[str]:
    return [str(_python()), "-m", "nox", "-f", str(ROOT / "noxfile.py"), *args]


def _test_in_two_groups(tmp: Path) -> int:
    """Run the CI set as two nox processes at once (see ``tools/ci_sessions.py``): the
    computing group in the foreground, the waiting group with its output kept in a file
    and printed once the first group is done. Both always run to the end; the status is
    the first non-zero of the two (see :func:`closing_status`)."""
    log_path = tmp / "waiting-sessions.log"
    waiting_report = tmp / "waiting-report.json"
    with log_path.open("w", encoding="utf-8") as log:
        waiting = subprocess.Popen(
            _nox(["--report", str(waiting_report), "-s", *CI_WAITING_SESSIONS]),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            compute_report = tmp / "compute-report.json"
            computed = subprocess.call(
                _nox(["--report", str(compute_report), "-s", *CI_COMPUTE_SESSIONS]), cwd=ROOT
            )
            waiting_names = ", ".join(CI_WAITING_SESSIONS)
            print(f"run.py: computing sessions done; waiting for {waiting_names}", flush=True)
            waited = waiting.wait()
        finally:
            if waiting.poll() is None:  # interrupted: stop the other group too
                waiting.terminate()
                waiting.wait()
    sys.stdout.write(log_path.read_text("utf-8", errors="replace"))
    sys.stdout.flush()
    ci = "CI" in os.environ
    statuses = [
        closing_status(computed, compute_report, ci=ci, err=sys.stderr),
        closing_status(waited, waiting_report, ci=ci, err=sys.stderr),
    ]
    print(
        "run.py: computing sessions "
        + ("passed" if statuses[0] == 0 else f"exit {statuses[0]}")
        + ", waiting sessions "
        + ("passed" if statuses[1] == 0 else f"exit {statuses[1]}"),
        flush=True,
    )
    return next((status for status in statuses if status), 0)


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
