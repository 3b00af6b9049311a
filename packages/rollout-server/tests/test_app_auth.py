"""The middleware: bearer auth, the protocol version header, and error shapes for any input."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_types import LEASE_HEADER, PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}
UNAUTHORIZED = {"detail": "unauthorized"}

ROUTES = [
    ("GET", "/health"),
    ("POST", "/rollout"),
    ("GET", "/rollout/r1/result"),
    ("POST", "/rollout/cancel"),
    ("GET", "/nothing"),
    ("DELETE", "/rollout"),
    ("GET", "/docs"),
]


class TestAuth:
    @pytest.mark.parametrize(("method", "path"), ROUTES)
    @pytest.mark.parametrize(
        "authorization",
        [
            None,
            "",
            KEY,
            f"bearer {KEY}",
            f"Bearer  {KEY}",
            f"Bearer {KEY}x",
            f"Basic {KEY}",
            "Bearer wrong",
        ],
    )
    async def test_every_route_rejects_bad_credentials(
        self, make_harness: Any, method: str, path: str, authorization: str | None
    ) -> None:
        """Every route, unknown paths and wrong methods included, answers 401
        {"detail":"unauthorized"} unless the header is exactly "Bearer <key>"."""
        harness = await make_harness(api_key=KEY)
        headers = {} if authorization is None else {"Authorization": authorization}
        reply = await harness.request(method, path, headers=headers, json_body={"all": True})
        assert (reply.status, reply.json) == (401, UNAUTHORIZED)
        assert reply.headers["Content-Type"] == "application/json"
        assert "WWW-Authenticate" not in reply.headers
        assert reply.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION
        assert len(harness.server.registry) == 0

    async def test_the_exact_key_opens_every_route(self, make_harness: Any, body: Any) -> None:
        """With the right bearer key the four routes behave as without auth."""
        harness = await make_harness(api_key=KEY)
        assert (await harness.health(headers=GOOD)).status == 200
        reply = await harness.post_rollout(body("r1"), headers=GOOD)
        assert reply.status == 202
        token = reply.json["polling_lease_token"]
        await harness.backend.started("r1")
        poll = await harness.poll("r1", token, headers=GOOD)
        assert (poll.status, poll.json["status"]) == (200, "running")
        cancel = await harness.cancel({"ids": ["r1"]}, headers=GOOD)
        assert cancel.json == {"dispositions": {"r1": "cancelled_running"}}
        missing = await harness.request("GET", "/nothing", headers=GOOD)
        assert (missing.status, missing.json) == (404, {"detail": "Not Found"})

    async def test_auth_comes_before_validation(self, make_harness: Any) -> None:
        """An invalid body without credentials gets 401, not 422."""
        harness = await make_harness(api_key=KEY)
        reply = await harness.request("POST", "/rollout", data=b"{not json")
        assert reply.status == 401

    async def test_non_ascii_key_is_compared_as_utf8(self, make_harness: Any) -> None:
        """A key with non-ASCII characters works when sent as UTF-8 bytes."""
        harness = await make_harness(api_key="clé-ü")
        async with harness.client.get(
            "/health", headers={"Authorization": "Bearer clé-ü"}
        ) as response:
            assert response.status == 200
        async with harness.client.get(
            "/health", headers={"Authorization": "Bearer cle-u"}
        ) as response:
            assert response.status == 401


class TestProtocolVersion:
    @pytest.mark.parametrize(
        ("method", "path", "expected"),
        [
            ("GET", "/health", 200),
            ("POST", "/rollout/cancel", 200),
            ("GET", "/rollout/ghost/result", 422),
            ("GET", "/nothing", 404),
            ("PUT", "/health", 405),
        ],
    )
    async def test_every_response_carries_the_version(
        self, harness: Any, method: str, path: str, expected: int
    ) -> None:
        """Successes and errors alike carry X-Rollout-Protocol-Version."""
        reply = await harness.request(method, path, json_body={"ids": []})
        assert reply.status == expected
        assert reply.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION

    @pytest.mark.parametrize("theirs", ["0.9", "2.0", "99", "garbage", ""])
    async def test_incompatible_major_gets_426_naming_both(
        self, harness: Any, body: Any, theirs: str
    ) -> None:
        """A request advertising another major version gets 426 naming both versions and
        saying to upgrade client and server together; nothing is admitted."""
        reply = await harness.post_rollout(body("r1"), headers={PROTOCOL_VERSION_HEADER: theirs})
        assert reply.status == 426
        detail = reply.json["detail"]
        assert f"rollout protocol {theirs} " in detail
        assert PROTOCOL_VERSION in detail
        assert "upgrade client and server together" in detail
        assert reply.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION
        assert len(harness.server.registry) == 0

    async def test_same_major_is_served(self, harness: Any, body: Any) -> None:
        """A client of the same major version (any minor) is served normally."""
        major = PROTOCOL_VERSION.split(".")[0]
        headers = {PROTOCOL_VERSION_HEADER: f"{major}.99"}
        assert (await harness.post_rollout(body("r1"), headers=headers)).status == 202

    async def test_requests_without_the_header_are_served(self, harness: Any) -> None:
        """osmosis-ai clients send no version header and are served as usual."""
        assert (await harness.post_rollout()).status == 202


class TestNoServerErrors:
    async def test_unknown_path_is_404_detail(self, harness: Any) -> None:
        """A path that is not a route gets 404 {"detail":"Not Found"}."""
        reply = await harness.request("GET", "/rollout/a/b/result")
        assert (reply.status, reply.json) == (404, {"detail": "Not Found"})

    @pytest.mark.parametrize(
        ("method", "path", "allow"),
        [("GET", "/rollout", "POST"), ("DELETE", "/rollout/cancel", "POST")],
    )
    async def test_wrong_method_is_405_with_allow(
        self, harness: Any, method: str, path: str, allow: str
    ) -> None:
        """A known path with the wrong method gets 405 {"detail":...} and an Allow header."""
        reply = await harness.request(method, path)
        assert (reply.status, reply.json) == (405, {"detail": "Method Not Allowed"})
        assert reply.headers["Allow"] == allow

    @pytest.mark.parametrize(
        ("path", "data", "headers"),
        [
            ("/rollout", b"\xff\xfe\x00garbage", {"Content-Type": "application/json"}),
            ("/rollout", b'{"rollout_id": "\\ud800"}', {}),
            ("/rollout", b'{"a": ' * 5000, {}),
            ("/rollout", b'{"initial_messages": {}, "rollout_id": [], "x": 1e999}', {}),
            ("/rollout", b'{"initial_messages":[],"rollout_id":"r","chat_completions_url":1}', {}),
            ("/rollout", b"", {}),
            ("/rollout", b"{}", {"Content-Type": "text/plain"}),
            ("/rollout/cancel", b"[1,2]", {}),
            ("/rollout/cancel", b'{"ids": [null], "all": NaN}', {}),
            ("/rollout/cancel", b"\x00", {}),
        ],
    )
    async def test_odd_bodies_get_4xx_json(
        self, harness: Any, path: str, data: bytes, headers: dict[str, str]
    ) -> None:
        """Malformed, deeply nested or mistyped bodies get a JSON 4xx, never a 500."""
        reply = await harness.request("POST", path, data=data, headers=headers)
        assert 400 <= reply.status < 500, reply
        assert isinstance(reply.json["detail"], str | list)

    @pytest.mark.parametrize(
        ("path", "lease"),
        [
            ("/rollout/%ZZ/result", "t"),
            ("/rollout/%00/result", "t"),
            ("/rollout/%2F/result", "t"),
            ("/rollout/..%2F..%2Fhealth/result", "t"),
            ("/rollout/r1/result?x=%ff", "t"),
            ("/rollout/r1/result", "\u00ff" * 3),
            ("/rollout/" + "a" * 8000 + "/result", "t"),
        ],
    )
    async def test_odd_polls_get_4xx_json(self, harness: Any, path: str, lease: str) -> None:
        """Odd ids, encodings and lease values get a JSON 4xx, never a 500."""
        await harness.admit("r1")
        reply = await harness.request(
            "GET", path, headers={LEASE_HEADER: lease.encode().decode("latin-1")}
        )
        assert 400 <= reply.status < 500, reply
        assert reply.json is not None
