"""Every check of the rollout monorepo, as thin nox sessions over shared helpers.

Run ``nox`` for the CI set (what ``python3 run.py test`` runs), ``nox -l`` to list
sessions. Per-package test sessions install ONLY that distribution (and
``rollout-types``) from freshly built wheels into a clean venv, on every supported
Python, which is how "install only the client" and "install only the server" stay true.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import nox
from nox.logger import logger as nox_logger
from packaging.requirements import Requirement
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))

# tools/ is put on sys.path just above: the table is a plain module the tests import too.
from ci_sessions import CI_COMPUTE_SESSIONS, CI_WAITING_SESSIONS
from compatibility import (
    PACKAGES,
    ROOT,
    WHEEL_CACHE,
    CompatPair,
    Side,
    compat_table,
    head_releases,
    load_releases,
    package_version,
    rebuild_release_wheels,
    wheel_version,
)
from interpreters import find_interpreters, install_hint, pyenv_root

PYTHONS = ["3.11", "3.12", "3.13"]
# The test toolchain, with the lower bounds the configuration needs: pytest-asyncio (which
# pytest-aiohttp brings) 0.24 is the first to read asyncio_default_fixture_loop_scope, and
# it needs pytest 8.2. mypy is pinned like the linters (LINT_DEPS): its checks change
# between releases, and typecheck must not start failing on a fresh machine because one came
# out.
TEST_DEPS = [
    "pytest>=8.2",
    "pytest-aiohttp>=1.0.5",
    "pytest-asyncio>=0.24",
    "pytest-xdist>=3.6",
    "hypothesis>=6.100",
]
PARALLEL = ["--numprocesses", "2"]
"""pytest-xdist options of the suites that wait far more than they compute (rollout-server's
own tests, the floors suites and the interop matrix wait on timers, long polls and
subprocess servers): two worker processes take the server suite from about 113 s to 64 s
on a 2-core host (four took it to 48 s, but oversubscribed the cores, and a loaded machine
is where a test's hidden timing assumption shows). Posargs come after these, so ``-- -n 0``
runs one process (for ``-s`` or ``--pdb``)."""
MYPY = "mypy==2.4.1"
ATIF_MODELS = "atif>=1.8,<1.9"
"""Pydantic models of ATIF, the format of the server's ``trajectory.json``: rollout-server's
tests validate the documents it writes against them (test-only; the server needs none)."""
TEST_EXTRAS = {"rollout-server": "otel"}
"""The extra each distribution's tests install with it: rollout-server's tracing tests need
OpenTelemetry (the tests of the extra's absence hide it)."""
LINT_PATHS = [
    "packages",
    "tests",
    "noxfile.py",
    "run.py",
    "tools",
    "examples",
    "benchmarks",
    "docs",
]


def _expose_pyenv_interpreters() -> None:
    """Put pyenv's 3.11/3.12/3.13 ``bin`` folders on PATH so ``python3.X`` resolves, and warn
    at once about a version found nowhere (which sessions it costs, and how to install it).

    pyenv shims only resolve a version named in ``PYENV_VERSION``; nox should find the
    interpreters without manual set-up, so point at the installed versions directly.
    """
    found = find_interpreters(PYTHONS, path=os.environ.get("PATH", ""), pyenv_root=pyenv_root())
    if found.pyenv_bins:
        os.environ["PATH"] = os.pathsep.join([*found.pyenv_bins, os.environ.get("PATH", "")])
    # uv must use these interpreters, never download one (the network reaches PyPI only).
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
    os.environ.setdefault("UV_PYTHON_PREFERENCE", "only-system")
    if found.missing:
        outcome = "fail (CI)" if MISSING_INTERPRETERS_FAIL else "be skipped"
        versions = ", ".join(found.missing)
        nox_logger.warning(
            f"Python {versions} not found (on PATH or under {pyenv_root()}/versions): the "
            f"sessions on {versions} will {outcome}; {install_hint(found.missing)}"
        )


MISSING_INTERPRETERS_FAIL = "CI" in os.environ
"""Whether a session whose Python is missing fails (on CI: every check must run there) or is
skipped (elsewhere: the others still run, and ``run.py`` lists the skipped ones at the end
and exits non-zero). ``--error-on-missing-interpreters`` makes it fail anywhere."""

_expose_pyenv_interpreters()

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = MISSING_INTERPRETERS_FAIL
if hasattr(nox.options, "download_python"):
    # Newer nox would otherwise ask uv to download a missing Python, which the
    # UV_PYTHON_DOWNLOADS=never above refuses with a hint about uv's own settings: say
    # "not found" instead (the warning above says how to install it).
    nox.options.download_python = "never"
nox.options.sessions = [*CI_COMPUTE_SESSIONS, *CI_WAITING_SESSIONS]


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
    # A folder of this process's own, renamed into place: ``run.py test`` runs two nox
    # processes at once, and the first to finish a wheel wins (the other's copy goes).
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    session.install("hatchling>=1.24")
    with session.chdir(package_dir):
        session.run(
            "python", "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp), silent=True
        )
    try:
        tmp.rename(out)
    except OSError:  # another process put the same wheel there first
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out.glob("*.whl"))[-1]


def install_wheels(session: nox.Session, *names: str, extras: dict[str, str] | None = None) -> None:
    """Install the named distributions from wheels built from this checkout (never editable)."""
    targets = []
    for name in names:
        wheel = build_wheel(session, name)
        extra = (extras or {}).get(name)
        targets.append(f"{name}[{extra}] @ {wheel.as_uri()}" if extra else str(wheel))
    session.install(*targets)


def compile_installed(session: nox.Session) -> None:
    """Byte-compile the session venv's site-packages once: every Ray worker process imports
    Ray and the server afresh, and without bytecode (uv installs none, and the sessions write
    none) each would spend seconds compiling them."""
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    assert isinstance(purelib, str)
    session.run("python", "-m", "compileall", "-q", "-j", "0", purelib.strip(), silent=True)


def run_pytest(session: nox.Session, *args: str) -> None:
    """Run pytest from the repository root with ``args`` (paths, options), then the posargs."""
    session.run("pytest", *args, *session.posargs, env={"PYTHONDONTWRITEBYTECODE": "1"})


# Both linters are pinned: ruff's formatter and rules change between releases, and lint must
# not start failing on a fresh machine because a new release came out.
LINT_DEPS = ["ruff==0.17.6", "import-linter==2.16"]
SOURCE_DIRS = [str(PACKAGES[name] / "src") for name in PACKAGES]
"""The ``src`` folders of the three distributions (what import-linter reads)."""


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check and the import-linter contracts over the whole tree.

    ``lint-imports`` checks the layers written as contracts in pyproject.toml's
    ``[tool.importlinter]``.
    """
    session.install(*LINT_DEPS)
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)
    # import-linter reads the packages' sources without importing them; it only has to find
    # them, so their src folders go on the path (no install, no third-party dependencies).
    env = {"PYTHONPATH": os.pathsep.join(SOURCE_DIRS)}
    session.run("lint-imports", "--no-cache", "--no-logo", env=env)
    # The canary: a contract every checkout breaks (the server imports rollout-types) must be
    # reported broken, so a graph that lost its imports cannot pass the contracts above.
    canary = Path(session.create_tmp()) / "canary.toml"
    canary.write_text(
        '[tool.importlinter]\nroot_packages = ["rollout_types", "rollout_server"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "canary"\ntype = "forbidden"\n'
        'source_modules = ["rollout_server"]\nforbidden_modules = ["rollout_types"]\n',
        "utf-8",
    )
    config = ("--config", str(canary))
    report = session.run(
        "lint-imports", "--no-cache", "--no-logo", *config, env=env, success_codes=[1], silent=True
    )
    if "0 kept, 1 broken" not in str(report):
        session.error(f"lint-imports did not report the canary contract broken:\n{report}")
    unclassified = unclassified_server_modules()
    if unclassified:
        session.error(
            f"rollout_server modules or subpackages in no layer: {unclassified}; place each in "
            "the server-layers contract of pyproject.toml [tool.importlinter]"
        )


def unclassified_server_modules() -> list[str]:
    """The ``rollout_server`` subpackages and top-level modules its layers contract omits.

    Everything below the package is either a subpackage (a layer, or part of one) or a shared
    top-level module; one missing from the ``server-layers`` contract is checked by none, so a
    new one must be placed in a layer when it is added.
    """
    config = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]["importlinter"]
    (layers,) = (c for c in config["contracts"] if c.get("id") == "server-layers")
    named = {part.strip() for layer in layers["layers"] for part in layer.split("|")}
    source = PACKAGES["rollout-server"] / "src" / "rollout_server"
    present = {path.stem for path in source.glob("_*.py")} - {"__init__", "__main__"}
    present |= {path.parent.name for path in source.glob("*/__init__.py")}
    return sorted(present - named)


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the packages, the typing file, the dev tools and the noxfile.

    The dev tools checked are the shared modules: the compatibility table, the interpreter
    finder, process handling, the demo and the public surface.
    """
    session.install(MYPY, "nox>=2024.10", *TEST_DEPS, "uvloop")
    session.install(
        "-e",
        str(PACKAGES["rollout-types"]),
        "-e",
        str(PACKAGES["rollout-client"]),
        "-e",
        f"{PACKAGES['rollout-server']}[{TEST_EXTRAS['rollout-server']}]",
    )
    session.run(
        "mypy",
        "packages/rollout-types/src/rollout_types",
        "packages/rollout-client/src/rollout_client",
        "packages/rollout-server/src/rollout_server",
        "tests/typing",
        "tools/compatibility.py",
        "tools/interpreters.py",
        "tools/ci_sessions.py",
        "tools/devprocs.py",
        "tools/demo.py",
        "tools/public_surface.py",
        "tools/soak.py",
        "tools/raycluster.py",
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
    """rollout-server's own tests, with only rollout-server[otel] and rollout-types installed."""
    install_wheels(session, "rollout-types", "rollout-server", extras=TEST_EXTRAS)
    session.install(*TEST_DEPS, ATIF_MODELS)
    run_pytest(session, *PARALLEL, "packages/rollout-server/tests")


@nox.session(python="3.11")
def integration(session: nox.Session) -> None:
    """Cross-package tests from wheels: client against server, the eval job, the demo.

    Also the dev tools' tests and the benchmark harness's smoke test (tiny counts, times
    nothing).
    """
    install_wheels(
        session,
        "rollout-types",
        "rollout-client",
        "rollout-server",
        extras=TEST_EXTRAS,
    )
    session.install(*TEST_DEPS)
    run_pytest(
        session,
        "tests",
        "benchmarks/tests",
        "--ignore=tests/interop",
        "--ignore=tests/compat",
        "--ignore=tests/typing",
        "--ignore=tests/browser",
    )


TRAINER_TORCH = "torch==2.13.0"
"""The CPU build of PyTorch pip takes from this machine's disk (uv does not look there)."""
TRAINER_LIBRARIES = ("trl", "verl")
"""The trainers whose adapters ``rollout_client.trainers`` holds, each tried on its own."""
TRAINER_UNDECLARED = ("cachetools", "uvicorn", "fastapi")
"""Modules verl's agent loop imports without declaring them (verl 0.9.1)."""


@nox.session(python="3.11", venv_backend="virtualenv")
def trainers(session: nox.Session) -> None:
    """The trainer adapters against the real TRL and verl, where they install (by hand).

    Not in the default set: several GB of downloads. pip (not uv) installs the CPU PyTorch
    first and pins it (a constraints file), then TRL and verl each on its own: one that does
    not install with that PyTorch is reported and skipped, and
    ``tests/integration/test_trainer_adapters.py`` runs with what installed (its
    real-library checks skip for a library that is absent).
    """
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server", extras=TEST_EXTRAS)
    session.install(*TEST_DEPS)
    session.run("python", "-m", "pip", "install", TRAINER_TORCH)
    constraints = Path(session.create_tmp()) / "torch-constraint.txt"
    constraints.write_text(TRAINER_TORCH + "\n", "utf-8")
    for library in TRAINER_LIBRARIES:
        session.run(
            "python", "-m", "pip", "install", "-c", str(constraints), library, success_codes=[0, 1]
        )
        found = session.run(
            "python",
            "-c",
            f"import importlib.util; print(bool(importlib.util.find_spec({library!r})))",
            silent=True,
        )
        if not (isinstance(found, str) and found.strip() == "True"):
            session.warn(f"{library} did not install beside {TRAINER_TORCH}: its checks skip")
    # Seen with verl 0.9.1 and TRL 1.16.0 (transformers 5.10): verl's agent loop imports
    # cachetools, uvicorn and fastapi without declaring them, and transformers' hub-kernels
    # integration fails at import ("Either a revision or a version must be specified") with
    # the kernels 0.19.1 one of them pulls in; transformers runs without kernels.
    session.run("python", "-m", "pip", "install", *TRAINER_UNDECLARED)
    session.run("python", "-m", "pip", "uninstall", "-y", "kernels")
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    run_pytest(session, "tests/integration/test_trainer_adapters.py", "-rs")


REPORT_SCREENSHOTS = ROOT / ".nox" / "report-screenshots"
CHROMIUM_PACKAGES = ("chromium", "fonts-dejavu-core")
"""Debian packages of the browser checks: the browser, and a font to render text with."""


def _ensure_chromium(session: nox.Session) -> None:
    """Install Debian's chromium with apt-get when it is missing and this runs as root."""
    if shutil.which("chromium"):
        return
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        session.error(
            "the browser checks need Debian's chromium package, and this session installs it "
            "only as root on Debian; run `apt-get install chromium` as root, or run the "
            "session as root"
        )
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, env=env)
    session.run(
        "apt-get",
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        *CHROMIUM_PACKAGES,
        external=True,
        env=env,
    )


@nox.session(python="3.11")
def report_browser(session: nox.Session) -> None:
    """The HTML report in headless Chromium: no console errors, a screenshot that is not blank.

    Installs Debian's ``chromium`` first when it is missing (as root, with apt-get), the
    three distributions from wheels, then runs ``tests/browser``: reports of the demo and
    of edge-case runs load from their files, log no error, draw their charts and escape
    markup. Screenshots go to ``.nox/report-screenshots/``. Posargs go to pytest.
    """
    _ensure_chromium(session)
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    session.install(*TEST_DEPS, "pillow>=10")
    shutil.rmtree(REPORT_SCREENSHOTS, ignore_errors=True)
    session.run(
        "pytest",
        "tests/browser",
        *session.posargs,
        env={
            "ROLLOUT_BROWSER_REQUIRE": "1",
            "ROLLOUT_SCREENSHOT_DIR": str(REPORT_SCREENSHOTS),
            "PYTHONDONTWRITEBYTECODE": "1",
        },
    )


FLOOR_SUITES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rollout-types": (("rollout-types",), ()),
    "rollout-client": (("rollout-types", "rollout-client"), ("uvloop",)),
    "rollout-server": (("rollout-types", "rollout-server"), (ATIF_MODELS,)),
}
"""Per distribution under test: the distributions its suite installs, and the extra test
dependencies of that suite (as in tests_types / tests_client / tests_server)."""


