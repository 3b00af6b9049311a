"""The one cattrs converter of the protocol, and the helpers that turn its errors into 422s.

Use :data:`converter` (never cattrs' global converter) on both sides:

* unstructuring emits every key, nulls included, as an osmosis-ai 0.3.8 peer expects, except
  the optional keys protocol 1.1 added (:data:`OMITTED_WHEN_DEFAULT`), which are left out
  while they hold their default: a document that uses none of them is byte-for-byte the
  protocol 1.0 document;
* structuring ignores unknown keys, checks JSON types strictly (a number is not a string,
  ``1`` is not a boolean), rejects non-finite numbers and runs the models' validators;
* :func:`structure_wire` turns any failure into :class:`WireValidationError`, whose
  ``errors`` are the protocol's 422 ``detail`` entries with secrets redacted.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar, get_args, get_origin

import cattrs
from cattrs.errors import ClassValidationError, IterableValidationError
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.json import JsonConverter, make_converter

from ._enums import CancelDisposition, RolloutErrorCategory, RolloutStatus, TurnFlag
from ._errors import FieldValueError, WireValidationError
from ._models import RolloutHealth, RolloutInitRequest, RolloutLifecycle, RolloutResultResponse

__all__ = [
    "REDACTED",
    "converter",
    "dumps",
    "is_secret_key",
    "loads",
    "redact",
    "structure_wire",
]

T = TypeVar("T")
Loc = tuple[str | int, ...]

REDACTED: Final = "[redacted]"
"""What stands in a 422 ``input`` for the value of a secret-looking key."""

_SECRET_KEY = re.compile(r"(api[-_]?key|token|secret|password|passwd|authori[sz]ation)", re.I)


class _WireTypeError(TypeError):
    """A JSON value of the wrong type; carries the pydantic-style error ``type``."""

    def __init__(self, type_: str, msg: str) -> None:
        super().__init__(msg)
        self.type = type_
        self.msg = msg


def _strict_str(value: Any, _: Any) -> str:
    if type(value) is not str:
        raise _WireTypeError("string_type", "Input should be a valid string")
    return value


def _strict_bool(value: Any, _: Any) -> bool:
    if type(value) is not bool:
        raise _WireTypeError("bool_type", "Input should be a valid boolean")
    return value


def _strict_int(value: Any, _: Any) -> int:
    if type(value) is not int:
        if type(value) is float and value.is_integer():
            return int(value)
        raise _WireTypeError("int_type", "Input should be a valid integer")
    return value


def _strict_float(value: Any, _: Any) -> float:
    if type(value) not in (int, float):
        raise _WireTypeError("float_type", "Input should be a valid number")
    result = float(value)
    if not math.isfinite(result):
        raise _WireTypeError("finite_number", "Input should be a finite number")
    return result


def _strict_dict(value: Any, _: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _WireTypeError("dict_type", "Input should be a valid dictionary")
    return value


def _is_list_type(type_: Any) -> bool:
    return get_origin(type_) is list


def _strict_list_factory(type_: Any, conv: cattrs.Converter) -> Callable[[Any, Any], list[Any]]:
    (item_type,) = get_args(type_) or (Any,)
    item_hook = conv.get_structure_hook(item_type)

    def structure(value: Any, _: Any) -> list[Any]:
        if type(value) is not list:
            raise _WireTypeError("list_type", "Input should be a valid list")
        result: list[Any] = []
        errors: list[Exception] = []
        for index, item in enumerate(value):
            try:
                result.append(item_hook(item, item_type))
            except Exception as exc:  # noqa: BLE001 - collected, re-raised as a group
                exc.__notes__ = [*getattr(exc, "__notes__", []), _IndexNote(index)]
                errors.append(exc)
        if errors:
            raise IterableValidationError("While structuring a list", errors, type_)
        return result

    return structure


class _IndexNote(str):
    """Note attached to an item's error: the index of the item in its list."""

    position: int

    def __new__(cls, position: int) -> _IndexNote:
        note = super().__new__(cls, f"Structuring list @ index {position}")
        note.position = position
        return note


def _enum_or_raw(enum_type: type[Any]) -> Callable[[Any, Any], Any]:
    values = {member.value: member for member in enum_type}

    def structure(value: Any, _: Any) -> Any:
        if type(value) is not str:
            raise _WireTypeError("string_type", "Input should be a valid string")
        return values.get(value, value)

    return structure


