"""The chat-completions stand-in the interop workflow calls, under the test's control.

Every rollout's ``chat_completions_url`` points here (``url_for(rollout_id)``), so a test
knows when a rollout's workflow is running (``await arrived("chat", id)``), decides what
it answers and when (``hold``/``release``), and can hold the grader too (``gate_url``,
passed as ``metadata["grade_gate_url"]``). ``call_tool`` makes it act as a model that
uses the tools it is offered: it calls one before it answers. It runs in the test's event
loop on 127.0.0.1, port 0.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any, Final

from aiohttp import web

DEFAULT_ANSWER: Final = "4"


class ChatStandIn:
    """An OpenAI-style ``/chat/completions`` endpoint and grading gates, per rollout id."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        self._answers: dict[str, str] = {}
        self._tools: dict[str, tuple[str, dict[str, Any]]] = {}
        self._held: dict[tuple[str, str], asyncio.Event] = {}
        self._arrivals: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self.requests: list[dict[str, Any]] = []

    async def start(self) -> None:
        """Serve on 127.0.0.1, port 0."""
        app = web.Application()
        app.router.add_post("/v1/rollouts/{rid}/chat/completions", self._chat)
        app.router.add_post("/gates/{rid}", self._gate)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"

    async def close(self) -> None:
        """Release every held request and stop serving."""
        for event in self._held.values():
            event.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def url_for(self, rollout_id: str) -> str:
        """The ``chat_completions_url`` to send for ``rollout_id``."""
        return f"{self.base_url}/v1/rollouts/{rollout_id}"

    def gate_url(self, rollout_id: str) -> str:
        """The grading gate of ``rollout_id`` (``metadata["grade_gate_url"]``)."""
        return f"{self.base_url}/gates/{rollout_id}"

    def answer(self, rollout_id: str, text: str) -> None:
        """Make the completion for ``rollout_id`` answer ``text`` (default ``"4"``)."""
        self._answers[rollout_id] = text

    def call_tool(self, rollout_id: str, name: str, arguments: dict[str, Any]) -> None:
        """Make ``rollout_id``'s completions call tool ``name`` with ``arguments`` first.

        A request that offers tools and whose last message is not a ``tool`` result gets an
        assistant message with that one tool call; the others get the answer.
        """
        self._tools[rollout_id] = (name, arguments)

    def hold(self, kind: str, rollout_id: str) -> None:
        """Hold ``kind`` (``"chat"`` or ``"gate"``) requests of ``rollout_id`` until released."""
        self._held[(kind, rollout_id)] = asyncio.Event()

    def release(self, kind: str, rollout_id: str) -> None:
        """Let held ``kind`` requests of ``rollout_id`` answer."""
        self._held.setdefault((kind, rollout_id), asyncio.Event()).set()

    async def arrived(self, kind: str, rollout_id: str, *, timeout_sec: float = 30.0) -> None:
        """Wait until a ``kind`` request of ``rollout_id`` has arrived (bounded)."""
        async with asyncio.timeout(timeout_sec):
            await self._arrivals[(kind, rollout_id)].wait()

    async def _wait_if_held(self, kind: str, rollout_id: str) -> None:
        self._arrivals[(kind, rollout_id)].set()
        held = self._held.get((kind, rollout_id))
        if held is not None:
            await held.wait()

    async def _chat(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info["rid"]
        body = await request.json()
        self.requests.append(
            {"rollout_id": rollout_id, "body": body, "auth": request.headers.get("Authorization")}
        )
        await self._wait_if_held("chat", rollout_id)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self._answers.get(rollout_id, DEFAULT_ANSWER),
        }
        tool = self._tools.get(rollout_id)
        last = (body.get("messages") or [{}])[-1]
        answered = isinstance(last, dict) and last.get("role") == "tool"
        if tool is not None and body.get("tools") and not answered:
            name, arguments = tool
            call_id = f"call-{rollout_id}-{len(self.requests)}"
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            ]
        return web.json_response(
            {
                "id": f"chatcmpl-{rollout_id}",
                "object": "chat.completion",
                "model": "interop",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "tool_calls" if "tool_calls" in message else "stop",
                        "message": message,
                    }
                ],
            }
        )

    async def _gate(self, request: web.Request) -> web.Response:
        await self._wait_if_held("gate", request.match_info["rid"])
        return web.json_response({})
