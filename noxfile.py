"""Every check of the rollout monorepo, as thin nox sessions over shared helpers.

Run ``nox`` for the CI set (what ``python3 run.py test`` runs), ``nox -l`` to list
sessions. Per-package test sessions install ONLY that distribution (and
``rollout-types``) from freshly built wheels into a clean venv, on every supported
Python, which is how "install only the client" and "install only the server" stay true.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES = {
    "rollout-types": ROOT / "packages" / "rollout-types",
    "rollout-client": ROOT / "packages" / "rollout-client",
    "rollout-server": ROOT / "packages" / "rollout-server",
}
WHEEL_CACHE = ROOT / ".nox" / "_wheels"
PYTHONS = ["3.11", "3.12", "3.13"]
TEST_DEPS = ["pytest>=8", "pytest-aiohttp>=1.0", "hypothesis>=6"]
LINT_PATHS = ["packages", "tests", "noxfile.py", "run.py", "tools", "examples", "benchmarks"]


def _expose_pyenv_interpreters() -> None:
    """Put pyenv's 3.11/3.12/3.13 ``bin`` folders on PATH so ``python3.X`` resolves.

    pyenv shims only resolve a version named in ``PYENV_VERSION``; nox should find the
    interpreters without manual set-up, so point at the installed versions directly.
    """
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    dirs: list[str] = []
    for minor in PYTHONS:
        candidates = sorted(glob.glob(str(pyenv_root / "versions" / f"{minor}.*" / "bin")))
        if candidates:
            dirs.append(candidates[-1])
    if dirs:
        os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])
    # uv must use these interpreters, never download one (the network reaches PyPI only).
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
    os.environ.setdefault("UV_PYTHON_PREFERENCE", "only-system")


_expose_pyenv_interpreters()

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "lint",
    "typecheck",
    "tests_types",
    "tests_client",
    "tests_server",
    "integration",
    "interop",
]


def _source_digest(package_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and "tests" not in path.parts:
            digest.update(str(path.relative_to(package_dir)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_wheel(session: nox.Session, name: str) -> Path:
    """Build (or reuse, keyed by a digest of its sources) the wheel of one distribution.

    Returns:
        The path of the ``.whl`` file.
    """
    package_dir = PACKAGES[name]
    out = WHEEL_CACHE / f"{name}-{_source_digest(package_dir)}"
    wheels = sorted(out.glob("*.whl"))
    if wheels:
        return wheels[-1]
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    session.install("hatchling>=1.24")
    with session.chdir(package_dir):
        session.run(
            "python", "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp), silent=True
        )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(out.glob("*.whl"))[-1]


def install_wheels(session: nox.Session, *names: str, extras: dict[str, str] | None = None) -> None:
    """Install the named distributions from wheels built from this checkout (never editable)."""
    targets = []
    for name in names:
        wheel = build_wheel(session, name)
        extra = (extras or {}).get(name)
        targets.append(f"{name}[{extra}] @ {wheel.as_uri()}" if extra else str(wheel))
    session.install(*targets)


def run_pytest(session: nox.Session, *paths: str) -> None:
    """Run pytest from the repository root over ``paths`` plus any session posargs."""
    session.run("pytest", *paths, *session.posargs, env={"PYTHONDONTWRITEBYTECODE": "1"})


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.run(sys.executable, "-m", "ruff", "check", *LINT_PATHS, external=True)
    session.run(sys.executable, "-m", "ruff", "format", "--check", *LINT_PATHS, external=True)


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the three packages, their tests' typing file and the noxfile."""
    session.install("mypy>=1.10", "nox", *TEST_DEPS, "uvloop")
    session.install(
        "-e",
        str(PACKAGES["rollout-types"]),
        "-e",
        str(PACKAGES["rollout-client"]),
        "-e",
        str(PACKAGES["rollout-server"]),
    )
    session.run(
        "mypy",
        "packages/rollout-types/src/rollout_types",
        "packages/rollout-client/src/rollout_client",
        "packages/rollout-server/src/rollout_server",
        "tests/typing",
        "noxfile.py",
    )


@nox.session(python=PYTHONS)
def tests_types(session: nox.Session) -> None:
    """rollout-types' own tests, with only rollout-types installed (from its wheel)."""
    install_wheels(session, "rollout-types")
    session.install(*TEST_DEPS)
    run_pytest(session, "packages/rollout-types/tests")


