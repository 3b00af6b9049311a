"""Fixtures of the browser checks: one headless Chromium per session, a tab per test.

``browser_harness`` (next to this file) is put on ``sys.path``: the suites run with
``--import-mode=importlib``, where test folders are not importable packages.

Without a ``chromium`` on PATH the tests are skipped, or fail when
``ROLLOUT_BROWSER_REQUIRE=1`` (the ``report_browser`` nox session sets it, after
installing Debian's package). Screenshots go to ``ROLLOUT_SCREENSHOT_DIR`` when it is set.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from browser_harness import BrowserPage, Chromium, open_page, start_chromium, stop_chromium


@pytest.fixture(scope="session")
def chromium() -> Iterator[Chromium]:
    """Headless Chromium for the whole test session, stopped by its PID at the end."""
    binary = shutil.which("chromium")
    if binary is None:
        message = (
            "chromium is not installed; run `python3 run.py -s report_browser` (as root it "
            "installs Debian's chromium package)"
        )
        if os.environ.get("ROLLOUT_BROWSER_REQUIRE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    browser = start_chromium(binary)
    try:
        yield browser
    finally:
        stop_chromium(browser)


@pytest.fixture
async def page(chromium: Chromium) -> AsyncIterator[BrowserPage]:
    """A new tab, closed after the test."""
    async with open_page(chromium) as tab:
        yield tab


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    """Where screenshots are kept: ``ROLLOUT_SCREENSHOT_DIR``, or the test's tmp_path."""
    configured = os.environ.get("ROLLOUT_SCREENSHOT_DIR")
    directory = Path(configured) if configured else tmp_path
    directory.mkdir(parents=True, exist_ok=True)
    return directory
