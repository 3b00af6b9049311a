"""``POST /rollout``: validation, the 400/503/429/409 order, the 202 body and body limits."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest

from rollout_server import ServerConfigError, ShutdownTimeouts, create_rollout_server
from rollout_types import PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER

ROLLOUT_ID_MSG = (
    "Value error, rollout_id must be a single path segment "
    "(no path separators, and not '.' or '..')"
)


class TestAdmitted:
    async def test_202_body_has_token_and_both_timings(self, harness: Any) -> None:
        """An admitted rollout gets 202 with its id, status queued, a 43-char token and the
        server's wait and lease."""
        reply = await harness.post_rollout()
        assert reply.status == 202
        assert set(reply.json) == {
            "rollout_id",
            "status",
            "polling_lease_token",
            "result_wait_timeout_sec",
            "polling_lease_timeout_sec",
        }
        assert reply.json["rollout_id"] == "r1"
        assert reply.json["status"] == "queued"
        token = reply.json["polling_lease_token"]
        assert len(token) == 43
        assert set(token) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        assert reply.json["result_wait_timeout_sec"] == 0.3
        assert reply.json["polling_lease_timeout_sec"] == 5.0
        assert reply.headers["Content-Type"] == "application/json"
        assert reply.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION

    async def test_execution_is_scheduled_with_the_request_fields(self, harness: Any) -> None:
        """The backend receives every admitted field, and extra_fields only as
        request_extra_fields."""
        await harness.admit(
            "r1",
            label="gold",
            metadata={"k": 1},
            llm_api_key="sk-1",
            grade=False,
            agent_timeout_sec=3,
            grader_timeout_sec=4.5,
            extra_fields={"x": 1},
        )
        run = await harness.backend.started("r1")
        request = run.request
        assert request.id == "r1"
        assert request.prompt == [{"role": "user", "content": "hello"}]
        assert request.chat_completions_url == "http://127.0.0.1:9/v1"
        assert (request.label, request.metadata, request.llm_api_key) == ("gold", {"k": 1}, "sk-1")
        assert request.grade is False
        assert (request.agent_timeout_sec, request.grader_timeout_sec) == (3.0, 4.5)
        assert request.request_extra_fields == {"x": 1}
        assert request.admitted_at > 0

    async def test_unknown_keys_are_ignored(self, harness: Any, body: Any) -> None:
        """Keys the server does not know (such as grader_callback_url) do not block admission."""
        reply = await harness.post_rollout(body("r1", grader_callback_url="http://x", future=1))
        assert reply.status == 202

    async def test_whitespace_llm_api_key_is_accepted(self, harness: Any, body: Any) -> None:
        """An llm_api_key of spaces is a key like any other."""
        assert (await harness.post_rollout(body("r1", llm_api_key="   "))).status == 202

    async def test_zero_and_negative_timeouts_are_accepted(self, harness: Any, body: Any) -> None:
        """Zero or negative timeouts mean 'already expired', not invalid."""
        reply = await harness.post_rollout(body("r1", agent_timeout_sec=0, grader_timeout_sec=-1))
        assert reply.status == 202

    async def test_minimal_body_is_accepted(self, harness: Any) -> None:
        """Only initial_messages, rollout_id and chat_completions_url are required."""
        reply = await harness.post_rollout(
            {"initial_messages": [], "rollout_id": "r1", "chat_completions_url": ""}
        )
        assert reply.status == 202


