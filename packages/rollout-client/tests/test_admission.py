"""Admission (``POST /rollout``) against misbehaving fake servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

import rollout_client
from rollout_client import (
    RolloutAdmissionTimeoutError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from rollout_types import PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER

from .conftest import (
    EVENT_SEC,
    drop,
    init_body,
    json_response,
    result_body,
    scripted,
)

MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]
GOLDEN_0_3_2_422 = (
    Path(__file__).resolve().parents[2]
    / "rollout-types/tests/data/golden/osmosis-0.3.2/error_422_pull_protocol_request.json"
)


def admit_then_succeed(rollout_id: str = "r1") -> list[web.RouteDef]:
    """Routes of a well-behaved server that admits and reports success at once."""
    return [
        web.post("/rollout", lambda r: json_response(init_body(rollout_id), 202)),
        web.get(f"/rollout/{rollout_id}/result", lambda r: json_response(result_body(rollout_id))),
    ]


class TestAdmissionRequest:
    async def test_body_carries_every_key(self, serve, make_client):
        """The POST body holds every request key, nulls included, as an osmosis peer sends."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url)
        await client.run_rollout(MESSAGES, "http://127.0.0.1:9/v1", "r1")
        (post,) = server.seen("POST", "/rollout")
        assert json.loads(post.body) == {
            "initial_messages": MESSAGES,
            "rollout_id": "r1",
            "chat_completions_url": "http://127.0.0.1:9/v1",
            "label": None,
            "metadata": None,
            "llm_api_key": None,
            "grade": True,
            "agent_timeout_sec": None,
            "grader_timeout_sec": None,
            "extra_fields": None,
        }
        assert post.headers["Content-Type"] == "application/json"

    async def test_headers_on_admission(self, serve, make_client):
        """Admission carries the bearer key and this project's protocol version header."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url, api_key="k-1")
        await client.run_rollout(MESSAGES, "u", "r1")
        (post,) = server.seen("POST", "/rollout")
        assert post.headers["Authorization"] == "Bearer k-1"
        assert post.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION

    async def test_own_session_sends_only_the_headers_it_needs(self, serve, make_client):
        """A client-made session sends ``User-Agent: rollout-client/<version>`` and no
        ``Accept`` or ``Accept-Encoding`` (a server keeps every header of a waiting poll)."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url)
        await client.run_rollout(MESSAGES, "u", "r1")
        assert server.requests
        for request in server.requests:
            assert request.headers["User-Agent"] == f"rollout-client/{rollout_client.__version__}"
            assert "Accept" not in request.headers
            assert "Accept-Encoding" not in request.headers

    async def test_no_authorization_without_key(self, serve, make_client):
        """Without api_key no Authorization header is sent."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url)
        await client.run_rollout(MESSAGES, "u", "r1")
        assert all("Authorization" not in r.headers for r in server.requests)

    async def test_base_url_prefix_and_trailing_slash(self, serve, make_client):
        """A path prefix in the base URL is kept and trailing slashes are dropped."""
        routes = [
            web.post("/pre/rollout", lambda r: json_response(init_body("r1"), 202)),
            web.get("/pre/rollout/r1/result", lambda r: json_response(result_body("r1"))),
        ]
        server = await serve(*routes)
        client = make_client(server.url + "/pre//")
        result = await client.run_rollout(MESSAGES, "u", "r1")
        assert result.status == "success"
        assert [r.raw_path for r in server.requests] == ["/pre/rollout", "/pre/rollout/r1/result"]

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"rollout_id": "a/b"}, "single path segment"),
            ({"rollout_id": ".."}, "single path segment"),
            ({"llm_api_key": ""}, "llm_api_key"),
            ({"agent_timeout_sec": float("nan")}, "agent_timeout_sec"),
            ({"grader_timeout_sec": float("inf")}, "grader_timeout_sec"),
            ({"metadata": {"x": float("nan")}}, "JSON"),
        ],
    )
    async def test_invalid_request_fails_before_io(self, serve, make_client, kwargs, match):
        """An invalid request raises ValueError and sends nothing."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url)
        arguments = {"initial_messages": MESSAGES, "chat_completions_url": "u", "rollout_id": "r1"}
        arguments.update(kwargs)
        with pytest.raises(ValueError, match=match):
            await client.run_rollout_async(**arguments)
        assert server.requests == []

    async def test_non_string_rollout_id(self, serve, make_client):
        """A rollout_id that is not a string raises TypeError before any I/O."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url)
        with pytest.raises(TypeError, match="rollout_id must be a str"):
            await client.run_rollout_async(MESSAGES, "u", 7)  # type: ignore[arg-type]
        assert server.requests == []


class TestAdmission429:
    @pytest.mark.parametrize(
        ("retry_after", "expected"),
        [
            ("2.5", 2.5),
            (None, 1.0),
            ("soon", 1.0),
            ("Wed, 21 Oct 2015 07:28:00 GMT", 1.0),
            ("nan", 1.0),
            ("1e999", 1.0),
            ("1000", 60.0),
            ("0", 0.05),
            ("-4", 0.05),
        ],
    )
    async def test_retry_after(self, serve, make_client, fake_time, retry_after, expected):
        """A 429 is retried after its Retry-After, clamped to [0.05, 60] and 1 s if invalid."""
        headers = {} if retry_after is None else {"Retry-After": retry_after}
        server = await serve(
            web.post(
                "/rollout",
                scripted(
                    lambda r: json_response({"detail": "full"}, 429, **headers),
                    lambda r: json_response(init_body("r1"), 202),
                ),
            ),
            web.get("/rollout/r1/result", lambda r: json_response(result_body("r1"))),
        )
        client = make_client(server.url)
        await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [expected]
        assert len(server.seen("POST")) == 2


class TestAdmissionStatuses:
    @pytest.mark.parametrize("status", [200, 201, 400, 401, 404, 409, 500, 502, 503, 504])
    async def test_other_status_fails_at_once(self, serve, make_client, status):
        """Every status but 202 and 429 raises RolloutProtocolError once, without retry."""
        server = await serve(
            web.post("/rollout", lambda r: json_response({"detail": "no"}, status))
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match=f"returned {status}; only 202 and 429") as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert e.value.status_code == status
        assert len(server.requests) == 1

    async def test_duplicate_id_message(self, serve, make_client):
        """A 409 says the id is already registered and to use a fresh one."""
        server = await serve(
            web.post(
                "/rollout",
                lambda r: json_response({"detail": "rollout_id is already registered"}, 409),
            )
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="fresh id"):
            await client.run_rollout_async(MESSAGES, "u", "r1")

    async def test_redirect_not_followed(self, serve, make_client):
        """A 307 on admission is an error; the redirect target never sees the key."""
        target = await serve(web.post("/rollout", lambda r: json_response(init_body("r1"), 202)))
        server = await serve(
            web.post(
                "/rollout",
                lambda r: web.Response(status=307, headers={"Location": target.url + "/rollout"}),
            )
        )
        client = make_client(server.url, api_key="secret")
        with pytest.raises(RolloutProtocolError) as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert e.value.status_code == 307
        assert target.requests == []

    @pytest.mark.parametrize(
        "body",
        [
            b"not json",
            b"[]",
            json.dumps(init_body("r1", wait=5.0, lease=5.0)).encode(),
            json.dumps(init_body("r1", wait=0.0)).encode(),
            json.dumps(init_body("r1", lease_token="")).encode(),
            json.dumps({"rollout_id": "r1"}).encode(),
        ],
    )
    async def test_invalid_202_body(self, serve, make_client, body):
        """A 202 whose body breaks the RolloutInitResponse rules raises (status 202)."""
        server = await serve(
            web.post(
                "/rollout",
                lambda r: web.Response(status=202, body=body, content_type="application/json"),
            )
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="invalid response") as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert e.value.status_code == 202

    async def test_202_with_other_id(self, serve, make_client):
        """A 202 that echoes another rollout_id raises (status 202)."""
        server = await serve(web.post("/rollout", lambda r: json_response(init_body("r2"), 202)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="different rollout_id") as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert e.value.status_code == 202

    async def test_unknown_admission_status_accepted(self, serve, make_client):
        """A 202 reporting a status string this client does not know is still admitted."""
        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1", status="staged"), 202)),
            web.get("/rollout/r1/result", lambda r: json_response(result_body("r1"))),
        )
        client = make_client(server.url)
        handle = await client.run_rollout_async(MESSAGES, "u", "r1")
        assert (await handle).status == "success"

    async def test_transport_error_not_retried(self, serve, make_client):
        """A dropped connection during admission propagates at once; nothing is replayed."""
        server = await serve(web.post("/rollout", drop))
        client = make_client(server.url)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert len(server.requests) == 1


class TestAdmissionTimeout:
    async def test_expires_during_request(self, serve, make_client):
        """A deadline firing mid-POST says admission may have succeeded and sends no cancel."""

        async def hang(request: web.Request) -> web.Response:
            await server.hang()
            return json_response(init_body("r1"), 202)

        server = await serve(
            web.post("/rollout", hang),
            web.post("/rollout/cancel", lambda r: json_response({"dispositions": {}})),
        )
        client = make_client(server.url, admission_timeout_sec=0.2)
        with pytest.raises(RolloutAdmissionTimeoutError) as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert str(e.value).startswith("admission for rollout r1 timed out after 0.2 seconds")
        assert "admission may have succeeded" in str(e.value)
        assert e.value.may_have_succeeded
        assert isinstance(e.value, TimeoutError)
        assert server.seen("POST", "/rollout/cancel") == []

    async def test_expires_during_backoff(self, serve, make_client):
        """A deadline firing while waiting out a 429 does not claim admission succeeded."""
        server = await serve(
            web.post("/rollout", lambda r: json_response({}, 429, **{"Retry-After": "60"}))
        )
        client = make_client(server.url, admission_timeout_sec=0.2, real_time=True)
        with pytest.raises(RolloutAdmissionTimeoutError) as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert "may have succeeded" not in str(e.value)
        assert not e.value.may_have_succeeded

    async def test_zero_expires_without_io(self, serve, make_client):
        """admission_timeout_sec=0 expires at once, before any request."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url, admission_timeout_sec=0)
        with pytest.raises(RolloutAdmissionTimeoutError, match=r"after 0\.0 seconds"):
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert server.requests == []

    async def test_does_not_bound_execution(self, serve, make_client):
        """The admission deadline does not limit polling after admission."""
        polled = asyncio.Event()

        async def result(request: web.Request) -> web.Response:
            if not polled.is_set():
                polled.set()
                await asyncio.sleep(0.3)
            return json_response(result_body("r1"))

        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1", wait=1.0), 202)),
            web.get("/rollout/r1/result", result),
        )
        client = make_client(server.url, admission_timeout_sec=0.1)
        async with asyncio.timeout(EVENT_SEC):
            result_ = await client.run_rollout(MESSAGES, "u", "r1")
        assert result_.status == "success"