def declared_floors(*names: str) -> list[Requirement]:
    """The third-party requirements the pyprojects of ``names`` declare (markers kept), with
    those of the extra each one's tests install (``TEST_EXTRAS``: rollout-server's ``otel``).

    Sibling distributions (``rollout-*``) are left out: the session installs them from
    this checkout's wheels.
    """
    floors: list[Requirement] = []
    for name in names:
        project = tomllib.loads((PACKAGES[name] / "pyproject.toml").read_text("utf-8"))["project"]
        extra = project.get("optional-dependencies", {}).get(TEST_EXTRAS.get(name), [])
        for line in [*project["dependencies"], *extra]:
            requirement = Requirement(line)
            if requirement.name not in PACKAGES:
                floors.append(requirement)
    return floors


def _floor_of(requirement: Requirement) -> str | None:
    """The version of ``requirement``'s ``>=`` clause, if it has one."""
    return next((spec.version for spec in requirement.specifier if spec.operator == ">="), None)


def _installed_versions(session: nox.Session, names: Sequence[str]) -> dict[str, str | None]:
    """The versions of ``names`` installed in the session's venv (None: not installed)."""
    script = (
        "import json, sys\n"
        "from importlib.metadata import PackageNotFoundError, version\n"
        "def get(name):\n"
        "    try:\n"
        "        return version(name)\n"
        "    except PackageNotFoundError:\n"
        "        return None\n"
        "print(json.dumps({name: get(name) for name in sys.argv[1:]}))\n"
    )
    output = session.run("python", "-c", script, *names, silent=True)
    found: dict[str, str | None] = json.loads(str(output).strip().splitlines()[-1])
    return found


