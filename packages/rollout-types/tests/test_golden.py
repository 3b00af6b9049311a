"""Golden payloads captured from live osmosis-ai peers (``tools/capture_golden.py``).

Every captured request and response body must structure into our wire model and
unstructure back to an equivalent document; every captured 422 must be reproduced by our
own validation with the same ``type`` and ``loc`` (our ``input`` may be redacted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout_types import (
    LEASE_HEADER,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    RolloutErrorCategory,
    RolloutHealth,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutResultResponse,
    RolloutStatus,
    WireValidationError,
    converter,
    dumps,
    loads,
    structure_wire,
)

GOLDEN = Path(__file__).parent / "data" / "golden"
CURRENT = GOLDEN / "osmosis-0.3.8"
LEGACY = GOLDEN / "osmosis-0.3.2"

# File-name prefix -> the model that file holds (longest prefix first).
MODELS: list[tuple[str, type[Any]]] = [
    ("init_request_", RolloutInitRequest),
    ("init_response", RolloutInitResponse),
    ("result_poll_request_headers", type(None)),  # headers only: checked separately
    ("result_", RolloutResultResponse),
    ("cancel_request_", CancelRolloutsRequest),
    ("cancel_response", CancelRolloutsResponse),
    ("health", RolloutHealth),
]


def _model_for(name: str) -> type[Any] | None:
    for prefix, model in MODELS:
        if name.startswith(prefix):
            return model
    return None


def _documents(folder: Path) -> list[tuple[str, type[Any]]]:
    found = []
    for path in sorted(folder.glob("*.json")):
        model = _model_for(path.name)
        if model is not None and model is not type(None):
            found.append((path.name, model))
    return found


def _index(folder: Path) -> dict[str, Any]:
    index: dict[str, Any] = json.loads((folder / "index.json").read_text())
    return index


def _load(folder: Path, name: str) -> Any:
    return loads((folder / name).read_bytes())


def _assert_equivalent(original: Any, emitted: Any, model: type[Any], path: str = "$") -> None:
    """``emitted`` equals ``original`` key by key; keys the original left out carry defaults.

    A key missing from the original must come back as the model's default (null, false,
    ``{}`` or ``[]``), which is exactly what an osmosis peer assumes for a missing key.
    """
    if isinstance(original, dict) and isinstance(emitted, dict):
        for key, value in original.items():
            if key in emitted:
                _assert_equivalent(value, emitted[key], model, f"{path}.{key}")
            else:
                # Unknown keys (a peer of another version) are ignored on input.
                assert key not in {a.name for a in model.__attrs_attrs__}, f"{path}.{key} lost"
        for key in emitted.keys() - original.keys():
            assert emitted[key] in (None, False, {}, [], True), (
                f"{path}.{key} is {emitted[key]!r}, not a default"
            )
    else:
        assert emitted == original, f"{path}: {emitted!r} != {original!r}"


class TestGoldenDocuments:
    @pytest.mark.parametrize(("name", "model"), _documents(CURRENT))
    def test_osmosis_038_round_trip(self, name: str, model: type[Any]) -> None:
        """Each 0.3.8 body structures and unstructures back to an equivalent document."""
        original = _load(CURRENT, name)
        obj = structure_wire(original, model)
        emitted = json.loads(dumps(obj))
        _assert_equivalent(original, emitted, model)
        # Structuring what we emit gives the same object again.
        assert structure_wire(emitted, model) == obj

    def test_every_038_body_is_covered(self) -> None:
        """No captured 0.3.8 body is left without a model or an error check."""
        names = {p.name for p in CURRENT.glob("*") if p.name != "index.json"}
        modelled = {name for name, _ in _documents(CURRENT)}
        checked = {n for n in names if n.startswith("error_")} | {
            "result_poll_request_headers.json"
        }
        assert names == modelled | checked

    def test_result_bodies_use_known_enums(self) -> None:
        """Captured results parse into our enums, not forward-compatible raw strings."""
        for name, model in _documents(CURRENT):
            if model is RolloutResultResponse:
                result = structure_wire(_load(CURRENT, name), RolloutResultResponse)
                assert isinstance(result.status, RolloutStatus), name
                category = result.err_category
                assert category is None or isinstance(category, RolloutErrorCategory), name

    def test_legacy_callback_request_is_ignored_extras(self) -> None:
        """The 0.3.2 caller's body structures; its callback fields are unknown keys."""
        original = _load(LEGACY, "init_request_callback_protocol.json")
        assert "completion_callback_url" in original
        request = structure_wire(original, RolloutInitRequest)
        assert request.rollout_id == original["rollout_id"]
        assert "completion_callback_url" not in converter.unstructure(request)

    def test_lease_header_name_matches_capture(self) -> None:
        """The lease header osmosis sends is ours, compared case-insensitively."""
        captured = _load(CURRENT, "result_poll_request_headers.json")["headers"]
        assert LEASE_HEADER.lower() in captured


def _error_cases() -> list[tuple[str, Any, type[Any]]]:
    index = _index(CURRENT)
    cases = []
    for name, meta in index.items():
        if not name.startswith("error_422") or "request_body" not in meta:
            continue
        if name == "error_422_text_plain.json":
            continue  # a Content-Type rule of the server route, not of the body model
        model = CancelRolloutsRequest if meta["path"] == "/rollout/cancel" else RolloutInitRequest
        cases.append((name, meta["request_body"], model))
    return cases


class TestGolden422:
    @pytest.mark.parametrize(("name", "body", "model"), _error_cases())
    def test_validation_matches_osmosis(self, name: str, body: Any, model: type[Any]) -> None:
        """Our validation of the captured input gives osmosis's 422 types and locs."""
        expected = _load(CURRENT, name)["detail"]
        if isinstance(expected, str):
            # The cancel selector rule: a string detail, enforced by the server route.
            request = structure_wire(body, model)
            active = sum([request.ids is not None, request.prefix is not None, request.all is True])
            assert active != 1
            return
        if isinstance(body, str):
            with pytest.raises(WireValidationError) as info:
                loads(body)
        else:
            with pytest.raises(WireValidationError) as info:
                structure_wire(body, model)
        ours = {(e["type"], tuple(e["loc"])) for e in info.value.errors}
        theirs = {(e["type"], tuple(e["loc"])) for e in expected}
        assert ours == theirs
        for entry in info.value.errors:
            assert "golden-llm-api-key" not in json.dumps(entry)
