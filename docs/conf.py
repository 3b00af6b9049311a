"""Sphinx configuration of the API reference (``nox -s docs`` builds it into ``docs/_build``).

The reference is rendered from the docstrings of the installed distributions. Each page
documents one distribution's public modules through their ``__all__`` (never a private
module). The build runs with ``-W --keep-going -n``: every cross-reference must resolve.
There is no intersphinx (the build has no network), so references to the standard
library and to third-party packages are listed in ``nitpick_ignore_regex``, scoped to
those packages; references to our own objects must resolve, and a private module path in
an annotation (``rollout_server._app.RolloutServer``) resolves to the public name it is
exported as, which autodoc records as its canonical name.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

project = "rollout"
author = "the rollout authors"
copyright = "the rollout authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build", "*.md"]
html_theme = "alabaster"
html_static_path: list[str] = []

autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
python_use_unqualified_type_names = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False  # "Returns: The report: ..." is prose, not a type
napoleon_use_ivar = True  # "Attributes:" as fields: the attributes are documented as members

nitpicky = True
EXTERNAL_PACKAGES = (
    "_asyncio",
    "abc",
    "aiohttp",
    "asyncio",
    "collections",
    "contextlib",
    "enum",
    "os",
    "pathlib",
    "time",
)
"""Packages (the standard library's, aiohttp) whose objects our annotations and docstrings
name: without intersphinx (the build has no network) they cannot link, so their references
are ignored; add a package here when a new annotation names it. Builtins (``int``,
``ValueError``, ...) need no entry: Sphinx knows them."""
nitpick_ignore_regex = [
    (r"py:.*", rf"(?:{'|'.join(EXTERNAL_PACKAGES)})\..+"),
]

PRIVATE_TYPES_IN_SIGNATURES = (
    "Classified",
    "LazyDirectory",
    "Refusal",
    "RunClient",
    "ServerTracing",
    "T",
)
"""Private classes (and a TypeVar) that public signatures name: not exported, so not
documented and not linkable. Matched by name in any of our modules, so that moving a
private module does not break the build; every other name of ours must resolve."""
nitpick_ignore_regex.append(
    (
        r"py:class",
        rf"rollout_(?:types|client|server)(?:\.\w+)*\.(?:{'|'.join(PRIVATE_TYPES_IN_SIGNATURES)})",
    )
)

PUBLIC_MODULES = (
    "rollout_types",
    "rollout_client",
    "rollout_client.eval",
    "rollout_client.testing",
    "rollout_server",
)
PLAIN_VALUES = (bool, int, float, str, tuple, frozenset)
"""Constants whose value the reference shows (of others, e.g. the converter, only the type)."""


def _ours(obj: object) -> bool:
    """Whether ``obj`` was defined in one of our packages."""
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in ("rollout_types", "rollout_client", "rollout_server")


def _exported(cls: type) -> bool:
    """Whether ``cls`` is one of the names of a public module's ``__all__``."""
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        if cls.__name__ in module.__all__ and getattr(module, cls.__name__) is cls:
            return True
    return False


def _directive(module: str, name: str) -> list[str]:
    """The autodoc directive that documents ``module.name`` (a name of its ``__all__``)."""
    obj = getattr(importlib.import_module(module), name)
    target = f"{module}.{name}"
    if isinstance(obj, type):
        kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
        lines = [f".. {kind}:: {target}"]
        # Members a public class inherits from a private base of ours are part of its API.
        private_bases = [b for b in obj.__mro__[1:] if _ours(b) and not _exported(b)]
        if private_bases:
            skipped = {b.__name__ for b in obj.__mro__[1:] if b not in private_bases}
            lines.append(f"   :inherited-members: {', '.join(sorted(skipped))}")
        return lines
    if inspect.isroutine(obj):
        return [f".. autofunction:: {target}"]
    lines = [f".. autodata:: {target}"]
    if name == "__version__" or not isinstance(obj, PLAIN_VALUES):
        lines.append("   :no-value:")
    return lines


class PublicApi(SphinxDirective):
    """``.. public-api:: package``: the package's docstring, then each name of its
    ``__all__`` documented through the package (never through a private module)."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module = self.arguments[0]
        lines = [f".. automodule:: {module}", "   :no-members:", ""]
        for name in importlib.import_module(module).__all__:
            lines += [*_directive(module, name), ""]
        return self.parse_text_to_nodes("\n".join(lines))


def _public_bases(
    app: Sphinx, name: str, obj: object, options: dict[str, Any], bases: list[type]
) -> None:
    """Show a private base of ours as its own bases ("Bases:" links only public classes)."""
    index = 0
    while index < len(bases):
        base = bases[index]
        if _ours(base) and not _exported(base):
            bases[index : index + 1] = [b for b in base.__bases__ if b not in bases]
        else:
            index += 1


def setup(app: Sphinx) -> None:
    app.add_directive("public-api", PublicApi)
    app.connect("autodoc-process-bases", _public_bases)
