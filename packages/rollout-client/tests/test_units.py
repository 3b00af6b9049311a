"""Pure units: retry arithmetic, exception classification, errors, public API."""

from __future__ import annotations

import asyncio
import pickle

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey
from multidict import CIMultiDict

import rollout_client
from rollout_client import (
    RetrySettings,
    RolloutAdmissionTimeoutError,
    RolloutClientError,
    RolloutNotFoundError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
    RolloutServersUnavailableError,
)
from rollout_client._retry import next_delay, parse_retry_after, retry_fits_lease
from rollout_client._transport import TransportFailure, check_protocol_version, classify

EXPECTED_ALL = [
    "GroupRollout",
    "PoolServerStatus",
    "RetrySettings",
    "RolloutAdmissionTimeoutError",
    "RolloutClient",
    "RolloutClientError",
    "RolloutClientPool",
    "RolloutGroup",
    "RolloutGroupHandle",
    "RolloutHandle",
    "RolloutNotFoundError",
    "RolloutProtocolError",
    "RolloutProtocolVersionError",
    "RolloutServersUnavailableError",
    "__version__",
]

KEY = ConnectionKey("127.0.0.1", 1, False, True, None, None, None)


class TestPublicApi:
    def test_all_snapshot(self):
        """__all__ lists exactly the documented names, sorted."""
        assert rollout_client.__all__ == EXPECTED_ALL

    def test_names_resolve(self):
        """Every name in __all__ is importable."""
        for name in rollout_client.__all__:
            assert hasattr(rollout_client, name), name


class TestErrors:
    def test_hierarchy(self):
        """Each error is a RolloutClientError and the matching stdlib concept."""
        assert issubclass(RolloutProtocolError, RolloutClientError)
        assert issubclass(RolloutProtocolError, RuntimeError)
        assert issubclass(RolloutProtocolVersionError, RolloutProtocolError)
        assert issubclass(RolloutAdmissionTimeoutError, TimeoutError)
        assert issubclass(RolloutAdmissionTimeoutError, RolloutClientError)
        assert issubclass(RolloutServersUnavailableError, RolloutClientError)
        assert issubclass(RolloutServersUnavailableError, ConnectionError)
        assert issubclass(RolloutNotFoundError, RolloutClientError)
        assert issubclass(RolloutNotFoundError, LookupError)

    def test_pickle_round_trip(self):
        """Errors survive pickling with their attributes (process pools, logging)."""
        errors = [
            RolloutProtocolError("m", status_code=502),
            RolloutProtocolVersionError(
                "v", status_code=426, client_version="1.0", server_version="2.0"
            ),
            RolloutAdmissionTimeoutError("t", rollout_id="r", may_have_succeeded=True),
            RolloutServersUnavailableError(
                "u",
                rollout_id="r",
                reasons={"http://127.0.0.1:1": "refused", "http://127.0.0.1:2": "shutting down"},
                shutting_down=frozenset({"http://127.0.0.1:2"}),
            ),
            RolloutNotFoundError("n"),
        ]
        for error in errors:
            copy = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own objects
            assert type(copy) is type(error)
            assert vars(copy) == vars(error)
            assert str(copy) == str(error)


