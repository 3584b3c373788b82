"""Backend registry and selection.

Which runtime serves this process: ``ACCEL_BACKEND`` if set (``cuda``,
``xpu``, ``mps``); else the backend named by ``ACCEL_SIM`` (the simulator);
else the first of cuda, xpu, mps whose library loads and reports a device.
Selection only counts devices, so it never initializes a runtime.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from typing import Dict, Optional, Tuple

from .._locks import held
from .base import Backend, DeviceProperties

__all__ = ["Backend", "DeviceProperties", "NAMES", "get", "select", "fallback", "started_drivers", "reset"]

NAMES = ("cuda", "xpu", "mps")
_MODULES = {"cuda": ".cuda", "xpu": ".xpu", "mps": ".mps"}

_lock = threading.Lock()
_instances: Dict[str, Backend] = {}
_selected: Optional[Backend] = None
_selected_done = False


def get(name: str) -> Backend:
    """The (process-wide) backend object for ``name``; constructing it opens nothing."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(NAMES)}")
    backend = _instances.get(name)
    if backend is None:
        with held(_lock, f"loading the {name} backend"):
            backend = _instances.get(name)
            if backend is None:
                module = importlib.import_module(_MODULES[name], __name__)
                backend = _instances[name] = module.create()
    return backend


def _requested() -> Optional[str]:
    name = os.environ.get("ACCEL_BACKEND") or os.environ.get("ACCEL_SIM")
    if not name:
        return None
    name = name.strip().lower()
    if name not in NAMES:
        raise ValueError(
            f"ACCEL_BACKEND/ACCEL_SIM={name!r} is not a backend; expected one of {', '.join(NAMES)}")
    return name


def _safe_count(backend: Backend) -> int:
    """count() for probing: a broken runtime must not hide the others."""
    try:
        return backend.count()
    except Exception as exc:  # count() should never raise; say so instead of failing selection
        warnings.warn(f"accel: counting {backend.name} devices failed ({exc!r}); treating it as 0",
                      RuntimeWarning, stacklevel=3)
        return 0


def select() -> Optional[Backend]:
    """The backend this process uses, or None when no runtime reports a device.

    With ``ACCEL_BACKEND``/``ACCEL_SIM`` set, that backend is returned even
    when it has no device, so errors and ``python -m accel`` can say why.  A
    backend found is kept for the process; finding none is not, so the next
    call counts again.
    """
    global _selected, _selected_done
    if _selected_done:
        return _selected
    with held(_lock, "backend selection"):
        if _selected_done:
            return _selected
    requested = _requested()
    if requested is not None:
        chosen = get(requested)
    else:
        chosen = None
        for name in NAMES:
            backend = get(name)
            if _safe_count(backend) > 0:
                chosen = backend
                break
    if chosen is not None:
        # Nothing found is not kept: before init a count follows CUDA_VISIBLE_DEVICES and
        # friends as they are now (r82c: widening the variable after a count of 0 kept 0)
        with held(_lock, "backend selection"):
            _selected, _selected_done = chosen, True
    return chosen


def fallback() -> Optional[Backend]:
    """The backend whose runtime errors explain a missing device: the selected
    one, else the first whose library loads, else None."""
    chosen = select()
    if chosen is not None:
        return chosen
    for name in NAMES:
        backend = get(name)
        try:
            if backend.loads():
                return backend
        except Exception:  # as _safe_count: probing never fails the caller
            continue
    return None


def started_drivers() -> Tuple[Backend, ...]:
    """Backends whose driver this process started (``Backend.driver_started``) and that
    would serve it: the selected one once selection ran, else any.  Reads attributes
    only, so fork handlers may call it."""
    if _selected_done:
        candidates = (_selected,) if _selected is not None else tuple(_instances.values())
    else:
        candidates = tuple(_instances.values())
    return tuple(b for b in candidates if b is not None and b.driver_started)


def _fresh_lock_in_child() -> None:
    # A thread of the parent may have been inside selection (holding the lock) when another
    # forked; the child, which may still initialize when the parent did not, gets a free lock,
    # and free counting locks in each backend (the parent's thread may have been counting).
    global _lock
    _lock = threading.Lock()
    for backend in list(_instances.values()):
        try:
            backend.fresh_locks_in_child()
        except Exception:   # noqa: BLE001 (an at-fork hook must not raise)
            pass


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def reset() -> None:
    """Forget backend objects and the selection (tests switch simulators with this)."""
    global _selected, _selected_done
    with held(_lock, "backend selection"):
        _instances.clear()
        _selected, _selected_done = None, False
