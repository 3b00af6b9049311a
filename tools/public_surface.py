"""The public surface of the three distributions as JSON data, and the comparison of two.

The surface is what a user of a release can reach without a private name: each public
module's ``__all__``; for each name its signature (parameter names, kinds, positions and
defaults; annotations are left out); for each public class its public bases, methods,
properties, class attributes and protocol dunders (``__aenter__``, ``__await__``, ...), its
enum members and its attrs fields; and the option sets of the console scripts (each
subcommand's options: their strings, action, ``nargs``, choices and whether required).

Values that differ between processes or module layouts are normalised: memory addresses
are dropped, objects of our own packages are named by their qualified name without their
(private) module path, and sets are sorted.

``tests/surface/test_public_surface.py`` compares HEAD's surface with the snapshot of 0.2.0
that this script wrote (``--write``), with the sources of that release on ``PYTHONPATH``::

    git worktree add /tmp/rel020 f71f6ca
    PYTHONPATH=$(ls -d /tmp/rel020/packages/*/src | paste -sd:) \\
        python tools/public_surface.py --root /tmp/rel020 \\
        --write tests/surface/public_surface_0.2.0.json
    git worktree remove /tmp/rel020

Standard library only (it imports the packages it describes).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import json
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

MODULES = (
    "rollout_types",
    "rollout_client",
    "rollout_client.eval",
    "rollout_client.testing",
    "rollout_server",
)
"""The public modules (each has an ``__all__``)."""
OUR_PACKAGES = ("rollout_types", "rollout_client", "rollout_server")
DISTRIBUTIONS = ("rollout-types", "rollout-client", "rollout-server")
PROTOCOL_DUNDERS = frozenset(
    {
        "__aenter__",
        "__aexit__",
        "__aiter__",
        "__anext__",
        "__await__",
        "__bool__",
        "__call__",
        "__contains__",
        "__enter__",
        "__exit__",
        "__getitem__",
        "__iter__",
        "__len__",
        "__next__",
    }
)
"""Dunder methods that are part of how a class is used (``async with``, ``await``, ...)."""
VARIADIC = ("VAR_POSITIONAL", "VAR_KEYWORD")
PLAIN_DATA = (type(None), bool, int, float, str, enum.Enum, tuple, list, dict, set, frozenset)
"""Types of module constants whose value is part of the surface (of others, only the type)."""
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_OUR_MODULE_PATH = re.compile(
    r"\b(?:rollout_types|rollout_client|rollout_server)(?:\.\w+)*\.(?=\w)"
)

Surface = dict[str, Any]


def _ours(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in OUR_PACKAGES


def _name(obj: Any) -> str:
    """A class's or function's name: bare for ours (modules move), dotted for the rest."""
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    if _ours(obj):
        return qualname
    # Other packages' modules are theirs to rearrange: name only the top-level package.
    return f"{obj.__module__.split('.')[0]}.{qualname}"


def value_text(value: object) -> Any:
    """A default or constant as stable JSON: equal values give equal text in any process."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, type):
        return f"<class {_name(value)}>"
    if inspect.isroutine(value):
        return f"<function {_name(value)}>"
    if isinstance(value, set | frozenset):
        return sorted(json.dumps(value_text(item)) for item in value)
    if isinstance(value, tuple | list):
        return [value_text(item) for item in value]
    if isinstance(value, dict):
        return {str(key): value_text(item) for key, item in value.items()}
    return _OUR_MODULE_PATH.sub("", _ADDRESS.sub("", repr(value)))