@nox.session(python=PYTHONS)
def tests_client(session: nox.Session) -> None:
    """rollout-client's own tests, with only rollout-client and rollout-types installed."""
    install_wheels(session, "rollout-types", "rollout-client")
    # uvloop is test-only here: the client suites run under both event loops.
    session.install(*TEST_DEPS, "uvloop")
    run_pytest(session, "packages/rollout-client/tests")


@nox.session(python=PYTHONS)
def tests_server(session: nox.Session) -> None:
    """rollout-server's own tests, with only rollout-server and rollout-types installed."""
    install_wheels(session, "rollout-types", "rollout-server")
    session.install(*TEST_DEPS)
    run_pytest(session, "packages/rollout-server/tests")


@nox.session(python="3.11")
def integration(session: nox.Session) -> None:
    """Cross-package tests (client against server, the eval job, the demo) from wheels, and
    the benchmark harness's smoke test (tiny counts, times nothing)."""
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    session.install(*TEST_DEPS)
    run_pytest(
        session,
        "tests",
        "benchmarks/tests",
        "--ignore=tests/interop",
        "--ignore=tests/compat",
        "--ignore=tests/typing",
    )


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job on embedded defaults: chat stand-in + rollout-server + rollout-eval.

    Installs the three distributions from wheels, then ``tools/demo.py`` starts the chat
    stand-in and ``rollout-server serve`` on free loopback ports, runs ``rollout-eval``
    over the checked-in dataset, prints the summary and stops both servers (SIGTERM).
    """
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    session.run("python", "tools/demo.py", *session.posargs)


BENCH_OSMOSIS_REQUIREMENTS = ("osmosis-ai[server]==0.3.8", "uvicorn")
BENCH_OSMOSIS_VENV = ROOT / ".nox" / "_bench-osmosis-0.3.8"


def _bench_osmosis_python(session: nox.Session) -> str:
    """Create (or reuse) the osmosis-ai 0.3.8 venv of the benchmarks; return its python.

    Built from PyPI on the session's interpreter (so both stacks run the same Python),
    with uv when it is available and venv + pip otherwise; reused while its requirements
    and base interpreter are unchanged.
    """
    base = str(Path(session.bin) / "python")
    interpreter = BENCH_OSMOSIS_VENV / "bin" / "python"
    marker = BENCH_OSMOSIS_VENV / ".bench-requirements"
    wanted = "\n".join([os.path.realpath(base), *BENCH_OSMOSIS_REQUIREMENTS])
    if interpreter.exists() and marker.exists() and marker.read_text("utf-8") == wanted:
        return str(interpreter)
    shutil.rmtree(BENCH_OSMOSIS_VENV, ignore_errors=True)
    uv_sibling = Path(sys.executable).with_name("uv")
    uv = str(uv_sibling) if uv_sibling.exists() else shutil.which("uv")
    if uv:
        session.run(uv, "venv", "--quiet", "--python", base, str(BENCH_OSMOSIS_VENV), external=True)
        session.run(
            uv,
            "pip",
            "install",
            "--quiet",
            "--python",
            str(interpreter),
            *BENCH_OSMOSIS_REQUIREMENTS,
            external=True,
        )
    else:
        session.run(base, "-m", "venv", str(BENCH_OSMOSIS_VENV), external=True)
        session.run(
            str(interpreter), "-m", "pip", "install", "--quiet", *BENCH_OSMOSIS_REQUIREMENTS
        )
    marker.write_text(wanted, "utf-8")
    return str(interpreter)


@nox.session(python="3.12")
def bench(session: nox.Session) -> None:
    """Benchmarks of our stack against osmosis-ai 0.3.8, side by side (not in the default set).

    Ours is installed from wheels of this checkout into the session's venv, osmosis-ai
    0.3.8 and uvicorn from PyPI into a second venv on the same Python. Results (JSON lines
    and a markdown table) go to ``bench-results/``. ``nox -s bench`` runs the full suite
    (about 10 minutes, best on an otherwise idle machine); ``nox -s bench -- --quick`` is a
    smoke run of about a minute; ``-- --workload throughput`` (repeatable) runs a subset;
    ``-- --help`` lists every option.
    """
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    osmosis_python = _bench_osmosis_python(session)
    session.run("python", "-m", "benchmarks", "--osmosis-python", osmosis_python, *session.posargs)


# -- Versions: interop with osmosis-ai and the compatibility matrix --------------------------
#
# Each (client, server) pair of COMPAT_TABLE is expected to work or to fail fast with a
# clear error. `nox -s compat` installs every side into a venv of its own (ours from wheels,
# never editable; osmosis-ai from PyPI), and tests/compat runs the shared scenario suite
# with each pair's client against its server, started as a subprocess on 127.0.0.1 (the
# interop suites of tests/interop run too). `nox -s interop` is the quick part CI runs:
# the pairs marked `quick` (this checkout against itself, both osmosis-ai 0.3.8 directions
# and the osmosis-ai 0.3.2 checks) with the same suites.

RELEASES_FILE = ROOT / "releases.toml"
SIDES_DIR = ROOT / ".nox" / "_sides"
PEER_PYTHON = "3.12"
"""Python of every side venv (osmosis-ai needs 3.12) and of the interop/compat sessions."""
OSMOSIS_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "0.3.8": ("osmosis-ai[server]==0.3.8", "uvicorn"),
    "0.3.2": ("osmosis-ai[server]==0.3.2", "uvicorn"),
}
HARNESS_DEPS = [*TEST_DEPS, "aiohttp>=3.9", "attrs>=23.2", "nox", "hatchling>=1.24", "pip"]
"""The test venv of interop/compat: pytest, the chat stand-in (aiohttp), and the tools the
release-rebuild and dependency-range tests call (nox to import this file, hatchling, pip)."""
Expectation = Literal["works", "fails-fast"]
EXPECTATIONS: tuple[Expectation, ...] = ("works", "fails-fast")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_VERSION = re.compile(r"\d+\.\d+\.\d+(?:[.-]?(?:a|b|rc|post|dev)\d+)*")
_PROTOCOL = re.compile(r"\d+\.\d+")
_PROTOCOL_CONSTANT = re.compile(r'^PROTOCOL_VERSION: Final = "([^"]+)"', re.MULTILINE)
_CONSTANTS = Path("packages/rollout-types/src/rollout_types/constants.py")


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
    match = _PROTOCOL_CONSTANT.search((root / _CONSTANTS).read_text("utf-8"))
    if match is None:
        raise ValueError(f"no PROTOCOL_VERSION constant in {root / _CONSTANTS}")
    return match.group(1)


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
        each released server (``works`` when the protocol majors agree, else ``fails-fast``).
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
    for release in load_releases() if releases is None else releases:
        old = Side(
            distribution=release.distribution, version=release.version, commit=release.commit
        )
        expect = _expected(release, current)
        if release.distribution == "rollout-server":
            error = "RolloutProtocolVersionError" if expect == "fails-fast" else None
            table.append(CompatPair(client=client, server=old, expect=expect, error=error))
        elif release.distribution == "rollout-client":
            error = "RolloutProtocolError" if expect == "fails-fast" else None
            table.append(CompatPair(client=old, server=server, expect=expect, error=error))
    return table


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


def wheel_version(wheel: Path) -> str:
    """The version in a wheel's file name (``name-version-...whl``)."""
    return wheel.name.split("-")[1]


