"""The noxfile's session docstrings, read without nox (``ast``): ``nox -l`` lists the first
line of each, so that line must be a whole sentence."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

NOXFILE = Path(__file__).resolve().parents[2] / "noxfile.py"
MAX_SUMMARY_CHARS = 95


def _is_session(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "session"


def session_docstrings() -> dict[str, str]:
    """Each ``@nox.session`` function of the noxfile, by name, with its docstring."""
    tree = ast.parse(NOXFILE.read_text("utf-8"))
    return {
        node.name: ast.get_docstring(node, clean=True) or ""
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any(map(_is_session, node.decorator_list))
    }


SESSIONS = session_docstrings()


def test_sessions_are_found() -> None:
    """The reader finds the sessions (so the test below cannot pass on an empty list)."""
    assert {"lint", "typecheck", "tests_server", "integration", "bench_ray"} <= set(SESSIONS)


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_the_listed_line_is_a_whole_sentence(name: str) -> None:
    """The first line of a session's docstring is its whole summary: it ends a sentence, the
    next line (if any) is blank, and it is short enough for ``nox -l``."""
    lines = SESSIONS[name].splitlines()
    assert lines, f"session {name} has no docstring"
    assert lines[0].endswith("."), f"session {name}: {lines[0]!r} does not end a sentence"
    assert len(lines) == 1 or not lines[1].strip(), f"session {name}: the summary wraps"
    assert len(lines[0]) <= MAX_SUMMARY_CHARS, f"session {name}: the summary is too long"
