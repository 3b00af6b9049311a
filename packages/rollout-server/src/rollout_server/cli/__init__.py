"""The ``rollout-server`` command: argument parsing, logging set-up, ``serve`` on uvloop,
signal handling and the exit codes.

It owns nothing a library user calls: it builds a server through the same app factory
(:func:`rollout_server.create_rollout_server`) a user would. It is the top layer and may import
every other subpackage; nothing in ``rollout_server`` imports it.
"""
