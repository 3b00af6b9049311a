"""Fixed inputs, placeholders and source labels shared by every capture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOOLS_DIR = Path(__file__).resolve().parents[1]
SCRIPT_PATH = TOOLS_DIR / "capture_golden.py"
"""The command line, which the 0.3.8 run re-runs under the 0.3.2 interpreter."""
REPO_ROOT = TOOLS_DIR.parent
DEFAULT_GOLDEN_ROOT = REPO_ROOT / "packages" / "rollout-types" / "tests" / "data" / "golden"
CURRENT_VERSION = "0.3.8"
LEGACY_VERSION = "0.3.2"

# Placeholders: same shape as the random originals (43-char base64url, UUID4).
GOLDEN_LEASE_TOKEN = "GoldenLeaseToken_0123456789-abcdefghijklmno"  # noqa: S105 (placeholder)
GOLDEN_UUID = "00000000-0000-4000-8000-000000000000"
GOLDEN_LOOPBACK_BASE = "http://127.0.0.1:50000"
assert len(GOLDEN_LEASE_TOKEN) == 43

# Fixed inputs. None of these reach a real LLM: the workflows never dial it.
FAKE_BRIDGE_BASE = "http://127.0.0.1:9/v1/rollouts"
GOLDEN_SERVER_KEY = "golden-server-api-key"  # bearer for the auth-enabled server
GOLDEN_LLM_KEY = "golden-llm-api-key"
GOLDEN_CONTROLLER_KEY = "golden-controller-key"  # 0.3.2 callback bearer
WRONG_LEASE = "not-the-lease-token"
RESULT_WAIT_SEC = 1.0
POLLING_LEASE_SEC = 3.0
RETENTION_SEC = 60.0
LEGACY_CHILD_TIMEOUT_SEC = 90.0

PROMPT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 6 * 7?"},
]
LABEL = "42"

RESPONSE_HEADERS = ("content-type", "retry-after", "allow", "www-authenticate", "location")
REQUEST_HEADERS = ("content-type", "accept", "authorization", "x-osmosis-rollout-lease")

LOGGER_NAME = "capture_golden"
"""The logger every part logs to (``--verbose`` sets it to DEBUG)."""

CLIENT = "osmosis RolloutClient 0.3.8"
RAW = "raw httpx, body written by this tool"
SERVER = "osmosis-ai 0.3.8 server (create_rollout_server + LocalBackend) on uvicorn"
LEGACY_CALLER = "osmosis HttpRolloutDriver 0.3.2"
LEGACY_SERVER = "osmosis-ai 0.3.2 server (create_rollout_server + LocalBackend) on uvicorn"


def chat_url(rollout_id: str) -> str:
    """The OpenAI-style base URL a caller hands out for one rollout."""
    return f"{FAKE_BRIDGE_BASE}/{rollout_id}"


def init_body(rollout_id: str, **overrides: Any) -> dict[str, Any]:
    """A full admission body in the shape the osmosis client sends."""
    body: dict[str, Any] = {
        "initial_messages": PROMPT,
        "label": LABEL,
        "metadata": None,
        "rollout_id": rollout_id,
        "chat_completions_url": chat_url(rollout_id),
        "llm_api_key": None,
        "grade": True,
        "agent_timeout_sec": None,
        "grader_timeout_sec": None,
        "extra_fields": None,
    }
    body.update(overrides)
    return body
