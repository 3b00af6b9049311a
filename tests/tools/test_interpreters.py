"""Finding the checks' Python interpreters (tools/interpreters.py) and how run.py reports the
sessions that could not run for want of one, with a fake PATH, pyenv root and nox report."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import stat
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

from interpreters import (  # noqa: E402
    find_interpreters,
    install_hint,
    missing_report,
    sessions_missing_interpreters,
)


def load_run_py() -> ModuleType:
    """Import run.py (it only defines functions until its ``__main__`` block)."""
    spec = importlib.util.spec_from_file_location("run_py", ROOT / "run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def executable(path: Path) -> Path:
    """Create an empty executable file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n", "utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def pyenv_version(root: Path, version: str, minor: str) -> Path:
    """A fake pyenv version folder holding ``bin/python{minor}``; returns its bin folder."""
    return executable(root / "versions" / version / "bin" / f"python{minor}").parent


class TestFindInterpreters:
    def test_pyenv_newest_patch_path_fallback_and_missing(self, tmp_path: Path) -> None:
        """pyenv's newest X.Y.Z by number wins (3.12.10 over 3.12.9; free-threaded and
        binary-less folders ignored); a version pyenv lacks is taken from PATH; one found
        nowhere is missing."""
        root = tmp_path / "pyenv"
        pyenv_version(root, "3.12.9", "3.12")
        newest = pyenv_version(root, "3.12.10", "3.12")
        pyenv_version(root, "3.12.11t", "3.12")
        (root / "versions" / "3.12.12" / "bin").mkdir(parents=True)  # no interpreter in it
        on_path = executable(tmp_path / "bin" / "python3.13")
        found = find_interpreters(
            ["3.11", "3.12", "3.13"], path=str(tmp_path / "bin"), pyenv_root=root
        )
        assert found.found == {"3.12": str(newest / "python3.12"), "3.13": str(on_path)}
        assert found.pyenv_bins == (str(newest),)
        assert found.missing == ("3.11",)

    def test_no_pyenv_and_an_empty_path(self, tmp_path: Path) -> None:
        """Without pyenv and with nothing on PATH, every version is missing, in order."""
        found = find_interpreters(
            ["3.13", "3.11"], path=os.pathsep.join([]), pyenv_root=tmp_path / "none"
        )
        assert found.found == {}
        assert found.missing == ("3.13", "3.11")

    def test_install_hint_names_every_missing_version(self) -> None:
        """The hint gives the pyenv command and the interpreter names for the versions."""
        hint = install_hint(["3.12", "3.13"])
        assert "`pyenv install 3.12 3.13`" in hint
        assert "`python3.12`, `python3.13` is on PATH" in hint


def nox_report(*sessions: tuple[str, str, str | None]) -> dict[str, Any]:
    """A nox ``--report`` document of (signature, result, reason) sessions."""
    return {
        "result": 0,
        "sessions": [
            {
                "name": signature.split("-")[0],
                "signatures": [signature],
                "result": result,
                "reason": reason,
            }
            for signature, result, reason in sessions
        ],
    }


REPORT = nox_report(
    ("lint", "success", None),
    ("tests_types-3.12", "skipped", "Python interpreter 3.12 not found"),
    ("tests_client-3.12", "failed", "Python interpreter 3.12 not found"),
    ("tests_types-3.13", "skipped", "Python interpreter 3.13 not found"),
    ("report_browser", "failed", "the browser checks need Debian's chromium package"),
)


class TestMissingSessions:
    def test_sessions_are_grouped_by_the_missing_version(self) -> None:
        """Skipped (or, on CI, failed) sessions without their Python are listed by version;
        passing sessions and failures for other reasons are not."""
        assert sessions_missing_interpreters(REPORT) == {
            "3.12": ["tests_types-3.12", "tests_client-3.12"],
            "3.13": ["tests_types-3.13"],
        }

    def test_the_closing_message_lists_sessions_and_how_to_install(self) -> None:
        """The message counts the sessions, names each by version and says how to get it."""
        text = missing_report(sessions_missing_interpreters(REPORT), ci=False)
        assert text.startswith("run.py: 3 session(s) were skipped because their Python")
        assert "  Python 3.12: tests_types-3.12, tests_client-3.12\n" in text
        assert "`pyenv install 3.12 3.13`" in text
        assert "failed because" in missing_report({"3.12": ["x-3.12"]}, ci=True)


class TestRunPy:
    def test_the_report_goes_before_the_sessions_arguments(self, tmp_path: Path) -> None:
        """run.py adds --report before ``--`` (posargs), and keeps a report the user named."""
        run_py = load_run_py()
        default = tmp_path / "r.json"
        assert run_py.with_report(["-s", "demo", "--", "--n", "4"], default) == (
            ["-s", "demo", "--report", str(default), "--", "--n", "4"],
            default,
        )
        assert run_py.with_report([], default) == (["--report", str(default)], default)
        mine = ["--report", "mine.json", "-s", "lint"]
        assert run_py.with_report(mine, default) == (mine, Path("mine.json"))
        assert run_py.with_report(["--report=x.json"], default) == (
            ["--report=x.json"],
            Path("x.json"),
        )

    @pytest.mark.parametrize(("nox_status", "expected"), [(0, 3), (1, 1)])
    def test_missing_interpreters_make_the_run_fail_loudly(
        self, tmp_path: Path, nox_status: int, expected: int
    ) -> None:
        """Sessions skipped for a missing Python are listed at the end and the status is
        not 0: 3 when all that ran passed, nox's 1 when a check failed too."""
        run_py = load_run_py()
        report = tmp_path / "r.json"
        report.write_text(json.dumps(REPORT), "utf-8")
        err = io.StringIO()
        assert run_py.closing_status(nox_status, report, ci=False, err=err) == expected
        assert "Python 3.13: tests_types-3.13" in err.getvalue()

    def test_a_complete_run_keeps_nox_status_and_says_nothing(self, tmp_path: Path) -> None:
        """With every interpreter present (or no report, as for -l) nox's status stands."""
        run_py = load_run_py()
        report = tmp_path / "r.json"
        report.write_text(json.dumps(nox_report(("lint", "success", None))), "utf-8")
        err = io.StringIO()
        assert run_py.closing_status(0, report, ci=True, err=err) == 0
        assert run_py.closing_status(0, tmp_path / "absent.json", ci=True, err=err) == 0
        assert err.getvalue() == ""