@nox.session(python="3.11")
@nox.parametrize("distribution", list(FLOOR_SUITES))
def floors(session: nox.Session, distribution: str) -> None:
    """A distribution's own tests with its third-party dependencies at their declared floors.

    The floors are read from the pyprojects: each requirement (``aiohttp>=3.11``, ...) is
    given to ``uv pip install --resolution lowest-direct`` next to this checkout's wheels,
    so it resolves to its lower bound; the session checks that it did. The test toolchain
    is installed afterwards, constrained to those versions (the newest pytest-aiohttp that
    works with the floor aiohttp, and so on). Python 3.11, the oldest supported.
    """
    if session.venv_backend != "uv":
        session.error("the floors session needs uv (its --resolution lowest-direct)")
    names, extra_test_deps = FLOOR_SUITES[distribution]
    requirements = [
        requirement
        for requirement in declared_floors(*names)
        if requirement.marker is None or requirement.marker.evaluate()
    ]
    wheels = [str(build_wheel(session, name)) for name in names]
    session.install("--resolution", "lowest-direct", *wheels, *map(str, requirements))
    versions = _installed_versions(session, [r.name for r in requirements])
    problems = []
    for requirement in requirements:
        floor, got = _floor_of(requirement), versions[requirement.name]
        if floor is None:
            problems.append(f"{requirement} declares no lower bound (>=)")
        elif got is None or Version(got) != Version(floor):
            problems.append(f"{requirement} resolved to {got}, not its floor")
    if problems:
        session.error("; ".join(problems))
    session.log("floors: " + ", ".join(f"{name}=={got}" for name, got in versions.items()))
    constraints = Path(session.create_tmp()) / "floors.txt"
    constraints.write_text(
        "".join(f"{name}=={got}\n" for name, got in versions.items()),
        "utf-8",
    )
    session.install(*TEST_DEPS, *extra_test_deps, "--constraint", str(constraints))
    run_pytest(session, *PARALLEL, f"packages/{distribution}/tests")


