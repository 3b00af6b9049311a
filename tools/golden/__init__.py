"""The parts of ``tools/capture_golden.py``: live osmosis-ai peers recorded on the wire.

``capture_golden.py`` is the command line; this package holds what it runs, one module per
responsibility:

* ``inputs``: the fixed inputs, placeholders and source labels every capture shares;
* ``user_code``: the workflow, grader and backend the osmosis-ai servers serve;
* ``recording``: the ASGI recorder and the uvicorn server it runs behind;
* ``writer``: scrubbing random values and writing the payload files and ``index.json``;
* ``current_cases``: the tables of terminal outcomes and raw error requests (0.3.8);
* ``current_servers``: the four recorded 0.3.8 servers and the raw-HTTP driver;
* ``current``: the 0.3.8 scenarios, in their capture order;
* ``legacy``: the 0.3.2 (callback protocol) scenarios, run in a child interpreter.

It imports osmosis-ai, so it runs only in an osmosis-ai venv (see the script's docstring),
with ``tools/`` on ``sys.path`` (the script's folder).
"""