class TestValidation:
    @pytest.mark.parametrize("rollout_id", ["", ".", "..", "a/b", "a\\b", "a\x00b"])
    async def test_bad_rollout_id_is_422(self, harness: Any, body: Any, rollout_id: str) -> None:
        """A rollout_id that is not one path segment gets 422 at body.rollout_id."""
        reply = await harness.post_rollout(body(rollout_id))
        assert reply.status == 422
        (error,) = reply.json["detail"]
        assert error["loc"] == ["body", "rollout_id"]
        assert error["type"] == "value_error"
        assert error["msg"] == ROLLOUT_ID_MSG

    async def test_lone_surrogate_rollout_id_is_422(self, harness: Any) -> None:
        """A rollout_id holding a lone surrogate (no URL can carry it) gets 422 at
        body.rollout_id, and the 422 body is valid JSON."""
        raw = b'{"initial_messages":[],"rollout_id":"a\\ud800","chat_completions_url":""}'
        reply = await harness.request("POST", "/rollout", data=raw)
        assert reply.status == 422
        assert reply.json["detail"][0]["loc"] == ["body", "rollout_id"]
        assert reply.json["detail"][0]["input"] == "a\ud800"
        assert len(harness.server.registry) == 0

    async def test_numeric_rollout_id_is_string_type(self, harness: Any, body: Any) -> None:
        """A JSON number is not coerced into a rollout_id."""
        reply = await harness.post_rollout(body(5))
        assert reply.status == 422
        assert [(e["type"], e["loc"]) for e in reply.json["detail"]] == [
            ("string_type", ["body", "rollout_id"])
        ]

    async def test_empty_llm_api_key_is_422(self, harness: Any, body: Any) -> None:
        """An empty llm_api_key is rejected with the protocol's message."""
        reply = await harness.post_rollout(body("r1", llm_api_key=""))
        assert reply.status == 422
        (error,) = reply.json["detail"]
        assert error["loc"] == ["body", "llm_api_key"]
        assert error["msg"] == "Value error, llm_api_key must be omitted or a non-empty string"

    async def test_missing_required_keys_are_listed(self, harness: Any) -> None:
        """Each missing required key gets its own 'missing' entry."""
        reply = await harness.post_rollout({"label": "x"})
        assert reply.status == 422
        missing = {tuple(e["loc"]) for e in reply.json["detail"] if e["type"] == "missing"}
        assert missing == {
            ("body", "initial_messages"),
            ("body", "rollout_id"),
            ("body", "chat_completions_url"),
        }

    @pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
    async def test_non_finite_timeout_is_422_not_500(self, harness: Any, literal: str) -> None:
        """A NaN or infinite timeout sent as a non-standard literal gets a 422 that encodes."""
        raw = (
            '{"initial_messages":[],"rollout_id":"r1","chat_completions_url":"",'
            f'"agent_timeout_sec":{literal}}}'
        )
        reply = await harness.request(
            "POST", "/rollout", data=raw, headers={"Content-Type": "application/json"}
        )
        assert reply.status == 422
        assert reply.json["detail"][0]["loc"] == ["body", "agent_timeout_sec"]
        assert harness.server.registry.get("r1") is None

    async def test_invalid_json_is_json_invalid(self, harness: Any) -> None:
        """An undecodable body gets 422 json_invalid."""
        reply = await harness.request("POST", "/rollout", data=b"{not json")
        assert reply.status == 422
        assert reply.json["detail"][0]["type"] == "json_invalid"
        assert reply.json["detail"][0]["loc"][0] == "body"

    @pytest.mark.parametrize("raw", ["[]", "1", '"x"', "null"])
    async def test_non_object_body_is_model_attributes_type(self, harness: Any, raw: str) -> None:
        """A JSON body that is not an object gets 422 model_attributes_type at body."""
        reply = await harness.request("POST", "/rollout", data=raw)
        assert reply.status == 422
        assert reply.json["detail"][0]["type"] == "model_attributes_type"
        assert reply.json["detail"][0]["loc"] == ["body"]

    async def test_non_object_message_is_dict_type(self, harness: Any, body: Any) -> None:
        """Each initial message must be an object."""
        reply = await harness.post_rollout(body("r1", initial_messages=[{"role": "user"}, "hi"]))
        assert reply.status == 422
        assert reply.json["detail"][0]["loc"][:2] == ["body", "initial_messages"]

    async def test_422_never_echoes_the_llm_api_key(self, harness: Any, body: Any) -> None:
        """A body-level 422 redacts llm_api_key from the echoed input."""
        bad = body("r1", llm_api_key="sk-secret-value")
        del bad["chat_completions_url"]
        reply = await harness.post_rollout(bad)
        assert reply.status == 422
        assert b"sk-secret-value" not in reply.raw

    async def test_validation_comes_before_capacity(self, harness: Any, body: Any) -> None:
        """An invalid body sent to a full server gets 422, not 429."""
        harness.backend.capacity = False
        assert (await harness.post_rollout(body(""))).status == 422


