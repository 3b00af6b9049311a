"""Headless Chromium driven through the DevTools protocol, for the report checks.

:func:`start_chromium` starts Debian's ``chromium`` (``--headless=new --no-sandbox``, a
fresh profile, no background networking, DevTools on a free loopback port read from the
profile's ``DevToolsActivePort``); :func:`stop_chromium` stops it by its PID.
:func:`open_page` opens a :class:`BrowserPage` (a new tab over its own websocket) that
loads a file and collects console errors, uncaught exceptions and screenshots.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import aiohttp
from PIL import Image

START_TIMEOUT_SEC: Final = 60.0
"""Bound on Chromium writing its DevTools port (a cold start on a loaded machine)."""

COMMAND_TIMEOUT_SEC: Final = 60.0
"""Bound on one DevTools command or awaited event (loading or capturing a large page)."""

VIEWPORT: Final = (1280, 900)
"""CSS pixels of the emulated window."""

MAX_SCREENSHOT_HEIGHT: Final = 8000
"""Full-page screenshots stop at this many CSS pixels."""

CHROMIUM_FLAGS: Final = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)


class BrowserError(RuntimeError):
    """Chromium failed to start, or a DevTools command failed."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Chromium:
    """A running headless Chromium: its process, DevTools port, profile and log."""

    process: subprocess.Popen[bytes]
    port: int
    profile: Path
    log: Path


def start_chromium(binary: str) -> Chromium:
    """Start headless Chromium and wait (bounded) for its DevTools port.

    Raises:
        BrowserError: If it exits, or writes no port within ``START_TIMEOUT_SEC``.
    """
    profile = Path(tempfile.mkdtemp(prefix="rollout-chromium-"))
    log = profile.with_suffix(".log")
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    chromium = Chromium(process=process, port=0, profile=profile, log=log)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_SEC
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stop_chromium(chromium)
            raise BrowserError(f"chromium exited with status {process.returncode}")
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return dataclasses.replace(chromium, port=int(port_file.read_text().splitlines()[0]))
        time.sleep(0.05)
    stop_chromium(chromium)
    raise BrowserError(f"chromium wrote no DevTools port within {START_TIMEOUT_SEC:g} s")


def stop_chromium(chromium: Chromium) -> None:
    """SIGTERM Chromium by its PID, wait (bounded, SIGKILL if it hangs), remove its profile."""
    if chromium.process.poll() is None:
        chromium.process.terminate()
        try:
            chromium.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            chromium.process.kill()
            chromium.process.wait(timeout=30)
    shutil.rmtree(chromium.profile, ignore_errors=True)
    chromium.log.unlink(missing_ok=True)


class BrowserPage:
    """One tab, driven over its DevTools websocket; collects console errors as they come."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next_id = 0
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiters: dict[str, list[asyncio.Future[dict[str, Any]]]] = {}
        self.errors: list[str] = []
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for frame in self._ws:
            data = json.loads(frame.data)
            if "id" in data:
                reply = self._replies.pop(data["id"], None)
                if reply is not None and not reply.done():
                    reply.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            self._collect(method, params)
            for waiter in self._waiters.pop(method, []):
                if not waiter.done():
                    waiter.set_result(params)

    def _collect(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"uncaught exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params["type"] in (
            "error",
            "assert",
            "warning",
        ):
            args = " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            entry = params["entry"]
            self.errors.append(f"{entry['source']} {entry['level']}: {entry['text']}")

    async def close(self) -> None:
        """Stop reading the websocket."""
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (bounded by ``COMMAND_TIMEOUT_SEC``).

        Raises:
            BrowserError: If Chromium answers with an error.
        """
        self._next_id += 1
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[self._next_id] = reply
        await self._ws.send_json({"id": self._next_id, "method": method, "params": params})
        async with asyncio.timeout(COMMAND_TIMEOUT_SEC):
            data = await reply
        if "error" in data:
            raise BrowserError(f"{method} failed: {data['error']}")
        result: dict[str, Any] = data.get("result", {})
        return result

    def event(self, method: str) -> asyncio.Future[dict[str, Any]]:
        """A future resolved by the next event named ``method`` (register before causing it)."""
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(method, []).append(waiter)
        return waiter

    async def load(self, url: str) -> None:
        """Navigate to ``url`` and wait for its load event."""
        loaded = self.event("Page.loadEventFired")
        await self.send("Page.navigate", url=url)
        async with asyncio.timeout(COMMAND_TIMEOUT_SEC):
            await loaded

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page.

        Raises:
            BrowserError: If the expression throws.
        """
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, *, full_page: bool) -> bytes:
        """A PNG of the viewport, or of the whole page up to ``MAX_SCREENSHOT_HEIGHT``."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = await self.send("Page.getLayoutMetrics")
            height = min(metrics["cssContentSize"]["height"], MAX_SCREENSHOT_HEIGHT)
            params["captureBeyondViewport"] = True
            params["clip"] = {"x": 0, "y": 0, "width": VIEWPORT[0], "height": height, "scale": 1}
        result = await self.send("Page.captureScreenshot", **params)
        return base64.b64decode(result["data"])


@contextlib.asynccontextmanager
async def open_page(chromium: Chromium) -> AsyncIterator[BrowserPage]:
    """A new tab with the page, console and log events on and a fixed viewport; closed after."""
    base = f"http://127.0.0.1:{chromium.port}"
    async with aiohttp.ClientSession() as session:
        async with session.put(f"{base}/json/new?about:blank") as response:
            target = await response.json()
        try:
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tab = BrowserPage(ws)
                try:
                    for domain in ("Page", "Runtime", "Log"):
                        await tab.send(f"{domain}.enable")
                    await tab.send(
                        "Emulation.setDeviceMetricsOverride",
                        width=VIEWPORT[0],
                        height=VIEWPORT[1],
                        deviceScaleFactor=1,
                        mobile=False,
                    )
                    yield tab
                finally:
                    await tab.close()
        finally:
            async with session.get(f"{base}/json/close/{target['id']}") as response:
                await response.read()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ImageStats:
    """What a screenshot shows: its size, distinct colours, and the share not background."""

    width: int
    height: int
    colors: int
    foreground: float


def image_stats(png: bytes) -> ImageStats:
    """Decode a PNG and count its colours; the most common colour is the background."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    counts = image.getcolors(maxcolors=image.width * image.height) or []
    background = max(count for count, _ in counts)
    total = image.width * image.height
    return ImageStats(
        width=image.width,
        height=image.height,
        colors=len(counts),
        foreground=(total - background) / total,
    )