SPHINX = "sphinx==9.0.4"
"""Pinned like the linters (LINT_DEPS): the docs build turns warnings into errors, and a new
Sphinx release can add warnings."""
DOCS_BUILD = ROOT / "docs" / "_build"


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The API reference (``docs/``), rendered from the docstrings into ``docs/_build/html``.

    Installs the three distributions from wheels and Sphinx, then builds with warnings as
    errors and nitpicky references (``-W --keep-going -n``): every ``:class:``, ``:func:``
    and ``:meth:`` reference to our own objects must resolve (``docs/conf.py`` lists the
    external packages whose references cannot link without a network). Posargs go to
    ``sphinx-build``.
    """
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    session.install(SPHINX)
    shutil.rmtree(DOCS_BUILD, ignore_errors=True)
    session.run(
        "sphinx-build",
        "-W",
        "--keep-going",
        "-n",
        "-q",
        "-b",
        "html",
        "docs",
        str(DOCS_BUILD / "html"),
        *session.posargs,
        env={"PYTHONDONTWRITEBYTECODE": "1"},
    )


DIST_DIR = ROOT / "dist"


@nox.session(python="3.11")
def dist(session: nox.Session) -> None:
    """Build the sdist and wheel of each distribution into ``dist/`` and ``twine check`` them.

    ``twine check --strict`` validates the metadata and that each README renders on PyPI
    (``readme-renderer[md]`` renders the Markdown). Nothing is uploaded.
    """
    session.install("hatchling>=1.24", "twine>=5", "readme-renderer[md]>=43")
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    for package_dir in PACKAGES.values():
        with session.chdir(package_dir):
            session.run("python", "-m", "hatchling", "build", "-d", str(DIST_DIR), silent=True)
    built = sorted(str(path) for path in DIST_DIR.iterdir())
    if len(built) != 2 * len(PACKAGES):
        session.error(f"expected an sdist and a wheel per distribution, got {built}")
    session.run("twine", "check", "--strict", *built)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job on embedded defaults: chat stand-in + rollout-server + rollout-eval.

    Installs the three distributions from wheels, then ``tools/demo.py`` starts the chat
    stand-in and ``rollout-server serve`` on free loopback ports, runs ``rollout-eval``
    over the checked-in dataset, prints the summary and stops both servers (SIGTERM).
    """
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    session.run("python", "tools/demo.py", *session.posargs)