class TestProtocolVersion:
    async def test_incompatible_major_rejected(self, serve, make_client):
        """An answer advertising another major version raises, naming both versions."""
        server = await serve(
            web.post(
                "/rollout",
                lambda r: json_response(init_body("r1"), 202, **{PROTOCOL_VERSION_HEADER: "2.0"}),
            )
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolVersionError) as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        message = str(e.value)
        assert "'2.0'" in message
        assert repr(PROTOCOL_VERSION) in message
        assert "upgrade the client (rollout-client) and the server" in message
        assert (e.value.client_version, e.value.server_version) == (PROTOCOL_VERSION, "2.0")

    async def test_426_from_our_server(self, serve, make_client):
        """Our server's 426 (it carries its version header) raises the version error."""
        server = await serve(
            web.get(
                "/health",
                lambda r: json_response(
                    {"detail": "client speaks rollout protocol 1.0 but this server speaks 3.1"},
                    426,
                    **{PROTOCOL_VERSION_HEADER: "3.1"},
                ),
            )
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolVersionError) as e:
            await client.health()
        assert e.value.status_code == 426

    async def test_426_without_header(self, serve, make_client):
        """A 426 Upgrade Required without a version header is still a version error."""
        server = await serve(
            web.post("/rollout", lambda r: json_response({"detail": "too new for me"}, 426))
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolVersionError, match="too new for me") as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert e.value.status_code == 426
        assert e.value.server_version == "unknown"

    async def test_compatible_minor_accepted(self, serve, make_client):
        """A newer minor version of the same major interoperates."""
        major = PROTOCOL_VERSION.split(".")[0]
        header = {PROTOCOL_VERSION_HEADER: f"{major}.99"}
        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1"), 202, **header)),
            web.get("/rollout/r1/result", lambda r: json_response(result_body("r1"), **header)),
        )
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"

    async def test_absent_header_is_osmosis_peer(self, serve, make_client):
        """Without the header (an osmosis-ai server) the pull protocol is spoken unchanged."""
        server = await serve(*admit_then_succeed())
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"

    async def test_pre_0_3_3_callback_server(self, serve, make_client):
        """A 0.3.2 server's 422 (completion_callback_url missing) says it is too old."""
        golden = GOLDEN_0_3_2_422.read_bytes()
        server = await serve(
            web.post(
                "/rollout",
                lambda r: web.Response(status=422, body=golden, content_type="application/json"),
            )
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolVersionError) as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert e.value.status_code == 422
        assert "pre-0.3.3 callback protocol" in str(e.value)
        assert "upgrade the client and the server together" in str(e.value)

    async def test_other_422_is_plain_protocol_error(self, serve, make_client):
        """A 422 about something else stays a RolloutProtocolError and quotes the detail."""
        detail = {
            "detail": [{"type": "missing", "loc": ["body", "label"], "msg": "Field required"}]
        }
        server = await serve(web.post("/rollout", lambda r: json_response(detail, 422)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match=r"body\.label: Field required") as e:
            await client.run_rollout_async(MESSAGES, "u", "r1")
        assert not isinstance(e.value, RolloutProtocolVersionError)
