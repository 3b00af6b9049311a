#!/usr/bin/env python3
"""The two commands of a fresh machine: ``python3 run.py demo`` and ``python3 run.py test``.

Needs only Python 3.11+ with pip and venv. It creates ``.venv-run/`` (once) holding nox
and uv, then runs nox:

* ``demo``: the main job on its embedded defaults (``nox -s demo``);
* ``test``: every CI check (``nox`` with its default sessions);
* anything else is passed to nox as is, e.g. ``python3 run.py -s compat``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv-run"
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
    return subprocess.call(
        [str(_python()), "-m", "nox", "-f", str(ROOT / "noxfile.py"), *nox_args], cwd=ROOT
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
