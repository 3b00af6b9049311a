"""The shared shape of workflow and grader configs: name, description, concurrency, extras."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final, Self

import attrs

__all__ = ["BaseConfig", "ConcurrencyConfig"]


def _max_concurrent(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(
            f"concurrency.max_concurrent must be an int of at least 1, or None for no limit; "
            f"got {value!r}"
        )


def _name(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"config name must be a non-empty string; got {value!r}")


def _description(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"config description must be a string or None; got {value!r}")


def _extra(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise TypeError(f"config extra must be a dict with string keys; got {value!r}")


@attrs.frozen(kw_only=True)
class ConcurrencyConfig:
    """How many rollouts may run at once.

    Attributes:
        max_concurrent: The slot count (an int of at least 1), or None (the default) for
            no limit.
    """

    max_concurrent: int | None = attrs.field(default=None, validator=_max_concurrent)


def _concurrency(value: Any) -> ConcurrencyConfig:
    if isinstance(value, ConcurrencyConfig):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {"max_concurrent"}
        if unknown:
            raise ValueError(
                f"concurrency accepts only 'max_concurrent'; unknown keys: {sorted(unknown)}"
            )
        return ConcurrencyConfig(**value)
    raise TypeError(
        f"concurrency must be a ConcurrencyConfig or a mapping like "
        f"{{'max_concurrent': 4}}; got {value!r}"
    )


_RESERVED_EXTRA_KEYS: frozenset[str] = frozenset({"extra"})

_SHARED_ON_COPY: Final[tuple[type, ...]] = (
    str,
    int,
    float,
    bool,
    type(None),
    ConcurrencyConfig,
)
"""Field value types a config's deep copy shares instead of copying: exactly these types
(not subclasses), all immutable."""


_FIELD_NAMES: Final[dict[type, tuple[str, ...]]] = {}
"""The attrs field names of each config class, once looked up."""


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(field.name for field in attrs.fields(cls))
    return names


@attrs.frozen(kw_only=True, init=False)
class BaseConfig:
    """Fields every workflow and grader config has.

    Extra keys are allowed, as keyword arguments or mapping keys: they live in ``extra``
    and read as attributes (``config.temperature``) or with ``config.get("temperature")``.
    For typed settings, subclass with more fields (``@attrs.frozen(kw_only=True)``); such a
    subclass takes its extra keys through :meth:`from_mapping` or the ``extra`` argument.

    Args:
        name: What the workflow or grader is called (non-empty; required).
        description: Free text, or None.
        concurrency: The concurrency settings; a mapping like ``{"max_concurrent": 4}`` is
            converted; None (the default) means no limit.
        extra: Further settings by name (merged with the extra keyword arguments).
        **settings: Further settings by name.

    Raises:
        TypeError: When ``name`` is missing or a value has the wrong type.
        ValueError: When a value is invalid (an empty name, ``max_concurrent`` < 1).
    """

    name: str = attrs.field(validator=_name)
    description: str | None = attrs.field(default=None, validator=_description)
    concurrency: ConcurrencyConfig = attrs.field(factory=ConcurrencyConfig, converter=_concurrency)
    extra: dict[str, Any] = attrs.field(factory=dict, validator=_extra)

    def __init__(
        self,
        *,
        name: str,
        description: str | None = None,
        concurrency: ConcurrencyConfig | Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        data: dict[str, Any] = {"name": name, "description": description, "extra": extra}
        if concurrency is not None:
            data["concurrency"] = concurrency
        known, merged = _split(type(self), {**data, **settings})
        self.__attrs_init__(**known, extra=merged)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Self:
        """Build a config from a mapping (a parsed YAML/JSON/TOML document).

        Keys that are fields of the class fill them; every other key goes to ``extra``.

        Raises:
            ValueError, TypeError: When a field's value is invalid or ``name`` is missing.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__}.from_mapping() needs a mapping; got {data!r}")
        known, extra = _split(cls, data)
        if "name" not in known:
            raise ValueError(f"{cls.__name__} needs a 'name'")
        return cls(**known, extra=extra)

    # Speed: benchmarks/README.md, "LocalBackend: files and copies", row "Config copies share
    #   immutable field values ..."
    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """A deep copy made field by field: immutable values (strings, numbers, None, the
        frozen :class:`ConcurrencyConfig`) are shared, everything else is deep-copied.

        LocalBackend copies the workflow config for every rollout; the generic
        ``copy.deepcopy`` of an attrs class costs tens of microseconds even when nothing
        in it can change.
        """
        cls = type(self)
        new = object.__new__(cls)
        memo[id(self)] = new
        for name in _field_names(cls):
            value = getattr(self, name)
            if type(value) not in _SHARED_ON_COPY:
                value = {} if type(value) is dict and not value else copy.deepcopy(value, memo)
            object.__setattr__(new, name, value)
        state = getattr(self, "__dict__", None)
        if state:  # a subclass without slots may hold more than its fields
            for key, value in copy.deepcopy(state, memo).items():
                object.__setattr__(new, key, value)
        return new

    def get(self, key: str, default: Any = None) -> Any:
        """The extra setting ``key``, or ``default`` when it is absent."""
        return self.extra.get(key, default)

    def __getattr__(self, key: str) -> Any:
        # Called only when normal lookup fails: extra settings read as attributes.
        if key.startswith("_") or key in _RESERVED_EXTRA_KEYS:
            raise AttributeError(key)
        try:
            extra: dict[str, Any] = object.__getattribute__(self, "extra")
        except AttributeError:
            raise AttributeError(key) from None
        try:
            return extra[key]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__} has no field or extra setting {key!r}"
            ) from None


def _split(cls: type[BaseConfig], data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``data`` into the fields of ``cls`` and the extra settings."""
    fields = {field.alias for field in attrs.fields(cls)} - {"extra"}
    known = {key: value for key, value in data.items() if key in fields}
    given_extra = data.get("extra")
    if given_extra is None:
        given_extra = {}
    if not isinstance(given_extra, Mapping):
        raise TypeError(f"config extra must be a mapping with string keys; got {given_extra!r}")
    extra = {key: value for key, value in data.items() if key not in fields and key != "extra"}
    return known, {**dict(given_extra), **extra}
