"""A simulated CUDA runtime (libcudart 12.4, 12.8 or 13.0) over host memory and threads.

Call it exactly like the cffi ``lib`` of the generated declarations:
out-pointers are the caller's cdata, handles are pointer cdata (or ints),
return values are ``cudaError_t`` codes.  :func:`open_library` returns the
lib-like object; ``accel.sim`` re-exports the configuration, fault injection
and state inspection shared with the other simulators.

Semantics chosen where CUDA leaves room (see also ``accel/sim/__init__.py``):

* Every call except cudaGetErrorName/String, cudaGetLastError/PeekAtLastError
  and cudaRuntime/DriverGetVersion initializes the runtime (including
  cudaGetDeviceCount, as in real CUDA).  Without a driver (``driver=False``)
  or with no visible device, those calls return cudaErrorInsufficientDriver /
  cudaErrorNoDevice (cudaGetDeviceCount also writes 0).
* CUDA_VISIBLE_DEVICES is read once, at runtime initialization: indices and
  ``GPU-`` UUID prefixes; parsing stops at the first invalid, unknown or
  ambiguous entry; a repeated device makes the list empty; "" hides all.
* Streams are in-order queues run by worker threads (``_engine``).  The
  legacy default stream of each device (handles 0 and cudaStreamLegacy) waits
  for all earlier work of the device's blocking streams, and blocking
  streams wait for earlier legacy work; cudaStreamNonBlocking streams do
  neither.  cudaStreamPerThread is a blocking stream per host thread and device.
* Events record a point in a stream; waits capture the record current at
  the time of the wait.  Timing events stamp ``perf_counter_ns`` when the
  point is reached.
* cudaFree / cudaFreeHost first wait for the device's (all devices') queued
  work, as the real calls synchronize, so no queued copy touches freed memory.
* A Python exception in a reference kernel (or a copy touching freed memory)
  is a device fault: the process gets a sticky error (cudaErrorIllegalAddress
  for out-of-range memory, else cudaErrorLaunchFailure) that every later
  runtime call, on any device and thread, returns (cudaDeviceReset included;
  only a new process, or ``accel.sim.reset()``, recovers); the traceback is
  printed to stderr and kept in ``accel.sim.state().errors``.
* Stream capture follows the programming guide's rules (see ``_capture_*``);
  prohibited calls return the vendor code and invalidate the capture, and
  cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated with a
  NULL graph.  Pageable-memory copies during capture are refused
  (cudaErrorStreamCaptureUnsupported).  External events (cudaEventRecordExternal,
  cudaEventWaitExternal) become event record / event wait nodes: each launch records
  the event, or waits for its record current at the launch (see ``_event_plan``).
* Versions (``Config.runtime_version`` / ``driver_version``): the library exposes exactly
  the cuda* functions the real libcudart of that version exports (``cudart_symbols/``,
  written by tools/cudart_exports.py) that are simulated here; a driver older than the
  runtime's major version makes every initializing call return cudaErrorInsufficientDriver.
  Module images (PTX, cubin, fatbin) are read by ``_cuda_images``; the driver entry points
  (cudaGetDriverEntryPoint) hand out the callbacks of ``cuda_driver``.
* Strictness rules (launch device, peer access, sticky errors, unsafe calls
  during capture, recycled handles, fork after init, shared-memory opt-in,
  context memory) are listed with their citations in ``accel/sim/README.md``.
* Graph replay runs the captured nodes in capture order (a topological
  order) as one operation on the launch stream, with the argument values
  captured at record time.

The package, one concern a module, each call beside the vendor rules it follows: ``state``
(error codes, the objects behind handles, the Runtime and its start/reset/fork), ``common``
(out-pointers, handle lookup, the capture rules every call obeys, queueing), ``devices``,
``memory``, ``copies``, ``streams``, ``events``, ``graphs`` (capture, instantiate, launch),
``graph_memory``, ``pools`` and ``mempool`` (the stream-ordered allocator), ``modules``
(images, kernels, entry points, launches).  This module builds the library object.
"""

from __future__ import annotations

from typing import Dict

from .. import _memory, core
from . import copies, devices, events, graph_memory, graphs, memory, mempool, modules, state, streams
from .devices import _NO_CONTEXT, _NO_INIT
from .modules import (function_attributes, kernel_of, launch, load_image, module_call_in_capture, ptx_entries,
                      unload)
from .state import Event, Graph, GraphExec, Library, Stream, _accounted, context_reserved, runtime, visible_ordinals

#: What the other simulators (cuda_driver, nvml) and the tests use; the rest is in the modules.
__all__ = ["context_reserved", "device_used_bytes", "exported_symbols", "function_attributes", "kernel_of",
           "launch", "load_image", "module_call_in_capture", "open_library", "ptx_entries", "runtime", "unload",
           "visible_ordinals"]


def __getattr__(name: str):
    # The runtime object is created on first use and replaced by a reset: read it live.
    if name == "_R":
        return state._R
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the library object ----------------------------------------------------------------------

#: Every simulated cuda* entry point, by name, from the modules that define them.
_FUNCTIONS = {name: obj for module in (devices, memory, copies, streams, events, graphs, graph_memory, mempool,
                                       modules)
              for name, obj in vars(module).items()
              if name.startswith("cuda") and callable(obj) and obj.__module__ == module.__name__
              and name not in _NO_INIT}