class TestCallbackProtocol:
    async def test_pre_033_caller_gets_400_telling_to_upgrade(self, harness: Any) -> None:
        """A body with completion_callback_url (and no rollout_id) gets 400 saying to upgrade
        client and server together, and nothing is admitted."""
        reply = await harness.post_rollout(
            {
                "initial_messages": [],
                "chat_completions_url": "http://x/v1",
                "completion_callback_url": "http://caller/done",
                "controller_api_key": "k",
            }
        )
        assert reply.status == 400
        assert "completion_callback_url" in reply.json["detail"]
        assert "upgrade" in reply.json["detail"]
        assert len(harness.server.registry) == 0

    async def test_null_callback_url_is_an_unknown_key(self, harness: Any, body: Any) -> None:
        """An explicit null completion_callback_url counts as absent."""
        assert (await harness.post_rollout(body("r1", completion_callback_url=None))).status == 202


class TestAdmissionOrder:
    async def test_shutting_down_is_503_without_retry_after(self, harness: Any) -> None:
        """Once shutdown begins, admission answers 503 with the protocol's detail."""
        harness.server.begin_shutdown()
        reply = await harness.post_rollout()
        assert reply.status == 503
        assert reply.json == {"detail": "rollout server is shutting down"}
        assert "Retry-After" not in reply.headers

    async def test_no_capacity_is_429_with_retry_after_5(self, harness: Any) -> None:
        """A backend without capacity gives 429 and Retry-After: 5 by default."""
        harness.backend.capacity = False
        reply = await harness.post_rollout()
        assert reply.status == 429
        assert reply.json == {"detail": "rollout queue is full; retry later"}
        assert reply.headers["Retry-After"] == "5"

    @pytest.mark.parametrize(
        ("hint", "header"),
        [(0.2, "1"), (2.1, "3"), (30, "30"), (600.0, "60"), (math.nan, "5"), ("x", "5")],
    )
    async def test_retry_after_is_clamped_whole_seconds(
        self, harness: Any, hint: Any, header: str
    ) -> None:
        """The backend's hint becomes whole seconds in [1, 60]; a non-number gives 5."""
        harness.backend.capacity = False
        harness.backend.retry_after = hint
        assert (await harness.post_rollout()).headers["Retry-After"] == header

    async def test_retry_after_hint_that_raises_gives_5(self, harness: Any) -> None:
        """A backend whose retry_after_sec() raises still yields a 429 with Retry-After 5."""
        harness.backend.capacity = False
        harness.backend.retry_after = RuntimeError("boom")
        reply = await harness.post_rollout()
        assert (reply.status, reply.headers["Retry-After"]) == (429, "5")

    async def test_shutdown_comes_before_capacity(self, harness: Any) -> None:
        """A full server that is shutting down answers 503."""
        harness.backend.capacity = False
        harness.server.begin_shutdown()
        assert (await harness.post_rollout()).status == 503

    async def test_duplicate_at_capacity_is_429_then_409(self, harness: Any) -> None:
        """A duplicate id sent to a full server gets 429, and 409 once capacity is back."""
        await harness.admit("r1")
        harness.backend.capacity = False
        assert (await harness.post_rollout()).status == 429
        harness.backend.capacity = True
        reply = await harness.post_rollout()
        assert reply.status == 409
        assert reply.json == {"detail": "rollout_id is already registered"}

    async def test_live_id_is_409(self, harness: Any) -> None:
        """Re-admitting a rollout that is still running gets 409."""
        await harness.admit("r1")
        await harness.backend.started("r1")
        assert (await harness.post_rollout()).status == 409

    async def test_retained_id_is_409(self, harness: Any) -> None:
        """Re-admitting a finished rollout during its retention gets 409."""
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        await harness.poll_until("r1", token, "success")
        assert (await harness.post_rollout()).status == 409


