"""The public surface at HEAD keeps every name, signature and CLI option of 0.2.0.

``public_surface_0.2.0.json`` was written once by ``tools/public_surface.py`` from the
sources of the 0.2.0 release (commit f71f6ca; the tool's docstring has the commands).
HEAD's surface is computed by the same code from the installed distributions and the
pyprojects of this checkout: additions are allowed, removals and changes fail, but for a
higher minor of ``PROTOCOL_VERSION`` (a protocol minor only adds optional keys).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from public_surface import compare, public_surface  # noqa: E402

SNAPSHOT = Path(__file__).with_name("public_surface_0.2.0.json")

_PROTOCOL_MINOR = re.compile(
    r'modules\.rollout_types\.PROTOCOL_VERSION\.value: was "(\d+)\.(\d+)", now "(\d+)\.(\d+)"'
)


def _protocol_minor_bump(problem: str) -> bool:
    """Whether ``problem`` is PROTOCOL_VERSION moving to a higher minor of its major."""
    match = _PROTOCOL_MINOR.fullmatch(problem)
    return bool(match) and match[1] == match[3] and int(match[4]) > int(match[2])


DELIBERATE_REMOVALS = {
    "modules.rollout_server.RayBackend.members.worker_pids": (
        "dead code, removed by issue 27 item 5 (undocumented, unused; /health lists each "
        "worker's pid)"
    ),
}
"""Removals from the 0.2.0 surface made on purpose, each with its reason and changelog
entry; every other removal or change fails."""


@pytest.fixture(scope="module")
def released() -> dict[str, Any]:
    """The surface of 0.2.0, as recorded."""
    surface: dict[str, Any] = json.loads(SNAPSHOT.read_text("utf-8"))
    return surface


class TestPublicSurface:
    def test_head_keeps_the_surface_of_0_2_0(self, released: dict[str, Any]) -> None:
        """Every 0.2.0 name, parameter, member, attrs field and CLI option is unchanged, but
        for the deliberate removals (each still removed)."""
        problems, additions = compare(released, public_surface(ROOT))
        problems = [problem for problem in problems if not _protocol_minor_bump(problem)]
        print("additions since 0.2.0:", *additions or ["none"], sep="\n  ")
        removed = {problem.partition(": removed (")[0] for problem in problems}
        assert removed >= DELIBERATE_REMOVALS.keys(), "a deliberate removal is back: drop it"
        problems = [p for p in problems if p.partition(": removed (")[0] not in DELIBERATE_REMOVALS]
        assert not problems, "the public surface changed since 0.2.0:\n" + "\n".join(problems)

    def test_snapshot_covers_every_public_module_and_command(
        self, released: dict[str, Any]
    ) -> None:
        """The snapshot describes all five public modules and both commands' subcommands."""
        assert sorted(released["modules"]) == [
            "rollout_client",
            "rollout_client.eval",
            "rollout_client.testing",
            "rollout_server",
            "rollout_types",
        ]
        assert sorted(released["commands"]["rollout-server"]["subcommands"]) == ["serve"]
        assert sorted(released["commands"]["rollout-eval"]["subcommands"]) == [
            "report",
            "run",
            "show",
        ]


def _function(**parameters: dict[str, Any]) -> dict[str, Any]:
    return {"f": {"kind": "function", "parameters": parameters}}


KEYWORD = {"kind": "KEYWORD_ONLY"}


class TestCompare:
    def test_equal_surfaces_have_no_difference(self) -> None:
        """A surface compared with itself has neither problems nor additions."""
        surface = _function(a={**KEYWORD, "default": 1})
        assert compare(surface, surface) == ([], [])

    def test_removed_name_is_a_problem(self) -> None:
        """A name of the old surface missing from the new one is reported by its path."""
        problems, _ = compare({"m": _function()}, {"m": {}})
        assert problems == ['m.f: removed (was {"kind": "function", "parameters": {}})']

    def test_changed_default_is_a_problem(self) -> None:
        """A parameter whose default changed is reported with both values."""
        old = _function(a={**KEYWORD, "default": 1})
        new = _function(a={**KEYWORD, "default": 2})
        assert compare(old, new)[0] == ["f.parameters.a.default: was 1, now 2"]

    def test_new_optional_parameter_is_an_addition(self) -> None:
        """A new parameter with a default keeps old calls working: listed as an addition."""
        new = _function(b={**KEYWORD, "default": None})
        assert compare(_function(), new) == ([], ["f.parameters.b"])

    def test_new_required_parameter_is_a_problem(self) -> None:
        """A new parameter without a default breaks old calls."""
        problems, additions = compare(_function(), _function(b=KEYWORD))
        assert problems == ["f.parameters.b: new parameter without a default"]
        assert additions == []

    def test_new_variadic_parameter_is_an_addition(self) -> None:
        """``**kwargs`` added to a signature accepts every old call."""
        new = _function(kwargs={"kind": "VAR_KEYWORD"})
        assert compare(_function(), new) == ([], ["f.parameters.kwargs"])
