"""A (client side, server side) pair of peers, and how to reach each side."""

from __future__ import annotations

from typing import Any, Final

import attrs

from .peers import OSMOSIS, OSMOSIS_032, OURS_CLIENT, OURS_SERVER, python_of
from .processes import DriverProcess, ServerProcess
from .servers import osmosis_server, our_server

DRIVERS: Final = {
    OURS_CLIENT: "driver_ours.py",
    OSMOSIS: "driver_osmosis.py",
    OSMOSIS_032: "driver_osmosis032.py",
}


@attrs.frozen(kw_only=True)
class Pair:
    """A client side and a server side, each one of the peers of :mod:`.peers`.

    Attributes:
        client: ``OURS_CLIENT``, ``OSMOSIS`` or ``OSMOSIS_032``.
        server: ``OURS_SERVER``, ``OSMOSIS`` or ``OSMOSIS_032``.
        client_python: The client side's interpreter; default from :func:`python_of`.
        server_python: The server side's interpreter; default from :func:`python_of`.
    """

    client: str
    server: str
    client_python: str | None = None
    server_python: str | None = None

    @property
    def name(self) -> str:
        """``CLIENT_to_SERVER``, the pytest id."""
        return f"{self.client}_to_{self.server}"

    def make_server(self, *, env: dict[str, str] | None = None, **options: Any) -> ServerProcess:
        """The server side's server (not started), with scenario ``options`` and ``env``."""
        python = self.server_python or python_of(self.server)
        if self.server == OURS_SERVER:
            return our_server(python, env=env, **options)
        if self.server == OSMOSIS_032:
            options.update(wait_sec=None, lease_sec=None)
        return osmosis_server(python, env=env, **options)

    async def open_client(
        self, url: str, *, env: dict[str, str] | None = None, **options: Any
    ) -> DriverProcess:
        """Start the client side's driver (with extra ``env``) and open a client on ``url``."""
        driver = await DriverProcess(
            self.client_python or python_of(self.client), DRIVERS[self.client], env=env
        ).start()
        try:
            await driver.call("open", url=url, **options)
        except BaseException:
            await driver.close()
            raise
        return driver
