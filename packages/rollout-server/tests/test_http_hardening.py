"""Bad requests and slow peers, over raw sockets on 127.0.0.1: what aiohttp cannot parse,
bodies that never finish or do not decode, headers that never finish, and ids too long to
poll. Nothing quotes request bytes, nothing is a 500, and peers cannot flood the log."""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from typing import Any

import pytest
from aiohttp import web

from rollout_server import create_rollout_server
from rollout_types import PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER

EVENT_SEC = 10.0
SECRET = "sk-SECRET-4242"


class Response:
    """One HTTP/1.x response read off a raw socket."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.headers} {self.body[:300]!r}>"


def parse_responses(raw: bytes) -> list[Response]:
    """Every response in ``raw`` (each with a Content-Length, as the server sends them)."""
    responses = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        responses.append(Response(int(status_line.split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return responses


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(EVENT_SEC):
            return await reader.read()
    finally:
        writer.close()


def init_bytes(rollout_id: str = "r1") -> bytes:
    """A ``POST /rollout`` body carrying an ``llm_api_key``."""
    return json.dumps(
        {
            "rollout_id": rollout_id,
            "initial_messages": [],
            "chat_completions_url": "http://127.0.0.1:9/v1",
            "llm_api_key": SECRET,
        }
    ).encode()


def post(body: bytes, *headers: str, length: int | None = None) -> bytes:
    """A raw ``POST /rollout`` with ``body``, extra header lines and a Content-Length."""
    lines = [
        "POST /rollout HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(body) if length is None else length}",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def assert_json_400(response: Response) -> str:
    """The response is our short JSON 400 with the protocol header; return its detail."""
    assert response.status == 400, response
    assert response.headers["content-type"] == "application/json", response
    assert response.headers[PROTOCOL_VERSION_HEADER.lower()] == PROTOCOL_VERSION
    detail: str = response.json()["detail"]
    assert detail.startswith("bad HTTP request: "), detail
    return detail


def logged_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record as text, tracebacks included."""
    formatter = logging.Formatter("%(levelname)s %(name)s %(message)s")
    return "\n".join(formatter.format(record) for record in caplog.records)