@nox.session(python="3.11")
def soak(session: nox.Session) -> None:
    """The chaos soak by hand: 500 items, server and Ray worker SIGKILLs (RayBackend).

    Issue 28: ``tools/soak.py --ray`` starts a Ray head of its own on 127.0.0.1, serves the
    example Ray backend joined to it (named workers that outlive the server), SIGKILLs and
    restarts the rollout server on its state file every ~20 s and one Ray worker every ~15
    s, the chat stand-in answering 5% HTTP 500s; it checks that every item ends with
    exactly one outcome, prints its figures and stops every process it started. Installs
    rollout-server[ray]; pass options after ``--`` (``nox -s soak -- --items 2000``).
    ``soak_short`` is the LocalBackend one of CI.
    """
    install_wheels(
        session,
        "rollout-types",
        "rollout-client",
        "rollout-server",
        extras={"rollout-server": "ray"},
    )
    compile_installed(session)
    session.run("python", "tools/soak.py", "--ray", *session.posargs)


@nox.session(python="3.11")
def soak_short(session: nox.Session) -> None:
    """The CI soak: 400 items under about 60 s of SIGKILL restarts of the rollout server.

    A restart every 12 s (at least 3 of them), 5% chat HTTP 500s, then the
    one-outcome-per-item check (``tools/soak.py``); about 70 s plus the wheel installs.
    """
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    session.run(
        "python",
        "tools/soak.py",
        "--items",
        "400",
        "--min-restarts",
        "3",
        "--restart-every-sec",
        "12",
        "--chaos-sec",
        "60",
        "--max-passes",
        "6",
        "--workdir",
        str(Path(session.create_tmp()) / "soak"),
        *session.posargs,
    )


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
    (about 15 minutes, best on an otherwise idle machine); ``nox -s bench -- --quick`` is a
    smoke run of about a minute; ``-- --workload throughput`` (repeatable) runs a subset;
    ``-- --help`` lists every option.
    """
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    osmosis_python = _bench_osmosis_python(session)
    session.run("python", "-m", "benchmarks", "--osmosis-python", osmosis_python, *session.posargs)


@nox.session(python="3.12")
def bench_ray(session: nox.Session) -> None:
    """Benchmarks of RayBackend against LocalBackend (not in the default set).

    Overhead per no-op rollout, scaling of a CPU-bound workflow over 1 and 2 workers,
    long-poll responsiveness while workers compute, and recovery from SIGKILL of a worker
    (``benchmarks/ray_bench.py``; a few minutes, best on an otherwise idle machine).
    Posargs go to the module (``-- --help``).
    """
    install_wheels(
        session,
        "rollout-types",
        "rollout-client",
        "rollout-server",
        extras={"rollout-server": "ray"},
    )
    compile_installed(session)
    session.run("python", "-m", "benchmarks.ray_bench", *session.posargs)


# -- Versions: interop with osmosis-ai and the compatibility matrix --------------------------
#
# Each (client, server) pair of COMPAT_TABLE is expected to work or to fail fast with a
# clear error. `nox -s compat` installs every side into a venv of its own (ours from wheels,
# never editable; osmosis-ai from PyPI), and tests/compat runs the shared scenario suite
# with each pair's client against its server, started as a subprocess on 127.0.0.1 (the
# interop suites of tests/interop run too). `nox -s interop` is the quick part CI runs:
# the pairs marked `quick` (this checkout against itself, both osmosis-ai 0.3.8 directions,
# the osmosis-ai 0.3.2 checks, and the newest recorded release of each series against this
# checkout in both directions) with the same suites. The table itself lives in
# tools/compatibility.py, which the tests import without nox.

SIDES_DIR = ROOT / ".nox" / "_sides"
PEER_PYTHON = "3.12"
"""Python of every side venv (osmosis-ai needs 3.12) and of the interop/compat sessions."""
OSMOSIS_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    # The eval extra (LiteLLM, uv, pyarrow) is what `osmosis eval run` needs:
    # tests/interop/test_osmosis_eval_run.py drives our server with osmosis-ai's CLI.
    "0.3.8": ("osmosis-ai[server,eval]==0.3.8", "uvicorn"),
    "0.3.2": ("osmosis-ai[server]==0.3.2", "uvicorn"),
}
HARNESS_DEPS = [*TEST_DEPS, "aiohttp>=3.9", "attrs>=23.2", "hatchling>=1.24", "pip"]
"""The test venv of interop/compat: pytest, the chat stand-in (aiohttp), and the tools the
release-rebuild and dependency-range tests call (hatchling, pip)."""


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
    session.run("pytest", *PARALLEL, "tests/interop", "tests/compat", *pytest_args, env=env)


@nox.session(python=PEER_PYTHON)
def interop(session: nox.Session) -> None:
    """The quick part of the compatibility matrix (in CI): checkout, osmosis-ai, releases.

    Pairs marked ``quick`` in :func:`compat_table` (checkout against itself, both
    osmosis-ai 0.3.8 directions, osmosis-ai 0.3.2 failing fast both ways, and the newest
    recorded release of each series of ours against this checkout, both directions), each
    side in its own venv; runs tests/interop and tests/compat. Posargs go to pytest.
    """
    run_matrix(session, [pair for pair in compat_table() if pair.quick], session.posargs)


RAY_TESTS = (
    "packages/rollout-server/tests/test_ray_backend.py",
    "packages/rollout-server/tests/test_ray_reattach.py",
    "packages/rollout-server/tests/test_local_http.py",
)
"""RayBackend's own tests, and the real-backend HTTP suite run against RayBackend."""


