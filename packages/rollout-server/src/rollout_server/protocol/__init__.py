"""The rollout protocol without HTTP: :class:`~rollout_server.RolloutServer` (admission,
leases, polls, cancellation, health) and its :class:`~rollout_server.ServerSettings`, the
execution task that runs a backend for one admitted rollout and publishes its result, the
cancellation policy, the staged shutdown, the recovery of a restart on durable state, the
Prometheus metrics that observe all of it, and the capture of model turns (a route per
rollout through a model router, the turns in the results of callers that ask for them).

It joins the two layers below it, ``state`` (what the server knows about each rollout) and
``execution`` (the backend interface and its implementations), which never import each other.
It may import those, ``observability`` and the shared top-level modules; it never imports
aiohttp, ``http``, ``cli`` or ``ray`` (import-linter checks it).
"""
