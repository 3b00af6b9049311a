"""The compatibility table of our releases, this checkout and osmosis-ai, without nox.

``noxfile.py`` builds its ``interop`` and ``compat`` sessions on this module, and the tests
of ``tests/compat`` import it directly (``sys.path`` gets ``tools/``), so neither needs nox
to read the table:

* :func:`load_releases` reads ``releases.toml``;
* :func:`compat_table` pairs this checkout with itself, with osmosis-ai and with each
  recorded release of ours;
* :func:`rebuild_release_wheels` builds a release's wheels from its git commit.
"""

from __future__ import annotations

import dataclasses
import io
import re
import shutil
import subprocess
import tarfile
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "rollout-types": ROOT / "packages" / "rollout-types",
    "rollout-client": ROOT / "packages" / "rollout-client",
    "rollout-server": ROOT / "packages" / "rollout-server",
}
WHEEL_CACHE = ROOT / ".nox" / "_wheels"
RELEASES_FILE = ROOT / "releases.toml"
Expectation = Literal["works", "fails-fast"]
EXPECTATIONS: tuple[Expectation, ...] = ("works", "fails-fast")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_VERSION = re.compile(r"\d+\.\d+\.\d+(?:[.-]?(?:a|b|rc|post|dev)\d+)*")
_PROTOCOL = re.compile(r"\d+\.\d+")
_PROTOCOL_CONSTANT = re.compile(r'^PROTOCOL_VERSION: Final = "([^"]+)"', re.MULTILINE)
_CONSTANTS_FILES = (
    Path("packages/rollout-types/src/rollout_types/_constants.py"),
    Path("packages/rollout-types/src/rollout_types/constants.py"),  # 0.1.0's name
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Release:
    """One published version of one of our distributions (an entry of ``releases.toml``)."""

    distribution: str
    version: str
    commit: str
    protocol: str
    expect: Expectation | None = None


def load_releases(path: Path = RELEASES_FILE) -> list[Release]:
    """Read and validate the releases file (no entries means no releases yet).

    Raises:
        ValueError: On an unknown or missing field, a malformed value, or a duplicate.
    """
    data = tomllib.loads(path.read_text("utf-8"))
    unknown = set(data) - {"release"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; use [[release]]")
    entries = data.get("release", [])
    releases: list[Release] = []
    fields = {field.name for field in dataclasses.fields(Release)}
    for number, entry in enumerate(entries, start=1):
        where = f"{path}: [[release]] #{number}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a table")
        missing = sorted(fields - {"expect"} - set(entry))
        extra = sorted(set(entry) - fields)
        if missing or extra:
            raise ValueError(f"{where}: missing fields {missing}, unknown fields {extra}")
        if not all(isinstance(value, str) for value in entry.values()):
            raise ValueError(f"{where}: every field is a string")
        if entry["distribution"] not in PACKAGES:
            raise ValueError(f"{where}: distribution must be one of {sorted(PACKAGES)}")
        if not _VERSION.fullmatch(entry["version"]):
            raise ValueError(f"{where}: version {entry['version']!r} is not X.Y.Z")
        if not _COMMIT.fullmatch(entry["commit"]):
            raise ValueError(f"{where}: commit must be the full 40-hex-digit git commit")
        if not _PROTOCOL.fullmatch(entry["protocol"]):
            raise ValueError(f"{where}: protocol {entry['protocol']!r} is not MAJOR.MINOR")
        if entry.get("expect", "works") not in EXPECTATIONS:
            raise ValueError(f"{where}: expect must be one of {EXPECTATIONS}")
        release = Release(**entry)
        if any(
            (r.distribution, r.version) == (release.distribution, release.version) for r in releases
        ):
            raise ValueError(f"{where}: {release.distribution} {release.version} is listed twice")
        releases.append(release)
    return releases


def package_version(name: str, root: Path = ROOT) -> str:
    """The ``[project] version`` of one of our distributions in the tree at ``root``."""
    relative = PACKAGES[name].relative_to(ROOT) / "pyproject.toml"
    project = tomllib.loads((root / relative).read_text("utf-8"))["project"]
    return str(project["version"])


def protocol_version(root: Path = ROOT) -> str:
    """``rollout_types.PROTOCOL_VERSION`` in the tree at ``root`` (read, not imported)."""
    for relative in _CONSTANTS_FILES:
        if (root / relative).exists():
            match = _PROTOCOL_CONSTANT.search((root / relative).read_text("utf-8"))
            if match is not None:
                return match.group(1)
    names = ", ".join(str(relative) for relative in _CONSTANTS_FILES)
    raise ValueError(f"no PROTOCOL_VERSION constant in {root} (looked in {names})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Side:
    """One side of a pair: a distribution at a version, from this checkout, git or PyPI.

    ``commit`` is set for a release of ours (rebuilt from git); osmosis-ai comes from PyPI.
    """

    distribution: str
    version: str
    commit: str | None = None

    @property
    def ours(self) -> bool:
        """Whether this is one of our distributions (not osmosis-ai)."""
        return self.distribution in PACKAGES

    @property
    def label(self) -> str:
        """A human name, e.g. ``rollout-server 0.1.0 (checkout)`` or ``osmosis-ai 0.3.8``."""
        if not self.ours:
            return f"{self.distribution} {self.version}"
        origin = "checkout" if self.commit is None else f"release {self.commit[:10]}"
        return f"{self.distribution} {self.version} ({origin})"

    @property
    def series(self) -> str:
        """Its name in a CHANGELOG Compatibility line, e.g. ``rollout-server 0.1``."""
        if not self.ours:
            return f"{self.distribution} {self.version}"
        return f"{self.distribution} {'.'.join(self.version.split('.')[:2])}"

    @property
    def peer(self) -> str:
        """The harness's peer name (tests/interop/interop_harness/peers.py)."""
        if self.distribution == "rollout-client":
            return "ours-client"
        if self.distribution == "rollout-server":
            return "ours-server"
        return f"osmosis-{self.version}"

    @property
    def venv_name(self) -> str:
        """The folder of its venv under ``.nox/_sides/``."""
        if self.ours:
            return f"{self.distribution}-{self.version if self.commit else 'checkout'}"
        return f"{self.distribution}-{self.version}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompatPair:
    """A client side against a server side, expected to work or to fail fast.

    ``error`` names the exception class the client must raise (or a base of it) when the
    pair fails fast; ``quick`` pairs also run in ``nox -s interop`` (CI).
    """

    client: Side
    server: Side
    expect: Expectation
    error: str | None = None
    quick: bool = False

    @property
    def id(self) -> str:
        """The pytest id: ``<client label> -> <server label>``."""
        return f"{self.client.label} -> {self.server.label}"


def _major(version: str) -> str:
    return version.split(".", maxsplit=1)[0]


def _expected(release: Release, current_protocol: str) -> Expectation:
    if release.expect is not None:
        return release.expect
    same_major = _major(release.protocol) == _major(current_protocol)
    return "works" if same_major else "fails-fast"


def compat_table(releases: Sequence[Release] | None = None, root: Path = ROOT) -> list[CompatPair]:
    """The compatibility table: this checkout, our earlier releases, and osmosis-ai.

    Args:
        releases: Our released versions; default :func:`load_releases`.
        root: The tree whose versions count as "this checkout".

    Returns:
        This checkout against itself and both osmosis-ai 0.3.8 directions (``works``);
        osmosis-ai 0.3.2's callback protocol in both directions (``fails-fast``); each
        released client against this checkout's server and this checkout's client against
        each released server (``works`` when the protocol majors agree, else ``fails-fast``;
        ``quick``, so CI runs it, for the newest release of each ``MAJOR.MINOR`` series).
    """
    client = Side(distribution="rollout-client", version=package_version("rollout-client", root))
    server = Side(distribution="rollout-server", version=package_version("rollout-server", root))
    osmosis = Side(distribution="osmosis-ai", version="0.3.8")
    callback = Side(distribution="osmosis-ai", version="0.3.2")
    table = [
        CompatPair(client=client, server=server, expect="works", quick=True),
        CompatPair(client=osmosis, server=server, expect="works", quick=True),
        CompatPair(client=client, server=osmosis, expect="works", quick=True),
        CompatPair(
            client=client,
            server=callback,
            expect="fails-fast",
            error="RolloutProtocolVersionError",
            quick=True,
        ),
        CompatPair(
            client=callback,
            server=server,
            expect="fails-fast",
            error="RolloutProtocolError",
            quick=True,
        ),
    ]
    current = protocol_version(root)
    recorded = load_releases() if releases is None else list(releases)
    newest = _newest_of_each_series(recorded)
    for release in recorded:
        old = Side(
            distribution=release.distribution, version=release.version, commit=release.commit
        )
        expect = _expected(release, current)
        quick = release in newest
        if release.distribution == "rollout-server":
            error = "RolloutProtocolVersionError" if expect == "fails-fast" else None
            table.append(
                CompatPair(client=client, server=old, expect=expect, error=error, quick=quick)
            )
        elif release.distribution == "rollout-client":
            error = "RolloutProtocolError" if expect == "fails-fast" else None
            table.append(
                CompatPair(client=old, server=server, expect=expect, error=error, quick=quick)
            )
    return table


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _newest_of_each_series(releases: Sequence[Release]) -> list[Release]:
    """The newest release of each distribution in each ``MAJOR.MINOR`` series.

    These pairs are ``quick`` (CI runs them in ``nox -s interop``); older patch releases of
    a series run only in ``nox -s compat``.
    """
    newest: dict[tuple[str, str], Release] = {}
    for release in releases:
        series = (release.distribution, ".".join(release.version.split(".")[:2]))
        known = newest.get(series)
        if known is None or _release_key(release.version) > _release_key(known.version):
            newest[series] = release
    return list(newest.values())


def rebuild_release_wheels(
    commit: str, *, python: str, cache: Path = WHEEL_CACHE
) -> dict[str, Path]:
    """Build the wheels of all three distributions as they were at ``commit``.

    The tree comes from ``git archive`` of the commit (never the working tree), and each
    package is built with ``python -m hatchling``; the result is cached per commit.

    Args:
        commit: A full git commit of this repository.
        python: An interpreter that has hatchling.
        cache: Where the wheels are kept, in ``release-<commit>/``.

    Returns:
        The wheel of each distribution, by name.

    Raises:
        RuntimeError: If ``git archive`` or a build fails (with its output).
    """
    out = cache / f"release-{commit}"
    found = {name: sorted(out.glob(f"{name.replace('-', '_')}-*.whl")) for name in PACKAGES}
    if all(found.values()):
        return {name: wheels[-1] for name, wheels in found.items()}
    _fetch_if_shallow(commit)
    with tempfile.TemporaryDirectory(prefix="rollout-release-") as scratch:
        tree = Path(scratch) / "tree"
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "packages"],
            capture_output=True,
            check=False,
        )
        if archive.returncode != 0:
            raise RuntimeError(
                f"git archive {commit} failed: {archive.stderr.decode(errors='replace')}; "
                "is the commit in this clone's history (fetch it, or unshallow the clone)?"
            )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse unsafe members
                tar.extractall(tree, filter="data")
            else:  # pragma: no cover - our own git archive, extracted into a fresh folder
                tar.extractall(tree)  # noqa: S202
        built = Path(scratch) / "wheels"
        for name, package_dir in PACKAGES.items():
            source = tree / package_dir.relative_to(ROOT)
            build = subprocess.run(
                [python, "-m", "hatchling", "build", "-t", "wheel", "-d", str(built)],
                cwd=source,
                capture_output=True,
                text=True,
                check=False,
            )
            if build.returncode != 0:
                raise RuntimeError(f"building {name} at {commit} failed:\n{build.stderr}")
        (built / "PROTOCOL_VERSION").write_text(protocol_version(tree), "utf-8")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(built, out)
    return rebuild_release_wheels(commit, python=python, cache=cache)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
    )