@nox.session(python=PEER_PYTHON)
def ray(session: nox.Session) -> None:
    """RayBackend on a real Ray cluster (127.0.0.1 only), in CI.

    Installs rollout-server[ray] from wheels; runs RayBackend's tests (fault injection on a
    multi-node cluster in one machine) and the backend-independent HTTP suite with
    ``--backend=ray``, then osmosis-ai 0.3.8's client against a RayBackend server: the
    pull-protocol interop suite (graded and failing rollouts, milestones, cancel, 409,
    health, wait_idle, 429) with ``ROLLOUT_INTEROP_OURS_BACKEND=ray``, this venv as the
    server side and an osmosis-ai venv as the client (only that pair). Ray stays out of
    the ``interop`` session's venvs. Posargs go to both pytest runs.
    """
    install_wheels(session, "rollout-types", "rollout-server", extras={"rollout-server": "ray"})
    session.install(*HARNESS_DEPS)
    compile_installed(session)
    env = {"PYTHONDONTWRITEBYTECODE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    session.run("pytest", *RAY_TESTS, "--backend=ray", *session.posargs, env=env)
    osmosis = Side(distribution="osmosis-ai", version="0.3.8")
    server_python = str(Path(session.bin) / "python")
    listing = [
        {
            "id": "osmosis-0.3.8-client-vs-ray-backend",
            "client": {"peer": osmosis.peer, "python": make_side_venv(session, osmosis)},
            "server": {"peer": "ours-server", "python": server_python},
            "expect": "works",
            "error": None,
        }
    ]
    pairs_file = Path(session.create_tmp()) / "ray-pairs.json"
    pairs_file.write_text(json.dumps(listing, indent=2), "utf-8")
    env.update(
        ROLLOUT_INTEROP_REQUIRE="1",
        ROLLOUT_COMPAT_PAIRS=str(pairs_file),
        ROLLOUT_INTEROP_OURS_BACKEND="ray",
    )
    # Scenarios that start servers of their own (restart, auth, lease expiry) test the
    # server, not the backend, and would each start a Ray cluster: left to `interop`.
    only = "not restart and not auth and not lease_expires"
    session.run(
        "pytest", "tests/interop/test_pull_protocol.py", "-k", only, *session.posargs, env=env
    )


HEAD_AS_RELEASE = "--head-as-release"


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
