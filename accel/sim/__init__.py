"""Simulated vendor libraries: run every layer of accel on a machine without a device.

A backend uses the simulator when ``ACCEL_SIM`` names it; it then takes its
library object from :func:`open_library` instead of ``accel._ffi`` and calls
it exactly as it calls the real cffi ``lib`` (same function names, the
caller's cdata out-pointers, the vendor's integer error codes)::

    from accel import sim
    from accel._ffi._cudart import ffi
    lib = sim.open_library("cudart")
    p = ffi.new("cudaStream_t *")
    assert lib.cudaStreamCreateWithPriority(p, lib.cudaStreamNonBlocking, 0) == lib.cudaSuccess

Configuration, read from the environment when a simulated library is first
used: ``ACCEL_SIM_DEVICES`` (default 2), ``ACCEL_SIM_MEMORY`` (bytes per
device, default 8G; "512M", "8G" accepted), ``ACCEL_SIM_CC`` (default "9.0"),
``ACCEL_SIM_DELAY_US`` (latency of each stream operation, default 0),
``ACCEL_SIM_VMM_COST_US`` (time each virtual-memory map and unmap takes, default 0;
see README.md "Virtual memory"),
``ACCEL_SIM_CUDA_RUNTIME`` / ``ACCEL_SIM_CUDA_DRIVER`` (the libcudart version
simulated, 12.4, 12.8 or 13.0, and the CUDA version its driver supports;
default 13.0 for both; several runtimes, ``ACCEL_SIM_CUDA_RUNTIME=12.4,13.0``,
are all "installed" and accel's library choice picks one by the driver
version, then :func:`select_runtime` makes it the one opened).
Tests use :func:`configure`, :func:`inject_error`, :func:`inject_oom`,
:func:`clear_faults`, :func:`state` and :func:`reset`.

Each simulated library lives in its own module with an ``open_library()``
factory; :data:`LIBRARIES` maps the names accepted by :func:`open_library`
to ``"module:factory"``.
"""

from __future__ import annotations

import importlib
import types
from typing import Dict, Optional

from . import core
from .core import Config, clear_faults, configure, inject_error, inject_oom, reset_call_counts, select_runtime

__all__ = ["LIBRARIES", "open_library", "configure", "config", "inject_error", "inject_oom", "clear_faults",
           "state", "calls", "reset_call_counts", "reset", "Config", "select_runtime",
           "register_kernel", "unregister_kernel"]

#: Simulated library name -> "module:factory" (the factory returns the lib-like object).
LIBRARIES: Dict[str, str] = {
    "cudart": "accel.sim.cudart:open_library",
    "nvml": "accel.sim.nvml:open_library",
    "ze": "accel.sim.ze:open_library",
    "objc": "accel.sim.metal:open_library",
}


def open_library(name: str):
    """The simulated library ``name`` ("cudart", "nvml", "ze", "objc"), created on first use.

    Raises OSError, like the real loader, when the configuration says the
    library is not installed (``configure(nvml=False)``), and ValueError for
    a name no simulator provides.
    """
    target = LIBRARIES.get(name)
    if target is None:
        raise ValueError(f"accel.sim has no simulated library {name!r}; expected one of {', '.join(LIBRARIES)}")
    module_name, factory = target.split(":")
    module = importlib.import_module(module_name)
    return getattr(module, factory)()


def register_kernel(name: str, fn, signature, *, replace: bool = False) -> None:
    """Register ``fn`` as the Python reference a simulated launch of kernel ``name`` runs, on
    every simulator (CUDA, Level Zero, Metal).  A real device never calls it.

    ``signature``: the kernel's argument types, ``"ptr, u64, f32"`` or a sequence of those
    names (``ptr``, ``u32``, ``i32``, ``u64``, ``i64``, ``f32``, ``f64``), in the order of the
    kernel's parameters; a launch whose kernel declares other parameters (its PTX ``.entry``)
    is refused.  ``fn(grid, block, view, *args)`` computes the whole launch at once:
    ``grid``/``block`` are ``(x, y, z)``, ``ptr`` arguments arrive as int addresses and
    ``view(ptr, nbytes, dtype=None)`` gives a writable numpy (or memoryview) window on
    simulated memory, range-checked against live allocations::

        def saxpy(grid, block, view, a, x, y, n):
            view(y, 4 * n, "float32")[:] += np.float32(a) * view(x, 4 * n, "float32")

        accel.sim.register_kernel("saxpy", saxpy, "f32, ptr, ptr, u64")

    It runs in the stream's worker, in stream order.  Registering the same function again
    is a no-op; another function under a taken name raises ValueError unless
    ``replace=True``.  (``accel.sim.kernels.register(name, argtypes, fn)`` is the same
    registry.)"""
    from . import kernels
    from .._ptx import parse_signature
    kernels.register(name, parse_signature(signature), fn, replace=replace)


def unregister_kernel(name: str) -> None:
    """Forget the reference of kernel ``name`` (no error when there is none)."""
    from . import kernels
    kernels.unregister(name)


def config() -> Config:
    """The active simulated machine (environment + :func:`configure` overrides)."""
    return core.config()


def state() -> types.SimpleNamespace:
    """A snapshot of the simulators' state, for assertions in tests.

    Fields (CUDA/NVML; other simulators add theirs): ``runtime_initialized``
    (a call that initializes the CUDA runtime happened; cudaGetDeviceCount
    counts, error strings and version queries do not), ``nvml_initialized``
    (NVML init count > 0), ``nvml_init_calls``, ``calls`` ({function: number
    of calls}), ``live_allocations`` / ``live_bytes`` / ``peak_bytes``
    ({runtime device index: ...}; bytes rounded to 256), ``host_allocations``,
    ``host_bytes``, ``streams``, ``events``, ``graphs``, ``graph_execs``,
    ``captures`` (live counts), ``errors`` ([(queue label, traceback)] of
    device faults), ``visible_devices`` (physical ordinals), ``primary_contexts``
    ([bool] per runtime device: its primary context was initialized), ``config``.
    """
    _import_providers()
    fields = core.state_fields()
    fields["calls"] = core.call_counts()
    fields["config"] = core.config()
    return types.SimpleNamespace(**fields)


def calls(name: Optional[str] = None):
    """Calls of vendor function ``name`` since the last reset (all counts without a name)."""
    counts = core.call_counts()
    return counts if name is None else counts.get(name, 0)


def reset() -> None:
    """Drop all simulator state: runtimes, memory, streams (workers stopped),
    NVML init count, faults, call counters and :func:`configure` overrides."""
    core.reset()


def _import_providers() -> None:
    # state() must report cudart/NVML fields even before either was opened.
    from . import cudart, nvml  # noqa: F401


def _register_reset_hook() -> None:
    from .. import _lazy
    _lazy.register_reset_hook(reset)


_register_reset_hook()
