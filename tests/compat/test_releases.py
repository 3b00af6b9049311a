"""releases.toml, the pairs the table derives from it, and rebuilding a release from git.

The table's release pairs are exercised with synthetic entries (the recorded ones are run
by the interop and compat sessions), and the rebuild path (``git archive`` of a commit, one
wheel per package) on HEAD: the wheels must hold HEAD's files, not the working tree's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from interop_harness import peers

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git(*args: str) -> str:
    """Run git in the repository and return its stdout."""
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def release_entry(**fields: str) -> str:
    """One ``[[release]]`` table with valid defaults, overridden by ``fields``."""
    values = {
        "distribution": "rollout-server",
        "version": "0.0.1",
        "commit": COMMIT,
        "protocol": "1.0",
        **fields,
    }
    return "[[release]]\n" + "".join(f'{key} = "{value}"\n' for key, value in values.items())


class TestReleasesFile:
    """Reading and validating releases.toml."""

    def test_repository_file_loads(self, compat: ModuleType) -> None:
        """The checked-in file parses, and every recorded commit exists in the history."""
        for release in compat.load_releases():
            assert git("cat-file", "-t", release.commit).strip() == "commit"

    def test_entries_are_read(self, compat: ModuleType, tmp_path: Path) -> None:
        """A valid entry becomes a Release with every field."""
        path = tmp_path / "releases.toml"
        path.write_text(release_entry(expect="fails-fast"), "utf-8")
        assert compat.load_releases(path) == [
            compat.Release(
                distribution="rollout-server",
                version="0.0.1",
                commit=COMMIT,
                protocol="1.0",
                expect="fails-fast",
            )
        ]

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            (release_entry(commit="abc123"), "full 40-hex-digit git commit"),
            (release_entry(distribution="rollout-tools"), "distribution must be one of"),
            (release_entry(version="1.0"), "is not X.Y.Z"),
            (release_entry(protocol="one"), "is not MAJOR.MINOR"),
            (release_entry(expect="maybe"), "expect must be one of"),
            (release_entry(commitment="x"), "unknown fields ['commitment']"),
            ('[[release]]\nversion = "0.0.1"\n', "missing fields ['commit', 'distribution'"),
            (release_entry() + release_entry(), "is listed twice"),
            ('[release]\nversion = "0.0.1"\n', "#1 must be a table"),
            ("releases = []\n", "unknown top-level keys ['releases']"),
        ],
    )
    def test_bad_entries_are_refused(
        self, compat: ModuleType, tmp_path: Path, text: str, message: str
    ) -> None:
        """A malformed entry raises ValueError naming the file, the entry and the problem."""
        path = tmp_path / "releases.toml"
        path.write_text(text, "utf-8")
        with pytest.raises(ValueError) as caught:
            compat.load_releases(path)
        assert message in str(caught.value)
        assert str(path) in str(caught.value)


class TestTableFromReleases:
    """The table pairs each release with this checkout's other side."""

    def test_without_releases(self, compat: ModuleType) -> None:
        """Without releases the table is this checkout and osmosis-ai, all quick."""
        table = compat.compat_table(releases=[])
        assert [(p.client.peer, p.server.peer, p.expect) for p in table] == [
            ("ours-client", "ours-server", "works"),
            ("osmosis-0.3.8", "ours-server", "works"),
            ("ours-client", "osmosis-0.3.8", "works"),
            ("ours-client", "osmosis-0.3.2", "fails-fast"),
            ("osmosis-0.3.2", "ours-server", "fails-fast"),
        ]
        assert all(pair.quick for pair in table)
        assert [p.error for p in table if p.expect == "fails-fast"] == [
            "RolloutProtocolVersionError",
            "RolloutProtocolError",
        ]

    def test_release_pairs_follow_the_protocol_major(self, compat: ModuleType) -> None:
        """A release with this protocol major works; another major fails fast."""
        current = compat.protocol_version()
        major = int(current.split(".")[0])
        releases = [
            compat.Release(
                distribution="rollout-server", version="0.0.1", commit=COMMIT, protocol=current
            ),
            compat.Release(
                distribution="rollout-client",
                version="0.0.2",
                commit=COMMIT,
                protocol=f"{major + 1}.0",
            ),
            compat.Release(
                distribution="rollout-types", version="0.0.3", commit=COMMIT, protocol=current
            ),
        ]
        extra = compat.compat_table(releases=releases)[5:]
        assert [(p.client.label, p.server.label, p.expect, p.error, p.quick) for p in extra] == [
            (
                f"rollout-client {compat.package_version('rollout-client')} (checkout)",
                f"rollout-server 0.0.1 (release {COMMIT[:10]})",
                "works",
                None,
                True,
            ),
            (
                f"rollout-client 0.0.2 (release {COMMIT[:10]})",
                f"rollout-server {compat.package_version('rollout-server')} (checkout)",
                "fails-fast",
                "RolloutProtocolError",
                True,
            ),
        ]

    def test_newest_release_of_each_series_is_quick(self, compat: ModuleType) -> None:
        """CI (quick) runs the newest release of each MAJOR.MINOR series; older patches don't."""
        current = compat.protocol_version()
        releases = [
            compat.Release(
                distribution="rollout-server", version=version, commit=COMMIT, protocol=current
            )
            for version in ("0.1.0", "0.1.10", "0.1.2", "0.2.0")
        ]
        extra = compat.compat_table(releases=releases)[5:]
        assert [(p.server.version, p.quick) for p in extra] == [
            ("0.1.0", False),
            ("0.1.10", True),
            ("0.1.2", False),
            ("0.2.0", True),
        ]

    def test_expect_overrides_the_derivation(self, compat: ModuleType) -> None:
        """An explicit expect in releases.toml wins over the protocol rule."""
        release = compat.Release(
            distribution="rollout-server",
            version="0.0.1",
            commit=COMMIT,
            protocol=compat.protocol_version(),
            expect="fails-fast",
        )
        (pair,) = compat.compat_table(releases=[release])[5:]
        assert (pair.expect, pair.error) == ("fails-fast", "RolloutProtocolVersionError")


