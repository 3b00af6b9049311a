"""Resolve what users name by ``"module.path:Attr"``: serve targets, workflows, graders and
their configs.

:func:`resolve_import_string` is the one resolver of import strings (``LocalBackend``'s
arguments and ``rollout-server serve MODULE:ATTR``); :func:`resolve_class` and
:func:`resolve_config` check that what a LocalBackend argument names is what it must be.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Mapping
from typing import Any, Final, TypeVar

from ._config import BaseConfig

__all__ = ["MISSING_MODULE_HINT", "resolve_class", "resolve_config", "resolve_import_string"]

_C = TypeVar("_C", bound=BaseConfig)

MISSING_MODULE_HINT: Final = (
    "it is not on sys.path; check the spelling, and run from the project directory or install it"
)
"""How :func:`resolve_import_string` says to fix a module that does not exist."""


def resolve_import_string(
    spec: str, *, what: str, missing_module_hint: str = MISSING_MODULE_HINT
) -> Any:
    """Import the object an import string names.

    Args:
        spec: ``"package.module:Attr"`` (MODULE:ATTR); the attribute part may be dotted
            (``"module:Outer.Inner"``). Spaces around either part are ignored.
        what: What the string names (``"workflow"``, ``"target"``...), for the error
            messages.
        missing_module_hint: What the error says when the module does not exist (where it
            was looked for and how to fix that); default :data:`MISSING_MODULE_HINT`.

    Returns:
        The named object.

    Raises:
        ValueError: When ``spec`` is not of the form ``module:attr``.
        ImportError: When the module does not exist, its code raises while it is
            imported (a missing dependency, a bug), or it has no such attribute. The
            first two chain the error raised; a missing attribute chains nothing.
    """
    module_name, sep, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise ValueError(
            f"{what} import string {spec!r} must look like 'package.module:Attr' "
            "(MODULE:ATTR: a module path, a colon, and the attribute to load from it)"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (
            module_name == exc.name or module_name.startswith(exc.name + ".")
        ):
            raise ImportError(
                f"cannot import module {module_name!r} named by {what} {spec!r}: "
                + missing_module_hint
            ) from exc
        raise _import_failed(module_name, what, spec, exc) from exc
    except Exception as exc:
        raise _import_failed(module_name, what, spec, exc) from exc
    walked = module_name
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ImportError(
                f"{walked!r} has no attribute {part!r} (from {what} {spec!r}); check the "
                "attribute name after the colon"
            ) from None
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    return target


def _import_failed(module_name: str, what: str, spec: str, exc: Exception) -> ImportError:
    return ImportError(
        f"importing module {module_name!r} named by {what} {spec!r} failed: "
        f"{type(exc).__name__}: {exc}"
    )


def resolve_class(value: object, base: type[Any], what: str) -> type[Any]:
    """The concrete subclass of ``base`` that ``value`` is or names.

    Args:
        value: A class, or an import string naming one.
        base: The class it must derive from (``AgentWorkflow``, ``Grader``).
        what: The argument's name, for the error messages.

    Raises:
        ValueError, ImportError: As :func:`resolve_import_string`.
        TypeError: When it is not a subclass of ``base``, is abstract, or is an instance.
    """
    if isinstance(value, str):
        value = resolve_import_string(value, what=what)
    if isinstance(value, type) and issubclass(value, base):
        if inspect.isabstract(value):
            abstract: frozenset[str] = getattr(value, "__abstractmethods__", frozenset())
            missing = ", ".join(f"{name}()" for name in sorted(abstract))
            raise TypeError(f"{what} {value.__qualname__} is abstract: implement {missing}")
        return value
    if isinstance(value, base):
        raise TypeError(
            f"{what} must be a class, not an instance: pass {type(value).__qualname__} "
            "itself (a fresh instance is created for every rollout)"
        )
    raise TypeError(
        f"{what} must be a subclass of {base.__name__} or an import string "
        f"'module:Attr' naming one; got {value!r}"
    )


def resolve_config(value: Any, cls: type[_C], what: str) -> _C | None:
    """The config that ``value`` is, holds (a mapping) or names; None stays None.

    Args:
        value: A ``cls`` instance, a mapping for ``cls.from_mapping``, an import string
            naming either, or None.
        cls: The config class.
        what: The argument's name, for the error messages.

    Raises:
        ValueError, ImportError: As :func:`resolve_import_string`, or from the mapping.
        TypeError: When it is not a config, or cannot be deep-copied (each rollout gets its
            own copy).
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = resolve_import_string(value, what=what)
    if isinstance(value, Mapping):
        value = cls.from_mapping(value)
    if not isinstance(value, cls):
        raise TypeError(
            f"{what} must be a {cls.__name__}, a mapping, or an import string 'module:Attr' "
            f"naming one; got {value!r}"
        )
    try:
        copy.deepcopy(value)
    except Exception as exc:
        raise TypeError(
            f"{what} must be deep-copyable (each rollout gets its own copy): {exc}"
        ) from exc
    return value