def parameters(func: Callable[..., Any], *, skip_first: bool = False) -> Surface | str:
    """Each parameter of ``func``: kind, position (positional ones) and default if any."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return "no signature"
    found: Surface = {}
    params = list(signature.parameters.values())[1 if skip_first else 0 :]
    for index, param in enumerate(params):
        entry: Surface = {"kind": param.kind.name}
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            entry["position"] = index
        if param.default is not param.empty:
            entry["default"] = value_text(param.default)
        found[param.name] = entry
    return found


def _routine(func: Any, kind: str, *, skip_first: bool) -> Surface:
    if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
        kind = f"async {kind}"
    return {"kind": kind, "parameters": parameters(func, skip_first=skip_first)}


def _raw_attribute(cls: type, name: str) -> tuple[type, Any]:
    for owner in cls.__mro__:
        if name in vars(owner):
            return owner, vars(owner)[name]
    raise AttributeError(name)


def _member(cls: type, raw: Any) -> Surface:
    if isinstance(raw, staticmethod):
        return _routine(raw.__func__, "staticmethod", skip_first=False)
    if isinstance(raw, classmethod):
        return _routine(raw.__func__, "classmethod", skip_first=True)
    if isinstance(raw, property):
        return {"kind": "property", "settable": raw.fset is not None}
    if type(raw).__name__ == "cached_property":
        return {"kind": "cached_property"}
    if inspect.isfunction(raw):
        return _routine(raw, "method", skip_first=True)
    if isinstance(raw, cls) and isinstance(raw, enum.Enum):
        return {"kind": "enum member", "value": value_text(raw.value)}
    if inspect.isdatadescriptor(raw):
        return {"kind": "attribute"}
    if isinstance(raw, type):
        return {"kind": "nested class", "name": _name(raw)}
    return {"kind": "class attribute", "value": value_text(raw)}


def _attrs_fields(cls: type) -> Surface | None:
    fields = getattr(cls, "__attrs_attrs__", None)
    if fields is None:
        return None
    found: Surface = {}
    for field in fields:
        entry: Surface = {"init": field.init, "kw_only": field.kw_only}
        default = field.default
        factory = getattr(default, "factory", None)
        if factory is not None:
            entry["default"] = f"Factory({value_text(factory)})"
        elif type(default).__name__ != "_Nothing":
            entry["default"] = value_text(default)
        found[field.name] = entry
    return found


def class_surface(cls: type) -> Surface:
    """The public surface of one class (see the module docstring)."""
    fields = _attrs_fields(cls)
    members: Surface = {}
    for name in dir(cls):
        if (name.startswith("_") and name not in PROTOCOL_DUNDERS) or name in (fields or {}):
            continue
        owner, raw = _raw_attribute(cls, name)
        if _ours(owner):
            members[name] = _member(cls, raw)
    surface: Surface = {
        "kind": "class",
        "bases": {_name(base): True for base in cls.__mro__[1:] if base.__name__[0] != "_"},
        # An enum is not constructed by its users (and EnumType.__call__ varies by Python).
        "constructor": "enum" if issubclass(cls, enum.Enum) else parameters(cls),
        "members": members,
    }
    if fields is not None:
        surface["attrs_fields"] = fields
    return surface


def object_surface(obj: Any) -> Surface:
    """The public surface of one name of an ``__all__``."""
    if isinstance(obj, type):
        return class_surface(obj)
    if inspect.isroutine(obj):
        return _routine(obj, "function", skip_first=False)
    return {"kind": "data", "type": _name(type(obj))}


def module_surface(name: str) -> Surface:
    """Each name of module ``name``'s ``__all__``, described; constants of plain data with
    their value (``__version__``: only its type)."""
    module = importlib.import_module(name)
    described: Surface = {}
    for public in module.__all__:
        obj = getattr(module, public)
        described[public] = object_surface(obj)
        if public != "__version__" and isinstance(obj, PLAIN_DATA):
            described[public]["value"] = value_text(obj)
    return described


class _ParserFound(Exception):  # noqa: N818 (a signal, not an error)
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser found")
        self.parser = parser


def _raise_parser(self: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> NoReturn:
    raise _ParserFound(self)


def command_parser(main: Callable[..., Any]) -> argparse.ArgumentParser:
    """The top-level argparse parser ``main`` builds: caught at its first parse, before
    ``main`` acts on any argument."""
    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = _raise_parser  # type: ignore[method-assign]
    try:
        main([])
    except _ParserFound as found:
        return found.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{main!r} returned without parsing its arguments")


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse._SubParsersAction[Any]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield action


def parser_surface(parser: argparse.ArgumentParser) -> Surface:
    """The options and positionals of ``parser`` and, recursively, of its subcommands."""
    options: Surface = {}
    positionals: Surface = {}
    for action in parser._actions:
        entry: Surface = {
            "action": type(action).__name__.lstrip("_"),
            "nargs": value_text(action.nargs),
            "required": action.required,
            "choices": None if action.choices is None else sorted(map(str, action.choices)),
        }
        if action.option_strings:
            for option in action.option_strings:
                options[option] = entry
        elif not isinstance(action, argparse._SubParsersAction):
            positionals[action.dest] = {**entry, "position": len(positionals)}
    surface: Surface = {"options": options, "positionals": positionals}
    commands = {
        name: parser_surface(sub)
        for action in _subparsers(parser)
        for name, sub in action.choices.items()
    }
    if commands:
        surface["subcommands"] = commands
    return surface


def console_scripts(root: Path) -> dict[str, str]:
    """The ``[project.scripts]`` of the distributions under ``root``/packages."""
    scripts: dict[str, str] = {}
    for distribution in DISTRIBUTIONS:
        pyproject = root / "packages" / distribution / "pyproject.toml"
        project = tomllib.loads(pyproject.read_text("utf-8"))["project"]
        scripts.update(project.get("scripts", {}))
    return scripts


def commands_surface(root: Path) -> Surface:
    """Each console script's option sets, from the entry points its pyproject declares."""
    described: Surface = {}
    for command, target in sorted(console_scripts(root).items()):
        module_name, _, attribute = target.partition(":")
        main = getattr(importlib.import_module(module_name), attribute)
        described[command] = parser_surface(command_parser(main))
    return described


def public_surface(root: Path) -> Surface:
    """The whole surface: the public modules, and the commands declared under ``root``."""
    return {
        "modules": {name: module_surface(name) for name in MODULES},
        "commands": commands_surface(root),
    }


def compare(old: Any, new: Any, path: str = "") -> tuple[list[str], list[str]]:
    """Differences of ``new`` from ``old``: (removals or changes, additions).

    Every key of ``old`` must be in ``new`` with an equal value; keys only in ``new`` are
    additions, except a new parameter without a default (callers of the old signature
    would break), which is a change.
    """
    problems: list[str] = []
    additions: list[str] = []
    if isinstance(old, dict) and isinstance(new, dict):
        for key, value in old.items():
            where = f"{path}.{key}" if path else key
            if key not in new:
                problems.append(f"{where}: removed (was {json.dumps(value, sort_keys=True)})")
                continue
            more_problems, more_additions = compare(value, new[key], where)
            problems += more_problems
            additions += more_additions
        for key in new.keys() - old.keys():
            where = f"{path}.{key}" if path else key
            added = new[key]
            if (
                path.endswith((".parameters", ".constructor"))
                and isinstance(added, dict)
                and "default" not in added
                and added.get("kind") not in VARIADIC
            ):
                problems.append(f"{where}: new parameter without a default")
            else:
                additions.append(where)
    elif old != new:
        problems.append(f"{path}: was {json.dumps(old)}, now {json.dumps(new)}")
    return problems, sorted(additions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="checkout whose pyprojects declare the commands (default: this one)",
    )
    parser.add_argument("--write", type=Path, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    text = json.dumps(public_surface(args.root), indent=1, sort_keys=True) + "\n"
    if args.write:
        args.write.write_text(text, "utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
