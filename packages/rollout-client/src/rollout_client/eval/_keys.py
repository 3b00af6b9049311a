"""API keys that remember the environment variable they were read from, so that a message
about a rejected key can name the variable (``rollout-eval run`` reads every key that way)."""

from __future__ import annotations

__all__ = ["EnvKey", "describe_key"]


class EnvKey(str):
    """An API key read from the environment variable ``env_name``; otherwise a plain ``str``.

    Args:
        value: The key.
        env_name: The variable that held it (``--server-api-key-env NAME``).
    """

    env_name: str

    def __new__(cls, value: str, *, env_name: str) -> EnvKey:
        key = super().__new__(cls, value)
        key.env_name = env_name
        return key

    def __repr__(self) -> str:
        return f"EnvKey(env_name={self.env_name!r})"  # never the key itself


def describe_key(key: str, option: str) -> str:
    """Name a key for a message: ``the key in $NAME`` for an :class:`EnvKey`, else
    ``the key given as OPTION`` (``option`` names the field or flag that carried it)."""
    if isinstance(key, EnvKey):
        return f"the key in ${key.env_name}"
    return f"the key given as {option}"