class TestBodySize:
    async def test_body_over_the_limit_is_413_with_detail(self, make_harness: Any) -> None:
        """A body over max_body_bytes gets 413 with a JSON detail naming the limit."""
        harness = await make_harness(max_body_bytes=1000)
        reply = await harness.post_rollout({"initial_messages": [], "pad": "x" * 2000})
        assert reply.status == 413
        assert "1000 bytes" in reply.json["detail"]

    async def test_chunked_body_over_the_limit_is_413(self, make_harness: Any) -> None:
        """A body without Content-Length is limited too."""
        harness = await make_harness(max_body_bytes=1000)

        async def chunks() -> Any:
            for _ in range(5):
                yield b"x" * 500

        async with harness.client.post("/rollout", data=chunks()) as response:
            assert response.status == 413
            assert "1000 bytes" in (await response.json())["detail"]

    async def test_cancel_body_is_limited_too(self, make_harness: Any) -> None:
        """POST /rollout/cancel also answers 413 over the limit."""
        harness = await make_harness(max_body_bytes=100)
        reply = await harness.cancel({"ids": ["x" * 200]})
        assert reply.status == 413

    @pytest.mark.slow
    async def test_default_limit_accepts_63_mib(self, harness: Any, body: Any) -> None:
        """The default limit (64 MiB) admits a body of 63 MiB, far above aiohttp's 1 MiB."""
        big = body("big", metadata={"blob": "x" * (63 * 1024 * 1024)})
        data = io.BytesIO(json.dumps(big).encode())
        headers = {"Content-Type": "application/json"}
        async with harness.client.post("/rollout", data=data, headers=headers) as response:
            assert response.status == 202
        run = await harness.backend.started("big")
        assert len(run.request.metadata["blob"]) == 63 * 1024 * 1024


class TestConstruction:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"result_wait_timeout_sec": 0}, "result_wait_timeout_sec must be > 0"),
            ({"result_wait_timeout_sec": math.inf}, "result_wait_timeout_sec must be a finite"),
            ({"result_wait_timeout_sec": "1"}, "result_wait_timeout_sec must be a finite"),
            ({"polling_lease_timeout_sec": math.nan}, "polling_lease_timeout_sec must be a finite"),
            ({"polling_lease_timeout_sec": -1}, "polling_lease_timeout_sec must be > 0"),
            (
                {"result_wait_timeout_sec": 30, "polling_lease_timeout_sec": 30},
                "must be greater than result_wait_timeout_sec",
            ),
            ({"result_retention_sec": -0.5}, "result_retention_sec must be >= 0"),
            ({"result_retention_sec": math.inf}, "result_retention_sec must be a finite"),
            ({"api_key": ""}, "api_key must be a non-blank string"),
            ({"api_key": "   "}, "api_key must be a non-blank string"),
            ({"api_key": "a\nb"}, "control characters"),
            ({"max_body_bytes": 0}, "max_body_bytes must be a positive int"),
            ({"keepalive_timeout_sec": 0}, "keepalive_timeout_sec must be > 0"),
            ({"status_change_grace_sec": -0.1}, "status_change_grace_sec must be >= 0"),
            ({"status_change_grace_sec": math.nan}, "status_change_grace_sec must be a finite"),
            ({"status_change_grace_sec": True}, "status_change_grace_sec must be a finite"),
        ],
    )
    def test_bad_arguments_raise_value_errors(
        self, scripted: Any, kwargs: dict[str, Any], message: str
    ) -> None:
        """Each out-of-range argument raises ServerConfigError (a ValueError) naming it."""
        with pytest.raises(ServerConfigError, match=message) as info:
            create_rollout_server(backend=scripted(), **kwargs)
        assert isinstance(info.value, ValueError)

    def test_backend_must_be_an_execution_backend(self) -> None:
        """Passing something that is not an ExecutionBackend raises TypeError."""
        with pytest.raises(TypeError, match="ExecutionBackend"):
            create_rollout_server(backend=object())  # type: ignore[arg-type]

    @pytest.mark.parametrize("field", ["drain_sec", "cleanup_sec", "force_sec", "collect_sec"])
    def test_shutdown_timeouts_are_validated(self, field: str) -> None:
        """A negative or non-finite shutdown stage bound raises ServerConfigError."""
        with pytest.raises(ServerConfigError, match=field):
            ShutdownTimeouts(**{field: -1.0})
        with pytest.raises(ServerConfigError, match=field):
            ShutdownTimeouts(**{field: math.inf})

    def test_defaults_match_the_protocol(self, scripted: Any) -> None:
        """Without arguments the server uses 30 s wait, 120 s lease, 900 s retention, 64 MiB."""
        from rollout_server import ROLLOUT_SERVER_KEY

        server = create_rollout_server(backend=scripted())[ROLLOUT_SERVER_KEY]
        assert server.result_wait_timeout_sec == 30.0
        assert server.polling_lease_timeout_sec == 120.0
        assert server.result_retention_sec == 900.0
        assert server.max_body_bytes == 64 * 1024 * 1024
        assert server.shutdown_timeouts == ShutdownTimeouts(
            drain_sec=10.0, cleanup_sec=120.0, force_sec=10.0, backend_sec=30.0, collect_sec=5.0
        )
