"""``ServerSettings``: one definition of every server setting, shared by the app factory,
``RolloutServer`` and the ``rollout-server serve`` options."""

from __future__ import annotations

import inspect
import math
from typing import Any

import attrs
import pytest

from rollout_server import (
    ROLLOUT_SERVER_KEY,
    RolloutServer,
    ServerConfigError,
    ServerSettings,
    ShutdownTimeouts,
    create_rollout_server,
)
from rollout_server.cli._options import SERVER_OPTIONS, build_parser, server_settings
from rollout_server.state._store import default_state_url


class TestServerSettings:
    def test_defaults(self) -> None:
        """The defaults are the documented ones (30 s wait, 120 s lease, 900 s retention,
        64 MiB, 2160 s keep-alive, 30 s headers, 60 s body, 1 s grace, no access log,
        metrics on, the default shutdown bounds)."""
        assert ServerSettings() == ServerSettings(
            result_wait_timeout_sec=30.0,
            polling_lease_timeout_sec=120.0,
            result_retention_sec=900.0,
            max_body_bytes=64 * 1024 * 1024,
            keepalive_timeout_sec=2160.0,
            header_read_timeout_sec=30.0,
            body_read_timeout_sec=60.0,
            status_change_grace_sec=1.0,
            access_log=False,
            metrics=True,
            shutdown_timeouts=ShutdownTimeouts(),
        )

    @pytest.mark.parametrize(
        ("fields", "message"),
        [
            ({"result_wait_timeout_sec": 0}, "result_wait_timeout_sec must be > 0"),
            ({"header_read_timeout_sec": math.inf}, "header_read_timeout_sec must be a finite"),
            ({"body_read_timeout_sec": -1}, "body_read_timeout_sec must be > 0"),
            ({"keepalive_timeout_sec": "5"}, "keepalive_timeout_sec must be a finite"),
            (
                {"result_wait_timeout_sec": 10, "polling_lease_timeout_sec": 10},
                r"polling_lease_timeout_sec \(10.0\) must be greater than "
                r"result_wait_timeout_sec \(10.0\)",
            ),
            ({"result_retention_sec": -1}, "result_retention_sec must be >= 0"),
            ({"max_body_bytes": True}, "max_body_bytes must be a positive int; got True"),
            ({"max_body_bytes": 1.5}, "max_body_bytes must be a positive int; got 1.5"),
        ],
    )
    def test_each_field_is_validated(self, fields: dict[str, Any], message: str) -> None:
        """An out-of-range field raises ServerConfigError naming it, as the app factory's
        keyword of the same name does."""
        with pytest.raises(ServerConfigError, match=message):
            ServerSettings(**fields)

    def test_durations_are_floats(self) -> None:
        """Durations given as ints are kept as floats (the wait and the lease travel in
        admission answers as 2.0, not 2); the body limit stays an int."""
        settings = ServerSettings(
            result_wait_timeout_sec=2, polling_lease_timeout_sec=9, max_body_bytes=10
        )
        assert type(settings.result_wait_timeout_sec) is float
        assert type(settings.polling_lease_timeout_sec) is float
        assert type(attrs.evolve(settings, keepalive_timeout_sec=5).keepalive_timeout_sec) is float
        assert type(settings.max_body_bytes) is int

    async def test_the_admission_answer_carries_float_durations(self, make_harness: Any) -> None:
        """An app built with int durations answers an admission with them as JSON floats."""
        harness = await make_harness(result_wait_timeout_sec=2, polling_lease_timeout_sec=9)
        reply = await harness.post_rollout()
        assert reply.status == 202
        assert b'"result_wait_timeout_sec":2.0' in reply.raw.replace(b" ", b"")
        assert b'"polling_lease_timeout_sec":9.0' in reply.raw.replace(b" ", b"")

    def test_zero_retention_and_grace_are_allowed(self) -> None:
        """Retention and the status-change grace may be 0."""
        settings = ServerSettings(result_retention_sec=0, status_change_grace_sec=0)
        assert (settings.result_retention_sec, settings.status_change_grace_sec) == (0, 0)

    def test_shutdown_timeouts_must_be_shutdown_timeouts(self) -> None:
        """shutdown_timeouts of another type is a TypeError naming it."""
        with pytest.raises(TypeError, match="shutdown_timeouts must be a ShutdownTimeouts"):
            ServerSettings(shutdown_timeouts={"drain_sec": 1.0})  # type: ignore[arg-type]

    def test_frozen_and_keyword_only(self) -> None:
        """Settings cannot be changed in place (attrs.evolve makes a new, validated one)
        and take keywords only."""
        settings = ServerSettings()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            settings.max_body_bytes = 1  # type: ignore[misc]
        with pytest.raises(TypeError):
            ServerSettings(30.0)  # type: ignore[call-arg]
        with pytest.raises(ServerConfigError, match="max_body_bytes"):
            attrs.evolve(settings, max_body_bytes=0)

    def test_the_app_factory_keywords_default_to_the_settings_defaults(self) -> None:
        """Every setting is a keyword of create_rollout_server() whose default is the
        field's (None standing for ShutdownTimeouts())."""
        parameters = inspect.signature(create_rollout_server).parameters
        defaults = ServerSettings()
        for field in attrs.fields(ServerSettings):
            default = parameters[field.name].default
            expected = getattr(defaults, field.name)
            assert (ShutdownTimeouts() if default is None else default) == expected, field.name


