"""Every check of the rollout monorepo, as thin nox sessions over shared helpers.

Run ``nox`` for the CI set (what ``python3 run.py test`` runs), ``nox -l`` to list
sessions. Per-package test sessions install ONLY that distribution (and
``rollout-types``) from freshly built wheels into a clean venv, on every supported
Python, which is how "install only the client" and "install only the server" stay true.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
from pathlib import Path

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
    session.install(*TEST_DEPS)
    run_pytest(session, "packages/rollout-client/tests")


@nox.session(python=PYTHONS)
def tests_server(session: nox.Session) -> None:
    """rollout-server's own tests, with only rollout-server and rollout-types installed."""
    install_wheels(session, "rollout-types", "rollout-server")
    session.install(*TEST_DEPS)
    run_pytest(session, "packages/rollout-server/tests")


@nox.session(python="3.11")
def integration(session: nox.Session) -> None:
    """Cross-package tests (client against server, the eval job, the demo) from wheels."""
    install_wheels(session, "rollout-types", "rollout-client", "rollout-server")
    session.install(*TEST_DEPS)
    run_pytest(
        session, "tests", "--ignore=tests/interop", "--ignore=tests/compat", "--ignore=tests/typing"
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
