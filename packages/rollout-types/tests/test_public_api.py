"""The public names of rollout_types, as a snapshot: changing them is a deliberate act."""

from __future__ import annotations

import rollout_types

EXPECTED = [
    "DEFAULT_POLLING_LEASE_TIMEOUT_SEC", "DEFAULT_RESULT_RETENTION_SEC",
    "DEFAULT_RESULT_WAIT_TIMEOUT_SEC", "LEASE_HEADER", "OSMOSIS_PROTOCOL_VERSION",
    "PROTOCOL_VERSION", "PROTOCOL_VERSION_HEADER", "REDACTED", "TERMINAL_STATUSES",
    "TURNS_PROTOCOL_VERSION", "CancelDisposition", "CancelRolloutsRequest",
    "CancelRolloutsResponse", "FieldValueError",
    "RolloutErrorCategory", "RolloutHealth", "RolloutInitRequest", "RolloutInitResponse",
    "RolloutLifecycle", "RolloutResultResponse", "RolloutSample", "RolloutStatus",
    "RolloutTurn", "RolloutTypesError", "TurnFlag", "WireValidationError", "__version__",
    "check_api_key", "check_seconds",
    "converter", "dumps", "is_secret_key", "is_single_path_segment", "is_terminal", "loads",
    "protocol_compatible", "protocol_supports", "redact", "structure_wire",
]  # fmt: skip


class TestPublicApi:
    def test_all_snapshot(self) -> None:
        """__all__ lists exactly the documented names, sorted."""
        assert rollout_types.__all__ == EXPECTED
        # isort-style order, as ruff's RUF022 keeps it: CONSTANTS, Classes, functions.
        kind = {True: 0, False: 1}
        assert (
            sorted(
                rollout_types.__all__, key=lambda n: (kind[n.isupper()] if n[0].isupper() else 2, n)
            )
            == rollout_types.__all__
        )

    def test_names_resolve(self) -> None:
        """Every name in __all__ is importable."""
        for name in rollout_types.__all__:
            assert hasattr(rollout_types, name), name

    def test_constants(self) -> None:
        """The protocol constants have the osmosis values."""
        assert rollout_types.LEASE_HEADER == "X-Osmosis-Rollout-Lease"
        assert rollout_types.DEFAULT_RESULT_WAIT_TIMEOUT_SEC == 30.0
        assert rollout_types.DEFAULT_POLLING_LEASE_TIMEOUT_SEC == 120.0
        assert rollout_types.DEFAULT_RESULT_RETENTION_SEC == 900.0

    def test_protocol_compatibility(self) -> None:
        """Same major versions interoperate; different or unparsable ones do not."""
        assert rollout_types.protocol_compatible("1.0", "1.7")
        assert not rollout_types.protocol_compatible("1.0", "2.0")
        assert not rollout_types.protocol_compatible("1.0", "garbage")