def _fetch_if_shallow(commit: str) -> None:
    """Deepen a shallow clone that lacks ``commit`` (``git fetch --unshallow``), once.

    A CI system that clones with ``--depth`` has no release commits; fetching the rest of
    the history from the clone's own remote brings them. A failed fetch is left for
    ``git archive`` to report.
    """
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0:
        return
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        _git("fetch", "--quiet", "--unshallow")


def wheel_version(wheel: Path) -> str:
    """The version in a wheel's file name (``name-version-...whl``)."""
    return wheel.name.split("-")[1]


def head_releases() -> list[Release]:
    """HEAD's client and server as if they were released: a dry run of the release path.

    Versions and protocol are read from HEAD's tree with ``git show`` (not the working tree).
    """

    def show(path: Path) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), "show", f"HEAD:{path.as_posix()}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    match = _PROTOCOL_CONSTANT.search(show(_CONSTANTS_FILES[0]))
    if match is None:
        raise ValueError(f"HEAD has no PROTOCOL_VERSION constant in {_CONSTANTS_FILES[0]}")
    releases = []
    for name in ("rollout-client", "rollout-server"):
        pyproject = tomllib.loads(show(PACKAGES[name].relative_to(ROOT) / "pyproject.toml"))
        version = str(pyproject["project"]["version"])
        releases.append(
            Release(distribution=name, version=version, commit=head, protocol=match.group(1))
        )
    return releases
