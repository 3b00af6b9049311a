"""Each package's CHANGELOG Compatibility line agrees with the compatibility table.

The entry of a package's current version (its ``pyproject.toml`` version) must carry a
``**Compatibility:**`` line whose clauses match the table and the pyprojects:

* rollout-client: ``requires rollout-types <range>; tested with <servers that work>``;
* rollout-server: ``requires rollout-types <range>; tested with <clients that work>``;
* rollout-types: ``protocol <PROTOCOL_VERSION> (...); used by rollout-client <range> and
  rollout-server <range>; interoperates with <osmosis-ai versions that work>``.

Versions of ours are named by series (``rollout-server 0.1``), osmosis-ai exactly.

The tree may speak a newer protocol minor than its current (released) version when the
rollout-types ``[Unreleased]`` entry announces it (``Protocol X.Y``): the release that
ships it brings its own Compatibility line.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def changelog(name: str) -> str:
    """The text of a package's CHANGELOG.md."""
    return (ROOT / "packages" / name / "CHANGELOG.md").read_text("utf-8")


def compatibility_line(text: str, version: str) -> str:
    """The ``**Compatibility:**`` line of the ``## [version]`` entry (AssertionError if none)."""
    match = re.search(rf"^## \[{re.escape(version)}\][^\n]*\n(.*?)(?=^## \[|\Z)", text, re.M | re.S)
    assert match is not None, f"no '## [{version}]' entry: add one for the current version"
    lines = [line for line in match.group(1).splitlines() if line.startswith("**Compatibility:**")]
    assert len(lines) == 1, f"the [{version}] entry needs exactly one **Compatibility:** line"
    return lines[0]


def clauses(line: str) -> dict[str, str]:
    """The ``;``-separated clauses of a Compatibility line, by their leading words."""
    body = line.removeprefix("**Compatibility:**").strip().rstrip(".")
    found: dict[str, str] = {}
    for clause in (part.strip() for part in body.split(";")):
        for lead in ("requires rollout-types", "tested with", "used by", "interoperates with"):
            if clause.startswith(lead):
                found[lead] = clause.removeprefix(lead).strip()
        if clause.startswith("protocol "):
            found["protocol"] = clause.removeprefix("protocol ").split(" ", 1)[0]
    return found


def names(listing: str) -> set[str]:
    """``"a 0.1, b 0.2 and c 0.3"`` as a set of names."""
    return {part.strip() for part in re.split(r",|\band\b", listing) if part.strip()}


def spec(text: str) -> str:
    """A version range, normalised: no spaces, clauses sorted."""
    return ",".join(sorted(part.strip() for part in text.split(",")))


def types_range(package: str) -> str:
    """The ``rollout-types`` range a package's pyproject requires."""
    pyproject = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text("utf-8"))
    for requirement in pyproject["project"]["dependencies"]:
        if requirement.startswith("rollout-types"):
            return spec(requirement.removeprefix("rollout-types"))
    raise AssertionError(f"{package} does not depend on rollout-types")


def works(table: list[Any], side: str, checkout_version: str) -> set[str]:
    """The series the checkout's ``side`` (client or server) is tested with."""
    other = "server" if side == "client" else "client"
    return {
        getattr(pair, other).series
        for pair in table
        if pair.expect == "works"
        and getattr(pair, side).commit is None
        and getattr(pair, side).ours
        and getattr(pair, side).version == checkout_version
    }


def client_or_server_problems(line: str, package: str, table: list[Any], version: str) -> list[str]:
    """What in ``line`` disagrees with the table and ``package``'s pyproject."""
    found = clauses(line)
    problems = []
    if spec(found.get("requires rollout-types", "")) != types_range(package):
        problems.append(f"requires rollout-types should be {types_range(package)}")
    side = "client" if package == "rollout-client" else "server"
    expected = works(table, side, version)
    if names(found.get("tested with", "")) != expected:
        problems.append(f"tested with should list {sorted(expected)}")
    return problems


class TestCompatibilityLines:
    """The Compatibility line of each package's current version matches the table."""

    @pytest.mark.parametrize("package", ["rollout-client", "rollout-server"])
    def test_client_and_server_lines(self, compat: ModuleType, package: str) -> None:
        """requires/tested-with agree with the pyproject range and the table's working pairs."""
        version = compat.package_version(package)
        line = compatibility_line(changelog(package), version)
        problems = client_or_server_problems(line, package, compat.compat_table(), version)
        assert problems == [], f"{package} CHANGELOG [{version}]: {problems}\n{line}"

    def test_types_line(self, compat: ModuleType) -> None:
        """protocol, used-by ranges and osmosis-ai versions agree with the tree and the table."""
        version = compat.package_version("rollout-types")
        text = changelog("rollout-types")
        found = clauses(compatibility_line(text, version))
        tree = compat.protocol_version()
        if found["protocol"] != tree:
            unreleased = re.search(r"^## \[Unreleased\]\n(.*?)(?=^## \[|\Z)", text, re.M | re.S)
            assert unreleased is not None, "no [Unreleased] entry announcing the new protocol"
            assert f"Protocol {tree}" in unreleased.group(1), (
                f"the tree speaks protocol {tree}, the [{version}] entry {found['protocol']}: "
                f"announce 'Protocol {tree}' under [Unreleased]"
            )
            assert tree.split(".")[0] == found["protocol"].split(".")[0], (
                "a new major needs a release"
            )
        used_by = dict(
            part.strip().split(" ", 1) for part in re.split(r"\band\b", found["used by"])
        )
        assert {name.strip(): spec(rng) for name, rng in used_by.items()} == {
            "rollout-client": types_range("rollout-client"),
            "rollout-server": types_range("rollout-server"),
        }
        osmosis = {
            side.series
            for pair in compat.compat_table()
            if pair.expect == "works"
            for side in (pair.client, pair.server)
            if not side.ours
        }
        assert names(found["interoperates with"]) == osmosis

    def test_released_versions_have_lines(self, compat: ModuleType) -> None:
        """Every release in releases.toml has a CHANGELOG entry with a Compatibility line."""
        for release in compat.load_releases():
            compatibility_line(changelog(release.distribution), release.version)

    def test_a_disagreeing_line_is_caught(self, compat: ModuleType) -> None:
        """A line that drops a tested peer or changes the range is reported (the check can fail)."""
        version = compat.package_version("rollout-client")
        table = compat.compat_table()
        tested = sorted(works(table, "client", version))
        good = (
            f"**Compatibility:** requires rollout-types {types_range('rollout-client')}; "
            f"tested with {', '.join(tested)}."
        )
        dropped = good.replace(f", {tested[-1]}", "") if len(tested) > 1 else good + " x"
        widened = good.replace(types_range("rollout-client"), ">=0,<99")
        assert client_or_server_problems(good, "rollout-client", table, version) == []
        assert client_or_server_problems(dropped, "rollout-client", table, version) == [
            f"tested with should list {tested}"
        ]
        assert client_or_server_problems(widened, "rollout-client", table, version) == [
            f"requires rollout-types should be {types_range('rollout-client')}"
        ]
