"""The error hierarchy of ``rollout_client``.

Every error the client raises on its own account derives from :class:`RolloutClientError`.
Transport failures the client does not retry (or stops retrying) propagate as the
``aiohttp`` exception that described them; ``_transport.classify`` is the one place that
decides which of those are retried.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "UNAUTHORIZED_HINT",
    "RolloutAdmissionTimeoutError",
    "RolloutClientError",
    "RolloutNotFoundError",
    "RolloutProtocolError",
    "RolloutProtocolVersionError",
    "RolloutServersUnavailableError",
]

UNAUTHORIZED_HINT: Final = (
    " (unauthorized: pass the server's api_key to RolloutClient(api_key=...))"
)
"""What the message of a 401 from the rollout server adds: the fix."""


class RolloutClientError(Exception):
    """Base class of every error raised by ``rollout_client`` itself."""


class RolloutProtocolError(RolloutClientError, RuntimeError):
    """The server answered with a status or body the protocol does not allow here.

    ``status_code`` is the HTTP status of that answer: 200 or 202 when the body was the
    problem.
    """

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_protocol_error, (type(self), str(self), self.status_code))


def _rebuild_protocol_error(
    cls: type[RolloutProtocolError], message: str, status_code: int
) -> RolloutProtocolError:
    error = cls.__new__(cls)
    RolloutProtocolError.__init__(error, message, status_code=status_code)
    return error


class RolloutProtocolVersionError(RolloutProtocolError):
    """Client and server speak incompatible protocol versions; upgrade them together.

    ``client_version`` is this client's protocol version and ``server_version`` the one
    the server advertised (or a description of it, for servers that advertise none).
    """

    def __init__(
        self, message: str, *, status_code: int, client_version: str, server_version: str
    ) -> None:
        super().__init__(message, status_code=status_code)
        self.client_version = client_version
        self.server_version = server_version

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_version_error,
            (str(self), self.status_code, self.client_version, self.server_version),
        )


def _rebuild_version_error(
    message: str, status_code: int, client_version: str, server_version: str
) -> RolloutProtocolVersionError:
    return RolloutProtocolVersionError(
        message,
        status_code=status_code,
        client_version=client_version,
        server_version=server_version,
    )


class RolloutAdmissionTimeoutError(RolloutClientError, TimeoutError):
    """Admission did not finish within the client's ``admission_timeout_sec``.

    ``may_have_succeeded`` is true when the deadline fired while a ``POST /rollout`` was in
    flight: the server may have admitted the rollout, and will fail it as
    ``lease_expired`` (cancelling its work) once nobody polls it.
    """

    def __init__(self, message: str, *, rollout_id: str, may_have_succeeded: bool) -> None:
        super().__init__(message)
        self.rollout_id = rollout_id
        self.may_have_succeeded = may_have_succeeded

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_admission_error,
            (str(self), self.rollout_id, self.may_have_succeeded),
        )


def _rebuild_admission_error(
    message: str, rollout_id: str, may_have_succeeded: bool
) -> RolloutAdmissionTimeoutError:
    return RolloutAdmissionTimeoutError(
        message, rollout_id=rollout_id, may_have_succeeded=may_have_succeeded
    )


class RolloutServersUnavailableError(RolloutClientError, ConnectionError):
    """No server of a :class:`RolloutClientPool` can take a rollout.

    ``reasons`` maps each server's URL to why it cannot (unreachable, shutting down, failed
    its health probe, ...); ``shutting_down`` holds the URLs of those that are shutting down
    (a ``503`` "rollout server is shutting down" to an admission, or ``/health`` saying
    ``accepting_rollouts`` is false): they admit nothing more but still serve the results of
    the rollouts they run. ``rollout_id`` is the rollout that was being admitted.
    """

    def __init__(
        self,
        message: str,
        *,
        rollout_id: str,
        reasons: dict[str, str],
        shutting_down: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(message)
        self.rollout_id = rollout_id
        self.reasons = reasons
        self.shutting_down = shutting_down

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_unavailable_error,
            (str(self), self.rollout_id, self.reasons, self.shutting_down),
        )


def _rebuild_unavailable_error(
    message: str, rollout_id: str, reasons: dict[str, str], shutting_down: frozenset[str]
) -> RolloutServersUnavailableError:
    return RolloutServersUnavailableError(
        message, rollout_id=rollout_id, reasons=reasons, shutting_down=shutting_down
    )


class RolloutNotFoundError(RolloutClientError, LookupError):
    """A :class:`RolloutClientPool` does not know which server admitted this rollout id."""
