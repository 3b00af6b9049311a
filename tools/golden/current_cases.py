"""The tables of the 0.3.8 capture: each terminal outcome the osmosis client reaches, and
each error body the main server answers to a raw request."""

from __future__ import annotations

import json
from typing import Any

from .inputs import WRONG_LEASE, init_body

TERMINAL_OUTCOMES: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    (
        "result_success_remove_sample.json",
        "golden-remove-sample",
        {"metadata": {"grader": "remove_sample"}},
        "Grader set reward 0.7 and remove_sample=true: success with reward nulled.",
    ),
    (
        "result_success_ungraded.json",
        "golden-ungraded",
        {"grade": False},
        "grade=false: success with the workflow sample and reward null.",
    ),
    (
        "result_failure_validation_error.json",
        "golden-value-error",
        {"metadata": {"workflow": "value_error"}},
        "Workflow raised ValueError: failure/validation_error, no sample.",
    ),
    (
        "result_failure_agent_error.json",
        "golden-agent-error",
        {"metadata": {"workflow": "runtime_error"}},
        "Workflow raised RuntimeError: failure/agent_error, no sample.",
    ),
    (
        "result_failure_timeout.json",
        "golden-timeout",
        {"metadata": {"workflow": "sleep", "seconds": 30}, "agent_timeout_sec": 0.5},
        "agent_timeout_sec=0.5 hit by a sleeping workflow: failure/timeout.",
    ),
    (
        "result_failure_grader_timeout.json",
        "golden-grader-timeout",
        {"metadata": {"grader": "sleep", "seconds": 30}, "grader_timeout_sec": 0.5},
        "grader_timeout_sec=0.5 hit: failure/timeout with the sample, reward null.",
    ),
    (
        "result_failure_no_reward.json",
        "golden-no-reward",
        {"metadata": {"grader": "no_reward"}},
        "Grader returned without a reward: failure/validation_error with sample.",
    ),
    (
        "result_failure_internal_error.json",
        "golden-internal-error",
        {"metadata": {"workflow": "crash"}},
        "Backend raised a BaseException subclass: the task crashed and the server "
        "published failure/internal_error (0.3.6+).",
    ),
)
"""(file, rollout id, run_rollout arguments besides the label, description) of each
terminal outcome the osmosis client reaches on the main server."""

ERROR_CASES: tuple[tuple[str, str, str, dict[str, Any], str], ...] = (
    (
        "error_409.json",
        "POST",
        "/rollout",
        {"json": init_body("golden-minimal")},
        "Re-admitting an id whose result is retained.",
    ),
    (
        "error_403.json",
        "GET",
        "/rollout/golden-minimal/result",
        {"headers": {"X-Osmosis-Rollout-Lease": WRONG_LEASE}},
        "Known id, wrong lease token.",
    ),
    (
        "error_404.json",
        "GET",
        "/rollout/golden-unknown/result",
        {"headers": {"X-Osmosis-Rollout-Lease": WRONG_LEASE}},
        "Unknown rollout id (any token).",
    ),
    (
        "error_404_unknown_route.json",
        "GET",
        "/nothing",
        {},
        "A path no route matches.",
    ),
    (
        "error_405.json",
        "GET",
        "/rollout",
        {},
        "Wrong method on an existing route (FastAPI adds an Allow header).",
    ),
    (
        "error_422_missing_header.json",
        "GET",
        "/rollout/golden-minimal/result",
        {},
        "Poll without the X-Osmosis-Rollout-Lease header.",
    ),
    (
        "error_422_empty_header.json",
        "GET",
        "/rollout/golden-minimal/result",
        {"headers": {"X-Osmosis-Rollout-Lease": ""}},
        "Poll with an empty X-Osmosis-Rollout-Lease header.",
    ),
    (
        "error_422_rollout_id.json",
        "POST",
        "/rollout",
        {"json": init_body("bad/id")},
        "rollout_id with a path separator.",
    ),
    (
        "error_422_rollout_id_type.json",
        "POST",
        "/rollout",
        {"json": {**init_body("golden-number-id"), "rollout_id": 7}},
        "rollout_id sent as a JSON number (not coerced).",
    ),
    (
        "error_422_llm_api_key.json",
        "POST",
        "/rollout",
        {"json": init_body("golden-empty-key", llm_api_key="")},
        "llm_api_key set to the empty string.",
    ),
    (
        "error_422_missing_fields.json",
        "POST",
        "/rollout",
        {"json": {}},
        "Admission body without the three required keys.",
    ),
    (
        "error_422_json_invalid.json",
        "POST",
        "/rollout",
        {
            "content": b'{"rollout_id": ',
            "headers": {"Content-Type": "application/json"},
        },
        "Undecodable JSON body.",
    ),
    (
        "error_422_empty_body.json",
        "POST",
        "/rollout",
        {"content": b"", "headers": {"Content-Type": "application/json"}},
        "An empty request body.",
    ),
    (
        "error_422_text_plain.json",
        "POST",
        "/rollout",
        {
            "content": json.dumps(init_body("golden-text-plain")),
            "headers": {"Content-Type": "text/plain"},
        },
        "A valid JSON object sent as text/plain is not parsed as JSON.",
    ),
    (
        "error_422_body_not_object.json",
        "POST",
        "/rollout",
        {"json": [1, 2, 3]},
        "A JSON body that is not an object.",
    ),
    (
        "error_422_cancel_selector.json",
        "POST",
        "/rollout/cancel",
        {"json": {"ids": ["golden-minimal"], "prefix": None, "all": True}},
        "Two cancel selectors at once: 422 with a string detail.",
    ),
    (
        "error_422_cancel_no_selector.json",
        "POST",
        "/rollout/cancel",
        {"json": {"ids": None, "prefix": None, "all": False}},
        "No cancel selector: 422 with a string detail.",
    ),
    (
        "error_422_cancel_list_type.json",
        "POST",
        "/rollout/cancel",
        {"json": {"ids": "golden-minimal"}},
        "ids of the wrong JSON type.",
    ),
    (
        "error_500_nonfinite_timeout.json",
        "POST",
        "/rollout",
        {
            "content": json.dumps(init_body("golden-nan", agent_timeout_sec=float("nan"))),
            "headers": {"Content-Type": "application/json"},
        },
        "agent_timeout_sec as the non-standard NaN literal: osmosis fails to "
        "encode its own 422 and answers 500 text/plain.",
    ),
)
"""(file, method, path, httpx arguments, description) of each error body the main server
answers to a raw request."""