def _enum_strict(enum_type: type[Any]) -> Callable[[Any, Any], Any]:
    values = {member.value: member for member in enum_type}
    expected = ", ".join(repr(v) for v in values)

    def structure(value: Any, _: Any) -> Any:
        if type(value) is not str or value not in values:
            raise _WireTypeError("enum", f"Input should be one of {expected}")
        return values[value]

    return structure


def _register_enum(conv: cattrs.Converter, enum_type: type[Any]) -> None:
    """Strict hooks for the enum; forward-compatible hooks for ``Enum | str [| None]``."""
    raw_hook = _enum_or_raw(enum_type)
    raw_union = enum_type | str
    optional_union = enum_type | str | None

    def optional_hook(value: Any, type_: Any) -> Any:
        return None if value is None else raw_hook(value, type_)

    conv.register_structure_hook(enum_type, _enum_strict(enum_type))
    conv.register_structure_hook_func(lambda t: t == raw_union, raw_hook)
    conv.register_structure_hook_func(lambda t: t == optional_union, optional_hook)


def _is_json_object_type(type_: Any) -> bool:
    return bool(type_ == dict[str, Any])


def _is_any(type_: Any) -> bool:
    return type_ is Any


def _passthrough(value: Any, _: Any) -> Any:
    return value


_HEALTH_KEYS: Final = ("instance_id", "process_id", "lifecycle", "protocol_version")

OMITTED_WHEN_DEFAULT: Final[dict[type[Any], tuple[str, ...]]] = {
    RolloutInitRequest: ("return_turns", "weight_version", "group_id"),
    RolloutResultResponse: ("turns",),
}
"""The keys of protocol 1.1, per model: unstructured only when they differ from their default
(the hooks in ``_make_converter`` name them one by one)."""


def _make_converter() -> JsonConverter:
    conv = make_converter(detailed_validation=True)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook_func(_is_json_object_type, _strict_dict)
    conv.register_structure_hook_func(_is_any, _passthrough)
    conv.register_structure_hook_factory(_is_list_type, _strict_list_factory)
    for enum_type in (RolloutStatus, RolloutErrorCategory, CancelDisposition, TurnFlag):
        _register_enum(conv, enum_type)
    omit = override(omit_if_default=True)
    conv.register_unstructure_hook(
        RolloutInitRequest,
        make_dict_unstructure_fn(
            RolloutInitRequest, conv, return_turns=omit, weight_version=omit, group_id=omit
        ),
    )
    conv.register_unstructure_hook(
        RolloutResultResponse, make_dict_unstructure_fn(RolloutResultResponse, conv, turns=omit)
    )

    # ``/health`` flattens the backend's fields into the top level of the document.
    lifecycle_hook = conv.get_structure_hook(RolloutLifecycle)

    def structure_health(value: Any, _: Any) -> RolloutHealth:
        data = _strict_dict(value, None)
        errors: list[Exception] = []
        fields: dict[str, Any] = {}
        for key, hook in (
            ("instance_id", _strict_str),
            ("process_id", _strict_str),
            ("lifecycle", lifecycle_hook),
        ):
            try:
                fields[key] = hook(data[key], None)
            except Exception as exc:  # noqa: BLE001 - collected, re-raised as a group
                exc.__notes__ = [*getattr(exc, "__notes__", []), _KeyNote(key)]
                errors.append(exc)
        version = data.get("protocol_version")
        if errors:
            raise ClassValidationError("While structuring RolloutHealth", errors, RolloutHealth)
        return RolloutHealth(
            **fields,
            protocol_version=version if isinstance(version, str) else None,
            backend={k: v for k, v in data.items() if k not in _HEALTH_KEYS},
        )

    def unstructure_health(health: RolloutHealth) -> dict[str, Any]:
        return {
            **health.backend,
            "instance_id": health.instance_id,
            "process_id": health.process_id,
            "lifecycle": conv.unstructure(health.lifecycle),
            "protocol_version": health.protocol_version,
        }

    conv.register_structure_hook(RolloutHealth, structure_health)
    conv.register_unstructure_hook(RolloutHealth, unstructure_health)
    return conv


class _KeyNote(str):
    """Note attached to a hand-structured field's error: the key it came from."""

    name: str

    def __new__(cls, name: str) -> _KeyNote:
        note = super().__new__(cls, f"Structuring @ key {name}")
        note.name = name
        return note


converter: Final[JsonConverter] = _make_converter()
"""The converter both sides use for every wire document."""


def is_secret_key(key: object) -> bool:
    """Tell whether a mapping key names a secret (key, token, secret, password, auth)."""
    return isinstance(key, str) and _SECRET_KEY.search(key) is not None


