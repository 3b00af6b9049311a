"""pip refuses a client or server next to a rollout-types outside its declared range.

The test builds this checkout's client and server wheels and rollout-types wheels
re-versioned above, below and inside the range into a temporary find-links folder, then
asks pip (``--dry-run --no-index``, against the venv of the client or server side, whose
third-party dependencies are installed) to install the pair. Out of range must be a
resolution error naming rollout-types; in range must resolve.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from interop_harness import OURS_CLIENT, OURS_SERVER, peers, python_of

ROOT = Path(__file__).resolve().parents[2]


def version_of(package: str) -> str:
    """The version in a package's pyproject.toml."""
    text = (ROOT / "packages" / package / "pyproject.toml").read_text("utf-8")
    return str(tomllib.loads(text)["project"]["version"])


def types_bounds() -> tuple[str, str]:
    """The lower and upper bound of the client's rollout-types range (``>=L,<U``)."""
    text = (ROOT / "packages" / "rollout-client" / "pyproject.toml").read_text("utf-8")
    match = re.search(r'"rollout-types>=([\d.]+),<([\d.]+)"', text)
    assert match is not None, "rollout-client must require rollout-types>=L,<U"
    return match.group(1), match.group(2)


def build(source: Path, out: Path) -> None:
    """Build the wheel of the package at ``source`` into ``out`` with hatchling."""
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out)],
        cwd=source,
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Client and server wheels plus rollout-types wheels above, below and inside the range."""
    for module in ("hatchling", "pip"):
        if importlib.util.find_spec(module) is None:
            peers.unavailable(f"this test needs {module} in the test venv")
    lower, upper = types_bounds()
    versions = {
        "above": f"{upper}.0",
        "below": "0.0.0" if lower != "0.0" else "0.0.0a1",
        "inside": f"{lower}.999",
    }
    out = tmp_path_factory.mktemp("wheelhouse")
    for package in ("rollout-client", "rollout-server"):
        build(ROOT / "packages" / package, out)
    current = version_of("rollout-types")
    for version in versions.values():
        source = tmp_path_factory.mktemp(f"rollout-types-{version}")
        shutil.copytree(
            ROOT / "packages" / "rollout-types",
            source,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "tests"),
        )
        pyproject = source / "pyproject.toml"
        text = pyproject.read_text("utf-8")
        pyproject.write_text(text.replace(f'version = "{current}"', f'version = "{version}"'))
        build(source, out)
    return out, versions


def pip_dry_run(target: str, wheels: Path, *requirements: str) -> subprocess.CompletedProcess[str]:
    """``pip install --dry-run --no-index --find-links wheels`` into ``target``'s venv."""
    return subprocess.run(
        [
            sys.executable, "-m", "pip", "--python", target, "--disable-pip-version-check",
            "install", "--dry-run", "--no-index", "--find-links", str(wheels), *requirements,
        ],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("package", "peer"), [("rollout-client", OURS_CLIENT), ("rollout-server", OURS_SERVER)]
)
class TestTypesRange:
    """Each of the client and the server accepts only a rollout-types inside its range."""

    @pytest.mark.parametrize("where", ["above", "below"])
    def test_out_of_range_is_refused(
        self, wheelhouse: tuple[Path, dict[str, str]], package: str, peer: str, where: str
    ) -> None:
        """pip's resolver refuses the pair and names rollout-types' conflict."""
        wheels, versions = wheelhouse
        result = pip_dry_run(
            python_of(peer),
            wheels,
            f"{package}=={version_of(package)}",
            f"rollout-types=={versions[where]}",
        )
        assert result.returncode != 0, result.stdout
        assert "ResolutionImpossible" in result.stderr, result.stderr
        lower, upper = types_bounds()
        declared = f"{package} {version_of(package)} depends on rollout-types<{upper} and >={lower}"
        assert declared in result.stdout + result.stderr, result.stdout
        assert f"rollout-types=={versions[where]}" in result.stderr, result.stderr
        assert "Would install" not in result.stdout

    def test_inside_range_resolves(
        self, wheelhouse: tuple[Path, dict[str, str]], package: str, peer: str
    ) -> None:
        """The same pair with an in-range rollout-types resolves (the refusal is the range's)."""
        wheels, versions = wheelhouse
        result = pip_dry_run(
            python_of(peer),
            wheels,
            f"{package}=={version_of(package)}",
            f"rollout-types=={versions['inside']}",
        )
        assert result.returncode == 0, result.stderr
        assert f"rollout-types-{versions['inside']}" in result.stdout, result.stdout