def _release_requirements(session: nox.Session, side: Side) -> list[str]:
    assert side.commit is not None
    session.install("hatchling>=1.24")
    wheels = rebuild_release_wheels(side.commit, python=str(Path(session.bin) / "python"))
    built = wheel_version(wheels[side.distribution])
    if built != side.version:
        session.error(
            f"releases.toml says {side.distribution} {side.version} was released from "
            f"{side.commit}, but that commit builds version {built}; fix the entry"
        )
    return [str(wheels["rollout-types"]), str(wheels[side.distribution])]


def _side_requirements(session: nox.Session, side: Side) -> list[str]:
    if not side.ours:
        return list(OSMOSIS_REQUIREMENTS[side.version])
    if side.commit is not None:
        return _release_requirements(session, side)
    return [
        str(build_wheel(session, "rollout-types")),
        str(build_wheel(session, side.distribution)),
    ]


def make_side_venv(session: nox.Session, side: Side) -> str:
    """Create a fresh venv holding only ``side`` (and what it needs); return its python.

    Ours is installed from wheels (this checkout's, or a release's rebuilt from git),
    never editable; osmosis-ai from PyPI. uv installs from its cache, so each PyPI wheel
    is downloaded once and reused by every venv that needs it (pip's cache without uv).
    """
    location = SIDES_DIR / f"{session.name}-{side.venv_name}"
    python = location / "bin" / "python"
    requirements = _side_requirements(session, side)
    shutil.rmtree(location, ignore_errors=True)
    has_uv, uv, _ = nox.virtualenv.find_uv()
    if has_uv:
        session.run(uv, "venv", "--quiet", "--python", PEER_PYTHON, str(location), external=True)
        session.run(
            uv, "pip", "install", "--quiet", "--python", str(python), *requirements, external=True
        )
    else:
        session.run(f"python{PEER_PYTHON}", "-m", "venv", str(location), external=True)
        session.run(str(python), "-m", "pip", "install", "--quiet", *requirements, external=True)
    return str(python)


