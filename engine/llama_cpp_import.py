"""Import llama-cpp-python's ctypes binding without its high-level API.

``llama_cpp/__init__.py`` runs ``from .llama import *``, so any ``import llama_cpp.<module>``
also loads the ``Llama`` class and what it imports: its chat formats, ``diskcache`` and with
it ``sqlite3``. The server uses only ``llama_cpp.llama_cpp`` (the ctypes functions) and
``llama_cpp.llama_grammar`` (the JSON-schema converter); the rest is ~4 MiB of RSS for
nothing (docs/performance.md, "RSS on Gemma: the interpreter's floor").

:func:`defer_package_init` puts a stand-in for the package in ``sys.modules``: submodules
import from the package's directory as before, and the package's own ``__init__`` runs the
first time something asks the package itself for a name (``llama_cpp.Llama``,
``llama_cpp.__version__``, ``from llama_cpp import Llama``). A process that never asks never
pays for it; one that does gets the package as it always was.
"""
from __future__ import annotations

import importlib.util
import sys
import types

PACKAGE = "llama_cpp"


class _DeferredPackage(types.ModuleType):
    """The package module, its ``__init__`` not yet run."""

    def __getattr__(self, name: str):
        # Reached only for names not in the module's dict: run __init__ once, then look again.
        if name.startswith("__") and name != "__version__":
            raise AttributeError(name)
        state = self.__dict__
        if not state.get("_init_ran"):
            state["_init_ran"] = True
            with open(state["__file__"], encoding="utf-8") as f:
                source = f.read()
            exec(compile(source, state["__file__"], "exec"), state)
        try:
            return state[name]
        except KeyError:
            raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}") from None


def defer_package_init() -> bool:
    """Stand in for ``llama_cpp`` until its ``__init__`` is needed. True when the stand-in is
    in place (now or before); False when the package is already imported or not installed."""
    current = sys.modules.get(PACKAGE)
    if current is not None:
        return isinstance(current, _DeferredPackage)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return False
    package = _DeferredPackage(PACKAGE)
    package.__file__ = spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = PACKAGE
    package.__spec__ = spec
    package.__loader__ = spec.loader
    sys.modules[PACKAGE] = package
    return True