_RT = """\
        next(_box[0])
        R = _R
        if R is None:
            R = _start()
        if _faults and _name in _faults:
            _rc = _take(_name)
            if _rc:
                R.tls.last_error = _rc
                return _rc
        if R.init_error and _check_init:
            _rc = R.init_error
        else:
            if _needs_context:
                R.devices[R.tls.device].context = True
            _rc = _fn(R, {args})
        if _rc and _rc != 600:
            R.tls.last_error = _rc
        return _rc
"""
_RT_BODY = core.deferred_body(_RT)   # signals deferred for the call (core: "atomic for Python signal handlers")
#: Queries that change nothing (their runtime is started by then): a handler stopping one
#: midway leaves what stopping it before the call leaves, so they skip the ~1.4 us of deferral.
_READ_ONLY = frozenset(("cudaGetDevice", "cudaStreamQuery", "cudaEventQuery", "cudaPeekAtLastError"))


def _wrap(name: str, fn):
    # Every runtime entry point: count, initialize the runtime on first use,
    # injected faults, "no driver/no device", cudaGetLastError bookkeeping.
    return core.exact_wrapper(name, fn, _RT if name in _READ_ONLY else _RT_BODY, vars(state), skip=1,
                              _box=core.counter_box(name),
                              _faults=core._faults, _take=core.take_fault, _name=name, _fn=fn,
                              _check_init=name != "cudaGetDeviceCount", _needs_context=name not in _NO_CONTEXT,
                              **core.deferral_cells())


def _wrap_any(name: str, fn):
    if name in _NO_INIT:
        return core.counted(name, fn)
    return _wrap(name, fn)


_libs: Dict[int, core.SimLibrary] = {}


def exported_symbols(runtime_version: int) -> frozenset:
    """The cuda* functions the real libcudart of ``runtime_version`` exports
    (accel/sim/cudart_symbols/<major>.<minor>.txt, written by tools/cudart_exports.py)."""
    from importlib import resources
    name = f"{runtime_version // 1000}.{runtime_version % 1000 // 10}.txt"
    text = resources.files("accel.sim").joinpath("cudart_symbols").joinpath(name).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def open_library() -> core.SimLibrary:
    """The simulated libcudart of the configured runtime version: the functions that real
    library exports and this module simulates (OSError like a missing library when configured absent)."""
    cfg = core.config()
    soname = "libcudart.so.12" if cfg.runtime_version < 13000 else "libcudart.so.13"
    if not cfg.cudart:
        raise core.library_not_found("cudart", soname)
    lib = _libs.get(cfg.runtime_version)
    if lib is None:
        exported = exported_symbols(cfg.runtime_version)
        functions = {k: v for k, v in {**_NO_INIT, **_FUNCTIONS}.items() if k in exported}
        # the bindings of this runtime's major (accel._ffi.cudart_module): what a caller
        # declares, so a declared function this version lacks fails as in cffi
        module = "_cudart12" if cfg.runtime_version < 13000 else "_cudart"
        try:
            declared = __import__("accel._ffi." + module, fromlist=["FUNCTIONS"]).FUNCTIONS
        except ImportError:
            declared = ()
        lib = _libs.setdefault(cfg.runtime_version, core.build_library(
            "cudart", functions, constants=core.constants_of(module), wrap=_wrap_any, declared=declared))
    return lib


def _state() -> dict:
    R = state._R
    out = {"runtime_initialized": R is not None}
    if R is None:
        out.update(live_allocations={}, live_bytes={}, peak_bytes={}, host_allocations=0, host_bytes=0,
                   streams=0, events=0, graphs=0, graph_execs=0, captures=0, errors=[], modules=0,
                   jit_compiles=0, vmm_reservations=0, vmm_reserved_bytes=0, vmm_handles=0,
                   vmm_physical_bytes=0, vmm_mappings=0, vmm_mapped_bytes=0)
        return out
    allocs, nbytes = {}, {}
    host_n = 0
    for a in R.mem.all():
        if a.kind == _memory.DEVICE:
            allocs[a.device] = allocs.get(a.device, 0) + 1
            nbytes[a.device] = nbytes.get(a.device, 0) + _accounted(a.size)
        else:
            host_n += 1
    uniq = lambda table, cls: len({id(v) for v in table.values() if v.__class__ is cls})
    out.update(live_allocations=allocs, live_bytes=nbytes,
               peak_bytes={d.index: d.peak for d in R.devices},
               host_allocations=host_n, host_bytes=R.host_bytes,
               streams=uniq(R.streams, Stream), events=uniq(R.events, Event), graphs=uniq(R.graphs, Graph),
               graph_execs=uniq(R.execs, GraphExec), captures=len(R.captures), errors=list(R.errors),
               modules=uniq(R.libraries, Library), jit_compiles=R.jit_compiles,
               visible_devices=[d.physical for d in R.devices],
               primary_contexts=[d.context for d in R.devices], **R.vmm.stats())
    return out


core.on_state("cudart", _state)


def device_used_bytes(physical: int) -> int:
    """Device memory in use on simulated *physical* device ``physical`` (NVML's view: the
    context's reservation plus cudaMalloc'd bytes; 0 before the runtime starts)."""
    R = state._R
    if R is None:
        return 0
    return sum(d.used + d.reserved for d in R.devices if d.physical == physical)
