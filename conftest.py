"""Test hygiene shared by every suite of the monorepo (pytest finds this file at the root).

No suite writes under the user's home directory: for the whole session, the artifact root
variables that ``LocalBackend`` and osmosis-ai read (and ``XDG_STATE_HOME``, their
fallback) point into pytest's temporary directory. Subprocesses (``rollout-server serve``,
the interop harness's peers and drivers) inherit them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

ARTIFACT_ROOT_VARIABLES = ("ROLLOUT_ARTIFACT_ROOT", "_OSMOSIS_ROLLOUT_ARTIFACT_ROOT")


@pytest.fixture(scope="session", autouse=True)
def _artifacts_outside_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Point the artifact roots (and XDG state) into the session's temporary directory."""
    root = tmp_path_factory.mktemp("artifacts")
    with pytest.MonkeyPatch.context() as patch:
        for name in ARTIFACT_ROOT_VARIABLES:
            patch.setenv(name, str(root))
        patch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))
        yield
