"""Fixtures shared by tests/interop and tests/compat (imported into each conftest)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from .pairs import Pair
from .processes import DriverProcess, ServerProcess
from .standin import ChatStandIn

OpenClient = Callable[..., Awaitable[DriverProcess]]


@pytest.fixture
async def standin() -> AsyncIterator[ChatStandIn]:
    """The chat-completions stand-in, serving on 127.0.0.1 for this test."""
    stand_in = ChatStandIn()
    await stand_in.start()
    try:
        yield stand_in
    finally:
        await stand_in.close()


@pytest.fixture
async def open_client() -> AsyncIterator[OpenClient]:
    """``await open_client(pair, url, **options)``: a client driver, closed after the test."""
    opened: list[DriverProcess] = []

    async def open_(pair: Pair, url: str, **options: Any) -> DriverProcess:
        driver = await pair.open_client(url, **options)
        opened.append(driver)
        return driver

    try:
        yield open_
    finally:
        for driver in opened:
            await driver.close()


@pytest.fixture
def own_server() -> Iterator[list[ServerProcess]]:
    """Servers a single test starts itself (append them); stopped after it by their PID."""
    started: list[ServerProcess] = []
    try:
        yield started
    finally:
        for process in started:
            process.stop()