def run_matrix(
    session: nox.Session, pairs: Sequence[CompatPair], pytest_args: Sequence[str]
) -> None:
    """Install every side of ``pairs`` into its own venv and run tests/interop and tests/compat.

    The test venv (the session's) has only the harness; the suites reach each side
    through subprocesses of its venv's interpreter, named by the environment variables of
    tests/interop/interop_harness/peers.py and the pairs file ``ROLLOUT_COMPAT_PAIRS``.
    ``ROLLOUT_INTEROP_REQUIRE=1`` makes a test whose peer is missing fail, never skip.
    """
    session.install(*HARNESS_DEPS)
    client = Side(distribution="rollout-client", version=package_version("rollout-client"))
    server = Side(distribution="rollout-server", version=package_version("rollout-server"))
    sides = {client, server}
    sides.update(version_side for pair in pairs for version_side in (pair.client, pair.server))
    pythons = {side: make_side_venv(session, side) for side in sorted(sides, key=lambda s: s.label)}
    listing = [
        {
            "id": pair.id,
            "client": {"peer": pair.client.peer, "python": pythons[pair.client]},
            "server": {"peer": pair.server.peer, "python": pythons[pair.server]},
            "expect": pair.expect,
            "error": pair.error,
        }
        for pair in pairs
    ]
    pairs_file = Path(session.create_tmp()) / "compat-pairs.json"
    pairs_file.write_text(json.dumps(listing, indent=2), "utf-8")
    env = {
        "ROLLOUT_INTEROP_REQUIRE": "1",
        "ROLLOUT_COMPAT_PAIRS": str(pairs_file),
        "ROLLOUT_INTEROP_CLIENT_PYTHON": pythons[client],
        "ROLLOUT_INTEROP_SERVER_PYTHON": pythons[server],
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for side, python in pythons.items():
        if side.distribution == "osmosis-ai":
            env[f"ROLLOUT_INTEROP_OSMOSIS{'' if side.version == '0.3.8' else '032'}_PYTHON"] = (
                python
            )
    session.run("pytest", "tests/interop", "tests/compat", *pytest_args, env=env)


@nox.session(python=PEER_PYTHON)
def interop(session: nox.Session) -> None:
    """The quick part of the matrix (CI): this checkout against itself and osmosis-ai.

    Pairs marked ``quick`` in :func:`compat_table` (checkout against itself, both
    osmosis-ai 0.3.8 directions, osmosis-ai 0.3.2 failing fast both ways), each side in its
    own venv; runs tests/interop and tests/compat. Posargs go to pytest.
    """
    run_matrix(session, [pair for pair in compat_table() if pair.quick], session.posargs)


HEAD_AS_RELEASE = "--head-as-release"


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
    match = _PROTOCOL_CONSTANT.search(show(_CONSTANTS))
    if match is None:
        raise ValueError(f"HEAD has no PROTOCOL_VERSION constant in {_CONSTANTS}")
    releases = []
    for name in ("rollout-client", "rollout-server"):
        pyproject = tomllib.loads(show(PACKAGES[name].relative_to(ROOT) / "pyproject.toml"))
        version = str(pyproject["project"]["version"])
        releases.append(
            Release(distribution=name, version=version, commit=head, protocol=match.group(1))
        )
    return releases


@nox.session(python=PEER_PYTHON)
def compat(session: nox.Session) -> None:
    """The whole compatibility matrix: every pair of :func:`compat_table`.

    Adds our releases (``releases.toml``, rebuilt from git) to the quick pairs of
    ``interop``. Each side is installed from wheels into a venv of its own; the shared
    scenario suite (tests/compat) runs each pair, plus tests/interop. Other posargs go to
    pytest. ``--head-as-release`` adds HEAD's client and server as if released (rebuilt
    from git like a release), to try the release path before there are releases.
    """
    pytest_args = [arg for arg in session.posargs if arg != HEAD_AS_RELEASE]
    releases = load_releases()
    if HEAD_AS_RELEASE in session.posargs:
        releases += head_releases()
    run_matrix(session, compat_table(releases), pytest_args)
