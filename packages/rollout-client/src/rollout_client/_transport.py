"""HTTP plumbing of the client: the session, URLs, headers, one exchange, and the single
place where ``aiohttp`` exceptions are classified.

Failure classes (the httpx names of osmosis-ai's documentation on the left):

=====================================  ====================================================
documented failure                     aiohttp exceptions classified into it
=====================================  ====================================================
``RemoteProtocolError`` (retried)      ``ServerDisconnectedError``, ``ClientPayloadError``
``NetworkError`` (retried)             ``ClientOSError`` (``ClientConnectorError``: refused,
                                       unreachable, DNS), ``ClientConnectionResetError``,
                                       bare ``ClientConnectionError`` ("Connection
                                       closed"), ``OSError`` from the socket
``ReadTimeout`` (retried)              ``SocketTimeoutError`` (``sock_read`` expired)
connect / pool timeout (fatal)         ``ConnectionTimeoutError`` (``sock_connect`` or the
                                       pool wait plus connect, ``connect``, expired)
TLS, proxy, other client errors        ``ClientSSLError``, ``ServerFingerprintMismatch``,
(fatal)                                ``ClientProxyConnectionError``,
                                       ``ClientHttpProxyError``, ``InvalidURL``, any other
                                       ``ClientError``
=====================================  ====================================================

``TransportFailure.RETRYABLE`` is what a result poll retries; ``wait_idle()`` waits out
every transport failure (all three kinds).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import quote

import aiohttp
import attrs
from yarl import URL

from rollout_types import (
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_HEADER,
    WireValidationError,
    loads,
    protocol_compatible,
)

from ._aiohttp_private import disable_idempotent_replay
from ._errors import RolloutProtocolVersionError
from ._version import USER_AGENT

__all__ = [
    "CONNECTOR_KEEPALIVE_SEC",
    "HttpResponse",
    "Transport",
    "TransportFailure",
    "check_protocol_version",
    "classify",
    "make_session",
]

CONNECTOR_KEEPALIVE_SEC: Final = 30.0
"""How long an idle pooled connection of a client-owned session is kept, seconds."""

_DETAIL_LIMIT: Final = 300
"""Longest ``detail`` text quoted in an error message, characters."""


class TransportFailure(enum.Enum):
    """How a failed HTTP exchange is treated."""

    RETRYABLE = "retryable"
    """Connection dropped, reset or refused, payload broken, read timed out."""
    CONNECT_TIMEOUT = "connect_timeout"
    """Opening a connection (pool wait included) timed out: never retried on polls."""
    FATAL = "fatal"
    """TLS, proxy, URL or other client errors: never retried on polls."""


def classify(exc: BaseException) -> TransportFailure | None:
    """Classify an exception raised by an aiohttp exchange.

    This is the only place the client decides what an aiohttp exception means.

    Args:
        exc: The exception.

    Returns:
        Its :class:`TransportFailure`, or None when it is not a transport failure at all
        (``asyncio.CancelledError``, the client's own errors, programming errors).
    """
    if isinstance(exc, asyncio.CancelledError | RolloutProtocolVersionError):
        return None
    if isinstance(exc, aiohttp.ServerTimeoutError):
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return TransportFailure.CONNECT_TIMEOUT
        return TransportFailure.RETRYABLE
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
        return None  # a deadline of the caller's or ours, not a transport failure
    if isinstance(
        exc,
        aiohttp.ClientSSLError
        | aiohttp.ServerFingerprintMismatch
        | aiohttp.ClientProxyConnectionError,
    ):
        return TransportFailure.FATAL
    if isinstance(
        exc,
        aiohttp.ServerDisconnectedError
        | aiohttp.ClientPayloadError
        | aiohttp.ClientOSError
        | aiohttp.ClientConnectionResetError,
    ):
        return TransportFailure.RETRYABLE
    if type(exc) is aiohttp.ClientConnectionError:
        return TransportFailure.RETRYABLE
    if isinstance(exc, aiohttp.ClientError):
        return TransportFailure.FATAL
    if isinstance(exc, OSError):
        return TransportFailure.RETRYABLE
    return None


# Speed: benchmarks/README.md, "Client", row "One session for every request of a client ..."
# Speed: benchmarks/README.md, "Client", row "Lean request headers ..."
def make_session() -> aiohttp.ClientSession:
    """Create the session a :class:`RolloutClient` owns when the caller passes none.

    The connector has no connection limit (``limit=0``, ``limit_per_host=0``): every
    rollout keeps one long poll outstanding, and HTTP/1.1 carries one request per
    connection, so N concurrent rollouts need N connections. A bounded pool (aiohttp's
    default is 100) would make polls queue for a connection and miss their lease. The real
    bounds are the process's file-descriptor limit and the per-request timeouts.

    A caller-owned session keeps aiohttp's own behaviour of replaying an idempotent request
    (the result poll) once, immediately, when its connection drops.

    Requests carry ``User-Agent: rollout-client/<version>`` and neither ``Accept`` nor
    ``Accept-Encoding`` (the protocol's bodies are small JSON, never compressed): a server
    keeps every header of each waiting long poll, about 0.3 KiB per header per rollout
    in flight.
    """
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, keepalive_timeout=CONNECTOR_KEEPALIVE_SEC
    )
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        trust_env=False,
        headers={"User-Agent": USER_AGENT},
        skip_auto_headers=("Accept", "Accept-Encoding"),
    )
    # The result poll has its own documented schedule (0.1 s, 0.5 s): no silent replay.
    disable_idempotent_replay(session)
    return session


@attrs.frozen(kw_only=True)
class HttpResponse:
    """One HTTP answer, its body read in full."""

    status: int
    headers: Mapping[str, str]
    """Case-insensitive (aiohttp's ``CIMultiDictProxy``)."""
    body: bytes

    def detail_suffix(self) -> str:
        """A short, secret-free summary of the body's ``detail``: ``": <text>"`` or ``""``.

        A string ``detail`` is quoted; a 422 list gives ``loc: msg`` per entry (never the
        ``input``, which may hold secrets); the text is cut at 300 characters.
        """
        try:
            detail = loads(self.body).get("detail")
        except (WireValidationError, AttributeError):
            return ""
        if isinstance(detail, str):
            text = detail
        elif isinstance(detail, list):
            parts = []
            for entry in detail:
                if isinstance(entry, dict):
                    loc = ".".join(str(p) for p in entry.get("loc", ()))
                    parts.append(f"{loc}: {entry.get('msg', '')}")
            text = "; ".join(parts)
        else:
            return ""
        if len(text) > _DETAIL_LIMIT:
            text = text[:_DETAIL_LIMIT] + "..."
        return f": {text}" if text else ""


def _encoded_base(url: str) -> URL:
    given: object = url
    if not isinstance(given, str) or not url.strip():
        raise ValueError(f"url must be a non-empty http(s) URL string; got {url!r}")
    base = URL(url.strip())
    if base.scheme not in ("http", "https") or not base.host:
        raise ValueError(
            f"url must be an absolute http:// or https:// URL such as "
            f"'http://127.0.0.1:8000'; got {url!r}"
        )
    if base.query_string or base.fragment:
        raise ValueError(f"url must not carry a query or fragment; got {url!r}")
    return base


class Transport:
    """Sends the client's requests: base URL, default headers, no redirects, one read."""

    def __init__(
        self, *, url: str, api_key: str | None, session: aiohttp.ClientSession | None
    ) -> None:
        base = _encoded_base(url)
        self.base_url = base
        self._base_path = base.raw_path.rstrip("/")
        headers = {PROTOCOL_VERSION_HEADER: PROTOCOL_VERSION}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers: Mapping[str, str] = headers
        self._session = session
        self.owns_session = session is None

    def url(self, *segments: str) -> URL:
        """The URL of ``base/<segment>/...``; each segment is percent-encoded."""
        path = "/".join(quote(segment, safe="") for segment in segments)
        return self.base_url.with_path(f"{self._base_path}/{path}", encoded=True)

    def session(self) -> aiohttp.ClientSession:
        """The session, creating the owned one on first use (inside the running loop)."""
        if self._session is None:
            self._session = make_session()
        return self._session

    async def aclose(self) -> None:
        """Close the session if this transport created it."""
        if self.owns_session and self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def send(
        self,
        method: str,
        url: URL,
        *,
        timeout: aiohttp.ClientTimeout,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> HttpResponse:
        """Send one request and read its whole answer; never follow a redirect.

        Raises:
            RolloutProtocolVersionError: The answer advertises an incompatible protocol.
            aiohttp.ClientError: Transport failures, as aiohttp raised them.
        """
        request_headers: dict[str, str] = dict(self._headers)
        if body is not None:
            request_headers["Content-Type"] = "application/json"
        if headers:
            request_headers.update(headers)
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["data"] = body
        async with self.session().request(
            method,
            url,
            headers=request_headers,
            allow_redirects=False,
            timeout=timeout,
            **kwargs,
        ) as response:
            check_protocol_version(response.status, response.headers)
            payload = await response.read()
        if response.status == 426:
            raise _upgrade_required(response.headers, payload)
        return HttpResponse(status=response.status, headers=response.headers, body=payload)


def check_protocol_version(status: int, headers: Mapping[str, str]) -> None:
    """Raise when an answer advertises a protocol version incompatible with ours.

    An answer without the header comes from an osmosis-ai server (or a proxy), which
    speaks the osmosis pull protocol this client implements.

    Raises:
        RolloutProtocolVersionError: Naming both versions.
    """
    theirs = headers.get(PROTOCOL_VERSION_HEADER)
    if theirs is None or protocol_compatible(PROTOCOL_VERSION, theirs):
        return
    raise RolloutProtocolVersionError(
        f"the rollout server speaks rollout protocol {theirs.strip()!r} but this client "
        f"speaks {PROTOCOL_VERSION!r}; upgrade the client (rollout-client) and the server "
        "(rollout-server) together so that their protocol major versions match",
        status_code=status,
        client_version=PROTOCOL_VERSION,
        server_version=theirs.strip(),
    )


def _upgrade_required(headers: Mapping[str, str], body: bytes) -> RolloutProtocolVersionError:
    """The error for a 426 whose version header did not already explain it."""
    theirs = (headers.get(PROTOCOL_VERSION_HEADER) or "unknown").strip()
    try:
        detail = loads(body).get("detail")
    except (WireValidationError, AttributeError):
        detail = None
    said = f" (it said: {detail})" if isinstance(detail, str) and detail else ""
    return RolloutProtocolVersionError(
        f"the rollout server refused this client's rollout protocol {PROTOCOL_VERSION!r} "
        f"with 426 Upgrade Required{said}; the server speaks {theirs!r}; upgrade the client "
        "(rollout-client) and the server (rollout-server) together",
        status_code=426,
        client_version=PROTOCOL_VERSION,
        server_version=theirs,
    )
