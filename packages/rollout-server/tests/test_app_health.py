"""``GET /health``: backend fields, identity, lifecycle, protocol version; HTTP settings."""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

import pytest

from rollout_server import ROLLOUT_SERVER_KEY, create_rollout_server
from rollout_types import PROTOCOL_VERSION


class TestHealth:
    async def test_fields(self, harness: Any) -> None:
        """The body merges the backend's fields with instance_id, process_id (a UUID4),
        lifecycle, the protocol version and the state store's figures."""
        reply = await harness.health()
        assert reply.status == 200
        assert reply.json == {
            "status": "ok",
            "scripted": True,
            "instance_id": reply.json["process_id"],
            "process_id": reply.json["process_id"],
            "lifecycle": {"accepting_rollouts": True, "active_rollouts": 0},
            "protocol_version": PROTOCOL_VERSION,
            "state": {
                "store": "memory",
                "recovered_rollouts": 0,
                "failed_by_restart": 0,
                "reattached_rollouts": 0,
                "commits": 0,
                "writes": 0,
                "largest_commit": 0,
                "failed_commits": 0,
            },
        }
        assert str(uuid.UUID(reply.json["process_id"], version=4)) == reply.json["process_id"]

    @pytest.mark.parametrize("name", ["_OSMOSIS_ROLLOUT_INSTANCE_ID", "ROLLOUT_INSTANCE_ID"])
    async def test_instance_id_comes_from_the_environment(
        self, make_harness: Any, monkeypatch: pytest.MonkeyPatch, name: str
    ) -> None:
        """A non-empty instance id variable becomes instance_id; process_id stays a UUID."""
        monkeypatch.delenv("_OSMOSIS_ROLLOUT_INSTANCE_ID", raising=False)
        monkeypatch.delenv("ROLLOUT_INSTANCE_ID", raising=False)
        monkeypatch.setenv(name, "run-42")
        reply = await (await make_harness()).health()
        assert reply.json["instance_id"] == "run-42"
        assert reply.json["process_id"] != "run-42"

    async def test_empty_instance_id_variable_is_ignored(
        self, make_harness: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An empty variable counts as unset: instance_id equals process_id."""
        monkeypatch.delenv("ROLLOUT_INSTANCE_ID", raising=False)
        monkeypatch.setenv("_OSMOSIS_ROLLOUT_INSTANCE_ID", "")
        reply = await (await make_harness()).health()
        assert reply.json["instance_id"] == reply.json["process_id"]

    async def test_process_id_is_new_for_each_server_instance(self, make_harness: Any) -> None:
        """Two server instances report different process ids; one instance keeps its own."""
        first = await make_harness()
        second = await make_harness()
        one = (await first.health()).json["process_id"]
        assert (await first.health()).json["process_id"] == one
        assert (await second.health()).json["process_id"] != one

    async def test_server_fields_override_backend_fields(self, harness: Any) -> None:
        """A backend cannot shadow instance_id, process_id or lifecycle."""
        harness.backend.health_fields = {"status": "ok", "process_id": "x", "lifecycle": 1}
        reply = await harness.health()
        assert reply.json["process_id"] == harness.server.process_id
        assert reply.json["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 0}

    async def test_active_rollouts_and_accepting(self, harness: Any) -> None:
        """active_rollouts counts running executions; accepting_rollouts turns false for
        good once shutdown begins."""
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        await harness.admit("r2")
        await harness.backend.started("r2")
        assert (await harness.health()).json["lifecycle"] == {
            "accepting_rollouts": True,
            "active_rollouts": 2,
        }
        run.succeed()
        await harness.poll_until("r1", token, "success")
        await harness.until(lambda: harness.server.registry.active == 1)
        harness.server.begin_shutdown()
        assert (await harness.health()).json["lifecycle"] == {
            "accepting_rollouts": False,
            "active_rollouts": 1,
        }

    @pytest.mark.parametrize(
        ("fields", "expected_status"),
        [
            (RuntimeError("backend broke"), "error"),
            (["not", "a", "dict"], "unknown"),
            ({"status": "ok", "load": math.nan, "obj": object()}, "ok"),
        ],
        ids=["raises", "not-a-dict", "non-json-values"],
    )
    async def test_a_misbehaving_backend_health_still_answers_200(
        self, harness: Any, fields: Any, expected_status: str
    ) -> None:
        """A backend health() that raises, returns a non-dict or non-JSON values still gives
        a 200 JSON body with the server's fields."""

        def broken() -> Any:
            if isinstance(fields, BaseException):
                raise fields
            return fields

        harness.backend.health = broken
        reply = await harness.health()
        assert reply.status == 200
        assert reply.json["status"] == expected_status
        assert reply.json["lifecycle"]["accepting_rollouts"] is True
        assert "load" not in reply.json


class TestHttpSettings:
    async def test_keep_alive_defaults_to_2160_seconds(self, harness: Any) -> None:
        """The served app keeps idle connections for 2160 s, longer than load balancers."""
        assert harness.server.keepalive_timeout_sec == 2160.0
        handler = harness.client.server.runner.server
        assert handler is not None
        assert handler._kwargs["keepalive_timeout"] == 2160.0

    async def test_keep_alive_is_configurable(self, make_harness: Any) -> None:
        """keepalive_timeout_sec reaches the HTTP server."""
        harness = await make_harness(keepalive_timeout_sec=75.0)
        assert harness.client.server.runner.server._kwargs["keepalive_timeout"] == 75.0

    async def test_access_log_is_off_by_default(self, harness: Any, caplog: Any) -> None:
        """Without access_log, requests log nothing to rollout_server.access."""
        with caplog.at_level(logging.INFO, logger="rollout_server.access"):
            await harness.health()
        assert not [r for r in caplog.records if r.name == "rollout_server.access"]

    async def test_access_log_logs_one_line_per_request(
        self, make_harness: Any, caplog: Any
    ) -> None:
        """With access_log=True each request logs one line to rollout_server.access."""
        harness = await make_harness(access_log=True)
        with caplog.at_level(logging.INFO, logger="rollout_server.access"):
            await harness.health()
            await harness.request("GET", "/nothing")
        lines = [r.getMessage() for r in caplog.records if r.name == "rollout_server.access"]
        assert len(lines) == 2
        assert "GET /health" in lines[0]
        assert " 404 " in lines[1]

    def test_app_is_built_once_per_call(self, scripted: Any) -> None:
        """Each create_rollout_server() call builds an independent server."""
        one = create_rollout_server(backend=scripted())[ROLLOUT_SERVER_KEY]
        two = create_rollout_server(backend=scripted())[ROLLOUT_SERVER_KEY]
        assert one is not two
        assert one.process_id != two.process_id
