"""``ServerSettings``: every tunable of a rollout server, defined, defaulted and validated once.

:func:`~rollout_server.create_rollout_server`, :class:`~rollout_server.RolloutServer` and the
``rollout-server serve`` options all read these fields; their keyword arguments build a
settings object with :func:`resolve_settings`. What a server is given rather than tuned (the
backend, the API key, the tracer provider) is not a setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import attrs

from rollout_types import (
    DEFAULT_POLLING_LEASE_TIMEOUT_SEC,
    DEFAULT_RESULT_RETENTION_SEC,
    DEFAULT_RESULT_WAIT_TIMEOUT_SEC,
    check_seconds,
)

from .._errors import ServerConfigError
from ..state._store import MEMORY, parse_state_url
from ..state._waiting import DEFAULT_STATUS_CHANGE_GRACE_SEC
from ._shutdown import ShutdownTimeouts

__all__ = [
    "DEFAULT_BODY_READ_TIMEOUT_SEC",
    "DEFAULT_HEADER_READ_TIMEOUT_SEC",
    "DEFAULT_KEEPALIVE_TIMEOUT_SEC",
    "DEFAULT_MAX_BODY_BYTES",
    "ServerSettings",
    "field_default",
    "resolve_settings",
]

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""Default limit on a request body, in bytes (64 MiB; aiohttp's own default is 1 MiB)."""

DEFAULT_KEEPALIVE_TIMEOUT_SEC: Final = 2160.0
"""Default HTTP keep-alive, in seconds: longer than common load-balancer idle timeouts
(2100 s and less), so a gateway never reuses a connection the server is closing."""

DEFAULT_HEADER_READ_TIMEOUT_SEC: Final = 30.0
"""Default bound, in seconds, on receiving a request's headers once its first bytes have
arrived (an idle keep-alive connection is not timed)."""

DEFAULT_BODY_READ_TIMEOUT_SEC: Final = 60.0
"""Default bound, in seconds, on receiving a request body once its headers have arrived
(64 MiB, the default body limit, at about 1.1 MB/s)."""


def _positive_seconds(_inst: object, attribute: attrs.Attribute[float], value: object) -> None:
    check_seconds(attribute.name, value, error=ServerConfigError)


def _non_negative_seconds(_inst: object, attribute: attrs.Attribute[float], value: object) -> None:
    check_seconds(attribute.name, value, allow_zero=True, error=ServerConfigError)


def _longer_than_the_wait(
    inst: ServerSettings, attribute: attrs.Attribute[float], value: float
) -> None:
    check_seconds(attribute.name, value, error=ServerConfigError)
    wait = inst.result_wait_timeout_sec
    if not value > wait:
        raise ServerConfigError(
            f"polling_lease_timeout_sec ({float(value)}) must be greater than "
            f"result_wait_timeout_sec ({float(wait)}), so a client that re-polls promptly "
            "never loses its lease"
        )