def redact(value: Any) -> Any:
    """Copy ``value`` with every secret-looking key's value replaced by :data:`REDACTED`.

    Non-finite floats become their ``repr`` so the result always encodes as strict JSON.
    """
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if is_secret_key(k) and v is not None else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def _at(data: Any, loc: Sequence[str | int]) -> tuple[bool, Any]:
    """Navigate ``data`` along ``loc``; return (found, value)."""
    for part in loc:
        in_list = isinstance(part, int) and isinstance(data, list) and 0 <= part < len(data)
        in_dict = isinstance(part, str) and isinstance(data, dict) and part in data
        if in_list or in_dict:
            data = data[part]
        else:
            return False, None
    return True, data


def _input_at(data: Any, loc: Sequence[str | int]) -> Any:
    found, value = _at(data, loc)
    if not found:
        return None
    if loc and is_secret_key(loc[-1]) and value is not None:
        return REDACTED
    return redact(value)


def _flatten(exc: BaseException, loc: Loc, data: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(exc, ClassValidationError | IterableValidationError):
        for sub in exc.exceptions:
            _flatten(sub, loc + _note_loc(sub), data, out)
        return
    if isinstance(exc, KeyError):
        # A required key is missing: pydantic echoes the enclosing object.
        out.append(
            {
                "type": "missing",
                "loc": list(loc),
                "msg": "Field required",
                "input": _input_at(data, loc[:-1]),
            }
        )
        return
    if isinstance(exc, FieldValueError):
        field_loc = loc + tuple(int(p) if p.isdigit() else p for p in exc.field.split("."))
        out.append(
            {
                "type": "value_error",
                "loc": list(field_loc),
                "msg": f"Value error, {exc.message}",
                "input": _input_at(data, field_loc),
                "ctx": {"error": {}},
            }
        )
        return
    if isinstance(exc, _WireTypeError):
        out.append(
            {"type": exc.type, "loc": list(loc), "msg": exc.msg, "input": _input_at(data, loc)}
        )
        return
    out.append(
        {
            "type": "value_error",
            "loc": list(loc),
            "msg": f"Value error, {exc}",
            "input": _input_at(data, loc),
            "ctx": {"error": {}},
        }
    )


def _note_loc(exc: BaseException) -> Loc:
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, _IndexNote):
            return (note.position,)
        if isinstance(note, _KeyNote):
            return (note.name,)
        name = getattr(note, "name", None)
        if isinstance(name, str):
            return (name,)
        index = getattr(note, "index", None)
        if isinstance(index, int):
            return (index,)
    return ()


def structure_wire(data: Any, cls: type[T], *, loc: Loc = ("body",)) -> T:
    """Structure a decoded JSON document into ``cls``, or raise the protocol's 422 errors.

    Args:
        data: The decoded JSON value (the whole body).
        cls: The wire model to build.
        loc: The ``loc`` prefix of reported errors; default ``("body",)``.

    Returns:
        The model instance.

    Raises:
        WireValidationError: With one ``detail`` entry per problem; a body that is not an
            object gives ``model_attributes_type`` at ``loc``.
    """
    if type(data) is not dict:
        raise WireValidationError(
            [
                {
                    "type": "model_attributes_type",
                    "loc": list(loc),
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": redact(data),
                }
            ]
        )
    try:
        return converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError, FieldValueError, _WireTypeError) as exc:
        errors: list[dict[str, Any]] = []
        _flatten(exc, (), data, errors)
        for error in errors:
            error["loc"] = [*loc, *error["loc"]]
        raise WireValidationError(errors) from exc


def loads(data: bytes | str) -> Any:
    """Decode a JSON body, or raise the protocol's ``json_invalid`` 422 error.

    ``NaN`` and ``Infinity`` literals decode (Python's parser accepts them) so that the
    model validators can reject them with a clear 422 instead of a crash.
    """
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        position = getattr(exc, "pos", 0) or 0
        raise WireValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ["body", position],
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": getattr(exc, "msg", str(exc))},
                }
            ]
        ) from exc


_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def dumps(obj: Any) -> str:
    """Encode a model (or plain JSON data) as strict, compact JSON.

    Raises:
        ValueError: If the document holds a non-finite number.
        TypeError: If it holds a value JSON cannot encode.
    """
    if hasattr(type(obj), "__attrs_attrs__"):
        obj = converter.unstructure(obj)
    return _ENCODER.encode(obj)
