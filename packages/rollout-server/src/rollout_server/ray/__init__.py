""":class:`~rollout_server.RayBackend`: rollouts on a pool of long-lived async Ray actors,
each running :class:`~rollout_server.LocalBackend`'s phases on its node. The backend, the pool
that starts, watches and replaces workers, the dispatch bookkeeping, and the worker actor.

It is the only subpackage that imports ``ray`` (lazily, when a RayBackend starts), and it
builds on ``execution`` exactly as a third-party backend would. It may import ``execution``,
``observability`` and the shared top-level modules; never ``state``, ``protocol``, ``http`` or
``cli`` (import-linter checks it).
"""
