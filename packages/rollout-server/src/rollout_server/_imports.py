"""Resolve ``"module.path:Attr"`` import strings, the way users name workflows and graders."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["resolve_import_string"]


def resolve_import_string(spec: str, *, what: str) -> Any:
    """Import the object an import string names.

    Args:
        spec: ``"package.module:Attr"``; the attribute part may be dotted
            (``"module:Outer.Inner"``).
        what: What the string configures (``"workflow"``, ``"grader_config"``...), for the
            error messages.

    Returns:
        The named object.

    Raises:
        ValueError: When ``spec`` is not of the form ``module:attr``.
        ImportError: When the module cannot be imported or has no such attribute.
    """
    module_name, sep, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise ValueError(
            f"{what} import string {spec!r} must look like 'package.module:Attr' "
            "(a module path, a colon, and the attribute to load from it)"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"cannot import module {module_name!r} named by {what} {spec!r}: {exc}; check the "
            "spelling and that the module is on sys.path (run from the project directory, or "
            "install it)"
        ) from exc
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