class TestUnparsableRequests:
    @pytest.mark.parametrize(
        "raw",
        [
            pytest.param(post(init_bytes(), length=20), id="content-length-shorter-than-body"),
            pytest.param(
                b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + SECRET.encode()
                + b"\x00x\r\n\r\n",
                id="authorization-with-nul",
            ),
            pytest.param(
                b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + SECRET.encode()
                + b"\x7f\r\n\r\n",
                id="authorization-with-del",
            ),
            pytest.param(
                b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + SECRET.encode()
                + b"a" * 9000
                + b"\r\n\r\n",
                id="authorization-over-8190-bytes",
            ),
        ],
    )
    async def test_the_400_is_short_json_and_neither_it_nor_the_log_quotes_the_request(
        self, harness: Any, caplog: pytest.LogCaptureFixture, raw: bytes
    ) -> None:
        """A request aiohttp cannot parse gets a JSON 400 with the protocol header that
        never quotes request bytes (the key stays out of it), logged once at WARNING
        without the bytes and without an ERROR or a traceback."""
        with caplog.at_level(logging.DEBUG):
            answer = await exchange(harness.client.port, raw)
        assert SECRET.encode() not in answer
        assert_json_400(parse_responses(answer)[-1])
        text = logged_text(caplog)
        assert SECRET not in text
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], text
        assert not [r for r in caplog.records if r.exc_info], text
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert [r.name for r in warnings] == ["rollout_server.http"], text
        assert warnings[0].getMessage().startswith("Refused a bad HTTP request: ")

    async def test_a_long_line_names_the_limit(self, harness: Any) -> None:
        """A header line over the limit is refused with the limit in the detail."""
        raw = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
        detail = assert_json_400(parse_responses(await exchange(harness.client.port, raw))[-1])
        assert "limit of 8190 bytes" in detail

    async def test_a_flood_of_bad_requests_is_one_warning(
        self, make_harness: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Twenty malformed requests from an unauthenticated peer to a server with an API
        key log one WARNING (the rest at DEBUG) and never an ERROR."""
        harness = await make_harness(api_key="k-1")
        with caplog.at_level(logging.DEBUG):
            for _ in range(20):
                answer = await exchange(harness.client.port, b"BAD\x01 / HTTP/1.1\r\n\r\n")
                assert_json_400(parse_responses(answer)[-1])
        records = [r for r in caplog.records if r.name == "rollout_server.http"]
        assert [r.levelno for r in records].count(logging.WARNING) == 1
        assert [r.levelno for r in records].count(logging.DEBUG) == 19
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    async def test_a_runner_of_the_users_own_gives_the_same_answer(self, scripted: Any) -> None:
        """Served by a plain web.AppRunner of the user's (as web.run_app does), the app
        answers unparsable requests with the same JSON 400."""
        app = create_rollout_server(backend=scripted())
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            answer = await exchange(port, post(init_bytes(), length=20))
        finally:
            await runner.cleanup()
        assert SECRET.encode() not in answer
        assert_json_400(parse_responses(answer)[-1])


class TestReadTimeouts:
    async def test_unfinished_headers_close_the_connection(
        self, make_harness: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A request whose headers stop halfway is cut off after header_read_timeout_sec,
        with one WARNING."""
        harness = await make_harness(header_read_timeout_sec=0.3)
        with caplog.at_level(logging.WARNING, logger="rollout_server.http"):
            answer = await exchange(harness.client.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert answer == b""
        assert caplog.messages == [
            "Closed a connection whose request headers did not arrive within 0.3 s (from 127.0.0.1)"
        ]

    async def test_trickled_headers_do_not_reset_the_timer(self, make_harness: Any) -> None:
        """Headers sent a byte at a time are bounded by the timeout from their first byte,
        however often bytes keep coming."""
        harness = await make_harness(header_read_timeout_sec=0.3)
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.client.port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\n")
            async with asyncio.timeout(EVENT_SEC):
                while not reader.at_eof():
                    writer.write(b"X")
                    await writer.drain()
                    try:
                        async with asyncio.timeout(0.05):
                            assert await reader.read() == b""
                    except TimeoutError:
                        continue
        except ConnectionError:
            pass  # closed while we wrote: just as good
        finally:
            writer.close()

    async def test_idle_connections_and_long_polls_outlive_the_header_timeout(
        self, make_harness: Any
    ) -> None:
        """A keep-alive connection idle for longer than the header timeout still serves
        its next request, and a long poll longer than it is answered in full."""
        harness = await make_harness(header_read_timeout_sec=0.2, result_wait_timeout_sec=1.0)
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", harness.client.port)
        try:
            poll = await harness.poll("r1", token)  # waits 1 s: the idle connection's clock
            assert (poll.status, poll.json["status"]) == (200, "running")
            idle_writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            await idle_writer.drain()
            async with asyncio.timeout(EVENT_SEC):
                status_line = await idle_reader.readline()
            assert status_line.startswith(b"HTTP/1.1 200 ")
        finally:
            idle_writer.close()

    async def test_an_unfinished_body_gets_408_and_the_connection_closes(
        self, make_harness: Any
    ) -> None:
        """A body that stops short of its Content-Length gets a JSON 408 naming the
        timeout and the option, after body_read_timeout_sec, and the connection closes."""
        harness = await make_harness(body_read_timeout_sec=0.3)
        answer = await exchange(harness.client.port, post(init_bytes()[:10], length=500))
        (response,) = parse_responses(answer)
        assert response.status == 408
        assert response.headers[PROTOCOL_VERSION_HEADER.lower()] == PROTOCOL_VERSION
        assert "within 0.3 s" in response.json()["detail"]
        assert "--body-read-timeout-sec" in response.json()["detail"]
        assert harness.backend.runs == {}

    @pytest.mark.parametrize("name", ["header_read_timeout_sec", "body_read_timeout_sec"])
    @pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "5"])
    def test_bad_timeouts_are_refused(self, scripted: Any, name: str, bad: Any) -> None:
        """The read timeouts must be finite numbers of seconds above 0."""
        with pytest.raises(ValueError, match=name):
            create_rollout_server(backend=scripted(), **{name: bad})


