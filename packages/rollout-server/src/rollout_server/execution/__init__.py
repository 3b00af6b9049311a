"""Running rollouts: the backend interface (:class:`~rollout_server.ExecutionBackend` and its
request, result and outcome types), :class:`~rollout_server.LocalBackend` with its phases
(workflow, then grader), workflow and grader classes, the per-rollout context, slot admission
and concurrency limits, artifacts directories, ATIF trajectories and the file offloader, and
the classification of user-code exceptions into error categories, and the seam a model
gateway implements (a route per rollout: the base URL its workflow calls, the turns captured
there).

It owns how one rollout runs, never how it is admitted, polled or answered. It may import
``observability`` and the shared top-level modules only: never ``state``, ``protocol``, ``http``
or aiohttp (import-linter checks it), so a backend can be tested and reused without a server.
"""