def _positive_int(_inst: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ServerConfigError(f"{attribute.name} must be a positive int; got {value!r}")


def _endpoints(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise TypeError(
            f"model_endpoints must be a list or tuple of URLs; got {type(value).__name__}"
        )
    return tuple(value)


def _endpoint_urls(
    _inst: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    for url in value:
        given: object = url
        if not isinstance(given, str) or urlsplit(url).scheme not in ("http", "https"):
            raise ServerConfigError(
                f"{attribute.name}: {url!r} is not an http(s) URL (for example "
                "http://127.0.0.1:8000/v1)"
            )
    stripped = [url.rstrip("/") for url in value]
    if len(set(stripped)) != len(stripped):
        raise ServerConfigError(f"{attribute.name}: duplicate model endpoints in {list(value)!r}")


def _stage_bounds(
    _inst: object, attribute: attrs.Attribute[ShutdownTimeouts], value: object
) -> None:
    if not isinstance(value, ShutdownTimeouts):
        raise TypeError(f"{attribute.name} must be a ShutdownTimeouts; got {type(value).__name__}")


def _state_url(value: object) -> str:
    """A ``state`` URL, validated and normalised (``sqlite:///ABS/PATH`` or ``memory:``)."""
    return parse_state_url(value).url


@attrs.frozen(kw_only=True)
class ServerSettings:
    """How a rollout server behaves: its protocol timings, HTTP limits, logging, metrics and
    the bounds of its staged shutdown. Every field has a default; change one with
    ``attrs.evolve(settings, name=value)``.

    Attributes:
        result_wait_timeout_sec: Long-poll wait of ``GET /rollout/{id}/result``, seconds;
            finite and > 0; default 30.0.
        polling_lease_timeout_sec: Seconds without a poll before a rollout fails as
            ``lease_expired``; finite, > 0 and > ``result_wait_timeout_sec``; default 120.0.
        result_retention_sec: Seconds a published result stays collectable (and its id
            reserved) once its execution has finished; finite and >= 0; default 900.0.
        max_body_bytes: Largest accepted request body in bytes (larger ones get 413); a
            positive int; default 64 MiB (67108864).
        keepalive_timeout_sec: HTTP keep-alive of idle connections, seconds; finite and
            > 0; default 2160.0.
        header_read_timeout_sec: Once the first bytes of a request arrive, its headers must
            be complete within this many seconds, or the connection is closed (an idle
            keep-alive connection is not timed); finite and > 0; default 30.0.
        body_read_timeout_sec: Once a request's headers arrive, its body must be complete
            within this many seconds, or the request gets 408 and the connection is
            closed; finite and > 0; default 60.0.
        status_change_grace_sec: After a non-terminal status change, how long a waiting
            long poll goes on waiting for the result before it answers the change, seconds
            (put off while the event loop is saturated; see
            :func:`~rollout_server.create_rollout_server`). 0 answers every change at once.
            Finite and >= 0; default 1.0.
        access_log: Whether to log one line per request to ``rollout_server.access``;
            default False.
        metrics: Whether to serve Prometheus metrics at ``GET /metrics``; default True.
        shutdown_timeouts: Bounds of the staged shutdown, seconds each; default
            :class:`ShutdownTimeouts()` (10, 120, 10, 30 and 5).
        gateway: Whether to run a model gateway (a :class:`~rollout_server.ModelGateway`
            that :func:`~rollout_server.create_rollout_server` builds): each rollout's
            workflow gets its own base URL, and its model calls are captured as turns;
            default False.
        model_endpoints: Model endpoints' base URLs (http or https, no duplicates) the
            gateway spreads rollouts over by consistent hashing on their group; a non-empty
            tuple implies ``gateway``. Default ``()``: each rollout's calls go to its
            request's ``chat_completions_url``.
        state: Where admissions and results are kept so that a restart loses nothing:
            ``"memory:"`` (default: nothing survives the process) or
            ``"sqlite:///ABS/PATH.db"`` (see :func:`~rollout_server.create_rollout_server`);
            kept normalised. A URL of another form is refused
            (:class:`~rollout_server.ServerConfigError`).

    Raises:
        ServerConfigError: (a ``ValueError``) If a value is out of range, naming the field.
        TypeError: If ``shutdown_timeouts`` is not a :class:`ShutdownTimeouts`, or
            ``model_endpoints`` not a list or tuple.

    .. versionadded:: 0.3
    """

    result_wait_timeout_sec: float = attrs.field(
        default=DEFAULT_RESULT_WAIT_TIMEOUT_SEC, validator=_positive_seconds
    )
    polling_lease_timeout_sec: float = attrs.field(
        default=DEFAULT_POLLING_LEASE_TIMEOUT_SEC, validator=_longer_than_the_wait
    )
    result_retention_sec: float = attrs.field(
        default=DEFAULT_RESULT_RETENTION_SEC, validator=_non_negative_seconds
    )
    max_body_bytes: int = attrs.field(default=DEFAULT_MAX_BODY_BYTES, validator=_positive_int)
    keepalive_timeout_sec: float = attrs.field(
        default=DEFAULT_KEEPALIVE_TIMEOUT_SEC, validator=_positive_seconds
    )
    header_read_timeout_sec: float = attrs.field(
        default=DEFAULT_HEADER_READ_TIMEOUT_SEC, validator=_positive_seconds
    )
    body_read_timeout_sec: float = attrs.field(
        default=DEFAULT_BODY_READ_TIMEOUT_SEC, validator=_positive_seconds
    )
    status_change_grace_sec: float = attrs.field(
        default=DEFAULT_STATUS_CHANGE_GRACE_SEC, validator=_non_negative_seconds
    )
    access_log: bool = attrs.field(default=False, converter=bool)
    metrics: bool = attrs.field(default=True, converter=bool)
    shutdown_timeouts: ShutdownTimeouts = attrs.field(
        factory=ShutdownTimeouts, validator=_stage_bounds
    )
    gateway: bool = attrs.field(default=False, converter=bool)
    model_endpoints: tuple[str, ...] = attrs.field(
        default=(), converter=_endpoints, validator=_endpoint_urls
    )
    state: str = attrs.field(default=MEMORY, converter=_state_url)

    def __attrs_post_init__(self) -> None:
        # Once validated, durations are floats, as the app factory always made them: the
        # wait and the lease travel in every admission answer (30.0, never 30).
        for field in attrs.fields(ServerSettings):
            if field.name.endswith("_sec"):
                object.__setattr__(self, field.name, float(getattr(self, field.name)))


def field_default(name: str) -> Any:
    """The default of the :class:`ServerSettings` field ``name``."""
    return getattr(ServerSettings(), name)


def resolve_settings(
    settings: ServerSettings | None, keywords: Mapping[str, object]
) -> ServerSettings:
    """The settings a constructor that takes both ``settings=`` and one keyword per field
    was given.

    Args:
        settings: The ``settings=`` argument, or None.
        keywords: The per-field keyword arguments, by field name. None, or the field's
            default, means "not given".

    Returns:
        ``settings`` when given (then no keyword may be given), else settings built from
        the keywords given.

    Raises:
        ServerConfigError: If ``settings`` and a keyword are both given, or a keyword is out
            of range.
        TypeError: If ``shutdown_timeouts`` is not a :class:`ShutdownTimeouts`.
    """
    given = {name: value for name, value in keywords.items() if value is not None}
    if settings is None:
        return ServerSettings(**given)  # type: ignore[arg-type]
    if not isinstance(settings, ServerSettings):
        raise TypeError(f"settings must be a ServerSettings; got {type(settings).__name__}")
    clashing = [name for name, value in given.items() if value != field_default(name)]
    if clashing:
        raise ServerConfigError(
            f"{', '.join(clashing)} and settings= both given; pass one of them (for "
            f"example attrs.evolve(settings, {clashing[0]}=...))"
        )
    return settings