class TestSettingsArgument:
    def test_the_app_factory_takes_settings(self, scripted: Any) -> None:
        """create_rollout_server(settings=...) serves with those settings."""
        settings = ServerSettings(
            result_wait_timeout_sec=2, polling_lease_timeout_sec=9, max_body_bytes=1024
        )
        server = create_rollout_server(backend=scripted(), settings=settings)[ROLLOUT_SERVER_KEY]
        assert server.settings is settings
        assert (server.result_wait_timeout_sec, server.max_body_bytes) == (2, 1024)

    def test_keywords_build_the_same_settings(self, scripted: Any) -> None:
        """The per-setting keywords build the settings object the server keeps."""
        app = create_rollout_server(
            backend=scripted(), status_change_grace_sec=0, access_log=True, metrics=False
        )
        server = app[ROLLOUT_SERVER_KEY]
        assert server.settings == ServerSettings(
            status_change_grace_sec=0, access_log=True, metrics=False
        )
        assert server.metrics is None

    def test_settings_and_a_keyword_are_refused_together(self, scripted: Any) -> None:
        """A setting's keyword (not at its default) and settings= cannot both be given."""
        with pytest.raises(
            ServerConfigError,
            match=r"result_wait_timeout_sec and settings= both given; pass one of them",
        ):
            create_rollout_server(
                backend=scripted(), settings=ServerSettings(), result_wait_timeout_sec=5
            )

    def test_settings_must_be_server_settings(self, scripted: Any) -> None:
        """settings= of another type is a TypeError."""
        with pytest.raises(TypeError, match="settings must be a ServerSettings; got dict"):
            create_rollout_server(backend=scripted(), settings={})  # type: ignore[arg-type]

    def test_the_server_takes_settings_or_its_keywords(self, scripted: Any) -> None:
        """RolloutServer builds its settings from its keywords, validated as the app
        factory's are, or takes settings= as given."""
        settings = ServerSettings(polling_lease_timeout_sec=300)
        assert RolloutServer(backend=scripted(), settings=settings).settings is settings
        server = RolloutServer(backend=scripted(), result_wait_timeout_sec=5, max_body_bytes=10)
        assert server.settings == ServerSettings(result_wait_timeout_sec=5, max_body_bytes=10)
        with pytest.raises(ServerConfigError, match="result_wait_timeout_sec must be > 0"):
            RolloutServer(backend=scripted(), result_wait_timeout_sec=0)


class TestCommandOptions:
    def test_every_setting_has_exactly_one_option(self) -> None:
        """Each ServerSettings field (each shutdown bound for shutdown_timeouts) is set by
        exactly one serve option."""
        fields = [
            f"shutdown_timeouts.{stage.name}" if field.name == "shutdown_timeouts" else field.name
            for field in attrs.fields(ServerSettings)
            for stage in (
                attrs.fields(ShutdownTimeouts) if field.name == "shutdown_timeouts" else [field]
            )
        ]
        assert sorted(option.field for option in SERVER_OPTIONS) == sorted(fields)

    def test_options_build_the_settings(self) -> None:
        """The options given set their fields; the others keep the defaults, but for the
        state: the command's default is a file per port (memory: with --port 0)."""
        args = build_parser().parse_args(
            [
                "serve",
                "m:a",
                "--result-wait-timeout-sec",
                "2",
                "--max-body-bytes",
                "1000",
                "--collect-timeout-sec",
                "0",
                "--access-log",
                "--no-metrics",
            ]
        )
        assert server_settings(args) == ServerSettings(
            result_wait_timeout_sec=2.0,
            max_body_bytes=1000,
            shutdown_timeouts=ShutdownTimeouts(collect_sec=0.0),
            access_log=True,
            metrics=False,
            state=default_state_url(args.port),
        )
        plain = build_parser().parse_args(["serve", "m:a"])
        assert server_settings(plain) == ServerSettings(state=default_state_url(plain.port))
        assert server_settings(plain).state.endswith(f"/rollout/state/serve-{plain.port}.db")
        for argv in (["--port", "0"], ["--state", "memory:"]):
            chosen = build_parser().parse_args(["serve", "m:a", *argv])
            assert server_settings(chosen) == ServerSettings()


class TestStateSetting:
    def test_the_state_url_is_validated_and_normalised(self, scripted: Any) -> None:
        assert ServerSettings().state == "memory:"
        assert ServerSettings(state="SQLITE:////var/x.db").state == "sqlite:///var/x.db"
        with pytest.raises(ServerConfigError, match="unknown scheme 'redis'"):
            ServerSettings(state="redis://h/0")
        with pytest.raises(ServerConfigError, match="absolute"):
            create_rollout_server(backend=scripted(), state="sqlite://relative.db")
