"""Wire models of the rollout protocol, shared by ``rollout-client`` and ``rollout-server``.

The models are frozen attrs classes; :data:`converter` is the one cattrs converter that
turns them into, and back from, the JSON documents an osmosis-ai 0.3.8 peer exchanges.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._arguments import check_api_key, check_seconds
from ._constants import (
    DEFAULT_POLLING_LEASE_TIMEOUT_SEC,
    DEFAULT_RESULT_RETENTION_SEC,
    DEFAULT_RESULT_WAIT_TIMEOUT_SEC,
    LEASE_HEADER,
    OSMOSIS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_HEADER,
    TURNS_PROTOCOL_VERSION,
    protocol_compatible,
    protocol_supports,
)
from ._converter import (
    REDACTED,
    converter,
    dumps,
    is_secret_key,
    loads,
    redact,
    structure_wire,
)
from ._enums import (
    TERMINAL_STATUSES,
    CancelDisposition,
    RolloutErrorCategory,
    RolloutStatus,
    TurnFlag,
    is_terminal,
)
from ._errors import FieldValueError, RolloutTypesError, WireValidationError
from ._models import (
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    RolloutHealth,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutLifecycle,
    RolloutResultResponse,
    RolloutSample,
    RolloutTurn,
    is_single_path_segment,
)

try:
    __version__ = version("rollout-types")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "DEFAULT_POLLING_LEASE_TIMEOUT_SEC",
    "DEFAULT_RESULT_RETENTION_SEC",
    "DEFAULT_RESULT_WAIT_TIMEOUT_SEC",
    "LEASE_HEADER",
    "OSMOSIS_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSION_HEADER",
    "REDACTED",
    "TERMINAL_STATUSES",
    "TURNS_PROTOCOL_VERSION",
    "CancelDisposition",
    "CancelRolloutsRequest",
    "CancelRolloutsResponse",
    "FieldValueError",
    "RolloutErrorCategory",
    "RolloutHealth",
    "RolloutInitRequest",
    "RolloutInitResponse",
    "RolloutLifecycle",
    "RolloutResultResponse",
    "RolloutSample",
    "RolloutStatus",
    "RolloutTurn",
    "RolloutTypesError",
    "TurnFlag",
    "WireValidationError",
    "__version__",
    "check_api_key",
    "check_seconds",
    "converter",
    "dumps",
    "is_secret_key",
    "is_single_path_segment",
    "is_terminal",
    "loads",
    "protocol_compatible",
    "protocol_supports",
    "redact",
    "structure_wire",
]