class TestUnreadableBodies:
    @pytest.mark.parametrize("encoding", ["gzip", "deflate"])
    async def test_a_body_that_does_not_decode_is_400(
        self, harness: Any, caplog: pytest.LogCaptureFixture, encoding: str
    ) -> None:
        """Garbage under Content-Encoding gzip or deflate gets a JSON 400 saying so, and no
        ERROR is logged."""
        with caplog.at_level(logging.DEBUG):
            answer = await exchange(
                harness.client.port,
                post(b"0123456789 not compressed", f"Content-Encoding: {encoding}"),
            )
        (response,) = parse_responses(answer)
        assert response.status == 400, response
        assert "Content-Encoding" in response.json()["detail"]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], logged_text(caplog)

    async def test_a_body_that_decodes_is_admitted(self, harness: Any) -> None:
        """A gzip body that does decode is read as usual."""
        compress = zlib.compressobj(wbits=31)
        body = compress.compress(init_bytes()) + compress.flush()
        answer = await exchange(
            harness.client.port,
            post(body, "Content-Encoding: gzip", "Connection: close"),
        )
        assert parse_responses(answer)[0].status == 202

    async def test_a_body_that_breaks_off_is_never_a_500(
        self, harness: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A peer that sends half a body and closes its side gets no 500 and logs no
        ERROR."""
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.client.port)
        try:
            with caplog.at_level(logging.DEBUG):
                writer.write(post(init_bytes()[:10], length=500))
                await writer.drain()
                writer.write_eof()
                async with asyncio.timeout(EVENT_SEC):
                    answer = await reader.read()
                await harness.health()  # the server goes on serving
        finally:
            writer.close()
        assert b" 500 " not in answer
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], logged_text(caplog)


class TestPollableIds:
    @pytest.mark.parametrize(
        ("rollout_id", "encoded"),
        [
            pytest.param("x" * 100_000, 100_000, id="100000-ascii"),
            pytest.param("界" * 1000, 9000, id="1000-cjk"),
            pytest.param("a" * 8162, 8162, id="one-over"),
        ],
    )
    async def test_an_id_whose_result_url_cannot_be_polled_is_refused(
        self, harness: Any, body: Any, rollout_id: str, encoded: int
    ) -> None:
        """An id whose percent-encoded result path would not fit the request line gets 422
        with the limit in the message, and is never admitted."""
        reply = await harness.post_rollout(body(rollout_id))
        assert reply.status == 422, reply
        (entry,) = reply.json["detail"]
        assert entry["loc"] == ["body", "rollout_id"]
        assert f"percent-encoded it is {encoded} characters" in entry["msg"]
        assert "request line limit of 8190 bytes, which allows at most 8161" in entry["msg"]
        assert harness.backend.runs == {}

    async def test_the_longest_id_that_fits_is_admitted_and_polled(self, harness: Any) -> None:
        """An id exactly at the limit (8161 characters once percent-encoded) is admitted
        and its result URL can be polled."""
        rollout_id = "a" * 8161
        token = await harness.admit(rollout_id)
        (await harness.backend.started(rollout_id)).succeed()
        reply = await harness.poll_until(rollout_id, token, "success")
        assert reply.json["rollout_id"] == rollout_id


def counted(harness: Any, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` in the server's metrics (None: absent)."""
    value: float | None = harness.server.metrics.registry.get_sample_value(name, labels)
    return value


class TestRefusalsInMetrics:
    async def test_an_unparsable_request_counts_as_refused_before_routing(
        self, harness: Any
    ) -> None:
        """A request aiohttp cannot parse counts under ``rollout_http_refusals_total``
        with reason ``bad_request``, and not as an admission."""
        answer = await exchange(
            harness.client.port, b"POST /rollout HTTP/1.1\r\nHost: x\r\nX-A: b\x00c\r\n\r\n"
        )
        assert_json_400(parse_responses(answer)[-1])
        assert counted(harness, "rollout_http_refusals_total", reason="bad_request") == 1
        assert counted(harness, "rollout_http_refusals_total", reason="header_timeout") == 0
        assert counted(harness, "rollout_admissions_total", code="400") == 0

    async def test_unfinished_headers_count_as_a_header_timeout(self, make_harness: Any) -> None:
        """A connection closed because its headers never finished counts under reason
        ``header_timeout``."""
        harness = await make_harness(header_read_timeout_sec=0.3)
        assert await exchange(harness.client.port, b"POST /rollout HTTP/1.1\r\nHost: x\r\n") == b""
        assert counted(harness, "rollout_http_refusals_total", reason="header_timeout") == 1

    async def test_a_late_body_counts_as_an_admission_answered_408(self, make_harness: Any) -> None:
        """An admission whose body missed body_read_timeout_sec counts under code 408."""
        harness = await make_harness(body_read_timeout_sec=0.3)
        answer = await exchange(harness.client.port, post(init_bytes()[:10], length=500))
        assert parse_responses(answer)[0].status == 408
        assert counted(harness, "rollout_admissions_total", code="408") == 1

    async def test_an_undecodable_body_counts_as_an_admission_answered_400(
        self, harness: Any
    ) -> None:
        """An admission whose body does not decode counts under code 400."""
        answer = await exchange(
            harness.client.port, post(b"not compressed", "Content-Encoding: gzip")
        )
        assert parse_responses(answer)[0].status == 400
        assert counted(harness, "rollout_admissions_total", code="400") == 1