class TestRebuildFromGit:
    """rebuild_release_wheels() builds a commit's packages from git, not from the tree."""

    def test_rebuild_head(self, compat: ModuleType, tmp_path: Path) -> None:
        """HEAD's three wheels carry HEAD's versions, protocol and file contents."""
        if importlib.util.find_spec("hatchling") is None:
            peers.unavailable("rebuilding wheels needs hatchling in the test venv")
        head = git("rev-parse", "HEAD").strip()
        wheels = compat.rebuild_release_wheels(head, python=sys.executable, cache=tmp_path)
        assert sorted(wheels) == ["rollout-client", "rollout-server", "rollout-types"]
        for name, wheel in wheels.items():
            pyproject = git("show", f"{head}:packages/{name}/pyproject.toml")
            assert f'version = "{compat.wheel_version(wheel)}"' in pyproject
        constants = "rollout_types/_constants.py"
        with zipfile.ZipFile(wheels["rollout-types"]) as archive:
            built = archive.read(constants).decode()
        assert built == git("show", f"{head}:packages/rollout-types/src/{constants}")
        protocol = (tmp_path / f"release-{head}" / "PROTOCOL_VERSION").read_text("utf-8")
        assert f'PROTOCOL_VERSION: Final = "{protocol}"' in built
        again = compat.rebuild_release_wheels(head, python="/nonexistent/python", cache=tmp_path)
        assert again == wheels

    def test_unknown_commit_is_explained(self, compat: ModuleType, tmp_path: Path) -> None:
        """A commit missing from the history fails with a hint to fetch it."""
        with pytest.raises(RuntimeError) as caught:
            compat.rebuild_release_wheels(COMMIT, python=sys.executable, cache=tmp_path)
        assert f"git archive {COMMIT} failed" in str(caught.value)
        assert "fetch it" in str(caught.value)
