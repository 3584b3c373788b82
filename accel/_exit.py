"""Imports inside accel keep working while the interpreter shuts down.

accel imports many modules inside functions (so ``import accel`` stays small and import cycles
stay out of the way).  At exit CPython's ``finalize_modules`` (``Py_FinalizeEx``) sets
``sys.meta_path`` to None, sets every ``sys.modules`` entry to None and then empties the dict, and
only after that collects the objects left in reference cycles, such as a user's object in
``__main__`` whose ``__del__`` closes a Buffer or synchronizes a stream.  An ``import``
statement run then raises ImportError, even for a module loaded long ago, because the module is
no longer in ``sys.modules`` and nothing can find it again.

So the ``atexit`` callback (which runs before ``finalize_modules``) puts a keeper object into
``sys.modules``: not a module, so it is left alone until the dict is emptied, and its
``__del__`` runs then and puts accel's modules, and the standard-library and third-party modules
accel imports inside functions, back.  The collection that follows finds them there, as any import
before exit would have.  Nothing changes before exit.
"""

from __future__ import annotations

import atexit
import sys

_KEY = "accel._exit keeper"
_KEPT = ("accel", "numpy", "cffi", "_cffi_backend")


class _Keeper:
    __slots__ = ("modules",)

    def __init__(self, modules: dict):
        self.modules = modules

    def __del__(self):
        modules = getattr(sys, "modules", None)
        if isinstance(modules, dict):
            for name, module in self.modules.items():
                modules.setdefault(name, module)


def _kept(name: str) -> bool:
    top = name.partition(".")[0]
    stdlib = getattr(sys, "stdlib_module_names", None)       # Python 3.10+; before it, every module
    return top in _KEPT or stdlib is None or top in stdlib


def _install() -> None:
    modules = {k: v for k, v in sys.modules.items() if v is not None and _kept(k)}
    sys.modules[_KEY] = _Keeper(modules)


def keep_imports_at_exit() -> None:
    """Register the atexit callback (``import accel`` does, once)."""
    atexit.unregister(_install)
    atexit.register(_install)
