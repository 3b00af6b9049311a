"""The model gateway (``--gateway``): each rollout's own OpenAI-compatible base URL, which
forwards its model calls to a model endpoint (the request's ``chat_completions_url``, or
one of the server's ``--model-endpoint`` URLs chosen by consistent hashing with bounded
loads on the rollout's group) and records every chat completion as a turn: the messages,
the answer, its token ids and logprobs, the weights' version, flags for what was missing.

It owns the gateway's listener, its routes and the capture of answers; the server opens a
route per rollout through the :class:`~rollout_server.ModelRouter`
interface it implements, so nothing below it knows it exists: execution sees a base URL on
the rollout's context and the turns it captured. It may import aiohttp, ``execution`` (for
that interface), ``observability`` and the shared top-level modules; never ``state``,
``protocol``, ``http``, ``cli`` or ``ray`` (import-linter checks it).
"""