class TestRetryData:
    def test_schedules(self):
        """The schedules are the protocol's: 0.1/0.5 s and 0.25 s doubling to 8 s."""
        defaults = RetrySettings()
        assert defaults.transport_delays_sec == (0.1, 0.5)
        assert defaults.gateway_delays_sec == (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
        assert defaults.gateway_statuses == frozenset({502, 503, 504})

    def test_delay_exhaustion(self):
        """next_delay() gives each backoff, then None."""
        assert [next_delay((1.0, 2.0), i) for i in range(3)] == [1.0, 2.0, None]

    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            ("5", 5.0),
            (" 0.5 ", 0.5),
            ("1e1", 10.0),
            ("0.01", 0.05),
            ("61", 60.0),
            ("", 1.0),
            ("5_0", 1.0),
            ("infinity", 1.0),
            ("0x10", 1.0),
            ("Fri, 31 Dec 1999 23:59:59 GMT", 1.0),
        ],
    )
    def test_parse_retry_after(self, value, expected):
        """Retry-After is decimal seconds clamped to [0.05, 60]; anything else is 1 s."""
        assert parse_retry_after(CIMultiDict({"retry-after": value})) == expected

    def test_parse_retry_after_missing(self):
        """A missing Retry-After means 1 s."""
        assert parse_retry_after(CIMultiDict()) == 1.0

    @pytest.mark.parametrize(
        ("now", "delay", "fits"),
        [(0.0, 1.0, True), (0.0, 9.0, False), (8.9, 0.0, True), (9.0, 0.0, False)],
    )
    def test_lease_fit(self, now, delay, fits):
        """A retry fits only if now + delay + read timeout is strictly before the deadline."""
        assert (
            retry_fits_lease(now=now, delay_sec=delay, read_timeout_sec=1.0, lease_deadline=10.0)
            is fits
        )


def _os_error(cls: type[aiohttp.ClientOSError]) -> BaseException:
    return cls(KEY, OSError(111, "refused"))  # type: ignore[call-arg]


class TestClassify:
    @pytest.mark.parametrize(
        ("exc", "kind"),
        [
            (aiohttp.ServerDisconnectedError(), TransportFailure.RETRYABLE),
            (aiohttp.ClientPayloadError("cut"), TransportFailure.RETRYABLE),
            (aiohttp.ClientOSError(104, "reset"), TransportFailure.RETRYABLE),
            (aiohttp.ClientConnectionResetError("reset"), TransportFailure.RETRYABLE),
            (aiohttp.ClientConnectionError("Connection closed"), TransportFailure.RETRYABLE),
            (aiohttp.SocketTimeoutError("read"), TransportFailure.RETRYABLE),
            (ConnectionResetError(), TransportFailure.RETRYABLE),
            (aiohttp.ConnectionTimeoutError("connect"), TransportFailure.CONNECT_TIMEOUT),
            (aiohttp.ClientResponseError(None, (), status=400), TransportFailure.FATAL),  # type: ignore[arg-type]
            (aiohttp.InvalidURL("x"), TransportFailure.FATAL),
            (aiohttp.ServerFingerprintMismatch(b"a", b"b", "h", 1), TransportFailure.FATAL),
            (asyncio.CancelledError(), None),
            (TimeoutError(), None),
            (ValueError(), None),
            (
                RolloutProtocolVersionError(
                    "v", status_code=200, client_version="1", server_version="2"
                ),
                None,
            ),
        ],
    )
    def test_classify(self, exc, kind):
        """Each aiohttp exception maps to its documented failure class."""
        assert classify(exc) is kind

    def test_connector_errors(self):
        """A refused connection is retryable; TLS and proxy connection errors are fatal."""
        assert classify(_os_error(aiohttp.ClientConnectorError)) is TransportFailure.RETRYABLE
        assert classify(_os_error(aiohttp.ClientConnectorSSLError)) is TransportFailure.FATAL
        assert classify(_os_error(aiohttp.ClientProxyConnectionError)) is TransportFailure.FATAL


class TestVersionCheck:
    @pytest.mark.parametrize("header", [None, "1.0", "1.9", " 1.3 "])
    def test_compatible(self, header):
        """No header (osmosis peer) or the same major passes."""
        headers = (
            CIMultiDict() if header is None else CIMultiDict({"X-Rollout-Protocol-Version": header})
        )
        check_protocol_version(200, headers)

    @pytest.mark.parametrize("header", ["2.0", "0.4", "garbage", ""])
    def test_incompatible(self, header):
        """Another major, or an unparsable version, raises naming both versions."""
        headers = CIMultiDict({"X-Rollout-Protocol-Version": header})
        with pytest.raises(RolloutProtocolVersionError, match="upgrade the client") as e:
            check_protocol_version(200, headers)
        assert e.value.server_version == header.strip()
