"""accel.launch: check a launch against the kernel and the device, pack the arguments, queue it.

Argument rules, per parameter type of the kernel (``Kernel.params``):

* ``ptr``: a Buffer, an ArrayView or anything with ``.ptr`` (an int address) and ``.device``
  (an index, a string such as ``"cuda:1"`` or an accel.device; it must be the kernel's device),
  a Python int address (0 .. 2**64-1) or None (NULL).
* ``u64`` (what PTX declares for pointers too): the same objects as ``ptr``, or an int.
* ``u32``/``i32``/``i64``: a Python int within the type's range (``u32``: 0 .. 2**32-1,
  ``i32``: -2**31 .. 2**31-1, ...).  bool (and ``np.bool_``) is refused (pass ``int(flag)``).
* ``f32``/``f64``: a Python float (or subclass) or int (rounded to nearest, as C converts; a
  finite value that would round to inf in float32 is refused).
* numpy scalars: accepted when numpy's ``can_cast(scalar.dtype, param dtype, "safe")`` holds,
  (np.uint16 -> u32, np.float32 -> f64 and np.int32 -> f64 are; np.int32 -> u32 and np.float64
  -> f32 are not: cast first).  numpy counts np.int64/np.uint64 -> f64 as safe, though above
  2**53 the value is rounded.

Every refusal is a TypeError or ValueError naming the kernel, the argument's position and type.
"""

from __future__ import annotations

import operator
import os
from typing import Dict, Tuple

from .. import _lazy, _locks
from .._device import device
from .._errors import AcceleratorError
from ..buffer import Buffer, _begin_use, _end_use
from ..buffer.capture import note_captured
from ..streams import Stream, _Hold, _as_stream, _capture_events, _capture_table, current_stream, on_device
from ._module import Kernel

_RANGES = {"u32": (0, 2 ** 32 - 1), "i32": (-2 ** 31, 2 ** 31 - 1), "u64": (0, 2 ** 64 - 1),
           "i64": (-2 ** 63, 2 ** 63 - 1), "ptr": (0, 2 ** 64 - 1)}
_NUMPY = {"u32": "uint32", "i32": "int32", "u64": "uint64", "i64": "int64", "f32": "float32",
          "f64": "float64", "ptr": "uint64"}
_F32_MAX = 3.4028234663852886e38
_F32_ROUNDS_TO_INF = _F32_MAX + 2.0 ** 103
_PTR_KINDS = frozenset(("ptr", "u64"))
#: (numpy scalar type, parameter type) -> int or float, for the pairs _pack has accepted once.
_NUMPY_SAFE: Dict[tuple, type] = {}

_limits: Dict[Tuple[int, int], dict] = {}
_limits_lock = _locks.module_lock(globals(), "_limits_lock")


def _reset() -> None:
    _limits.clear()


_lazy.register_reset_hook(_reset)


def _device_limits(backend, index: int) -> dict:
    key = (id(backend), index)
    lim = _limits.get(key)
    if lim is None:
        # Asked outside the lock (r71i): the query and the dict are allocations, where a collection
        # may run a user's gc callback or __del__ that launches a kernel (which waited forever for
        # the plain lock its own thread held).  Two threads asking at once both ask; one is kept.
        made = dict(backend.launch_limits(index), simulated=_is_simulated(backend))
        with _limits_lock:      # (held for no call)
            lim = _limits.setdefault(key, made)
    return lim


def _dims(value, what: str, kname: str) -> Tuple[int, int, int]:
    if type(value) is int and value >= 1:     # the common cases first (bool is not int's type)
        return (value, 1, 1)
    if type(value) is tuple and len(value) == 3:
        x, y, z = value
        if type(x) is int and type(y) is int and type(z) is int and x >= 1 and y >= 1 and z >= 1:
            return value
    if isinstance(value, tuple) and 1 <= len(value) <= 3:
        dims = value
    elif hasattr(type(value), "__index__") and not isinstance(value, bool):    # int, numpy integers
        dims = (value,)
    else:
        raise TypeError(f"launch({kname}): {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    for i, d in enumerate(dims):
        if isinstance(d, bool):      # operator.index(True) is 1: refuse it, as a bare True is
            raise TypeError(f"launch({kname}): {what}[{i}] must be an int, got bool {d!r}")
        if not isinstance(d, int):
            import operator
            try:
                d = operator.index(d)
            except TypeError:
                raise TypeError(f"launch({kname}): {what}[{i}] must be an int, got {type(d).__name__} {d!r}") from None
        if d < 1:
            raise ValueError(f"launch({kname}): {what}[{i}] is {d}; every {what} dimension must be >= 1")
    dims = tuple(int(d) for d in dims)
    return dims + (1,) * (3 - len(dims))


def _is_simulated(backend) -> bool:
    return os.environ.get("ACCEL_SIM", "").strip().lower() == backend.name


def _bad(kernel: Kernel, i: int, kind: str, value, why: str) -> str:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"launch({kernel.name}): argument {i} ({kind}) is {type(value).__name__} {shown}: {why}"


def _signed_hint(kernel: Kernel, i: int, kind: str, value) -> str:
    """For a negative value where PTX declared .u32/.u64: PTX gives a C ``int`` (``long long``)
    parameter the same .u32 (.u64) as an unsigned one, so say how to declare it signed."""
    if value >= 0 or kind not in ("u32", "u64"):
        return ""
    params = list(kernel.params)
    params[i] = "i32" if kind == "u32" else "i64"
    return (f"; PTX declares a C int (long long) parameter as .{kind}, as it does an unsigned one: if "
            f"this parameter is signed, name its type: module.function({kernel.name!r}, "
            f"{', '.join(params)!r})")


def _pointer(kernel: Kernel, i: int, kind: str, value) -> int:
    try:
        ptr = value.ptr
    except AttributeError:
        raise TypeError(_bad(kernel, i, kind, value, "expected a Buffer, a typed view or an int address")) from None
    dev = getattr(value, "device", None)
    if isinstance(dev, str):                 # "cuda:1": a DeviceLike, as everywhere in accel
        try:
            dev = device(dev)
        except ValueError as exc:
            raise TypeError(_bad(kernel, i, kind, value, f"its .device names no device ({exc})")) from None
    if isinstance(dev, int) and not isinstance(dev, bool):
        index, dtype = dev, kernel._backend.name
    else:
        index, dtype = getattr(dev, "index", None), getattr(dev, "type", kernel._backend.name)
    if not isinstance(index, int) or isinstance(index, bool) or dtype != kernel._backend.name:
        raise TypeError(_bad(kernel, i, kind, value, "an object with .ptr must also say its device (.device: an "
                                                     f"index, '{kernel._backend.name}:N' or accel.device)"))
    if index != kernel._index:
        raise ValueError(_bad(kernel, i, kind, value,
                              f"it is memory of device {index} but the kernel's module is loaded on device "
                              f"{kernel._index}; load the module on device {index} (Module(image, device={index})) "
                              f"or copy the data"))
    # The same rule as an int address: a C pointer is 0 .. 2**64-1, and an address that is no
    # int (a str, a float) is no address at all.
    if isinstance(ptr, bool) or not hasattr(type(ptr), "__index__"):
        raise TypeError(_bad(kernel, i, kind, value, f"its .ptr is {type(ptr).__name__} {ptr!r}, not an int address"))
    ptr = operator.index(ptr)
    if not 0 <= ptr <= 2 ** 64 - 1:
        raise ValueError(_bad(kernel, i, kind, value, f"its .ptr {ptr} is out of range for an address (0 .. 2**64-1)"))
    return ptr


def _numpy_scalar(kernel, i, kind, value):
    import numpy as np
    target = np.dtype(_NUMPY[kind])
    if value.dtype.kind == "b":     # np.bool_ converts "safely" to every number type; bool does not
        raise TypeError(_bad(kernel, i, kind, value, "bool is not accepted; pass int(value)"))
    if not np.can_cast(value.dtype, target, "safe"):
        raise TypeError(_bad(kernel, i, kind, value,
                             f"numpy {value.dtype} does not convert to {target} without loss; cast it "
                             f"first (np.{target}(x))"))
    return value.item()


def _numpy_scalar_type(cls) -> bool:
    """True for numpy's scalar types (np.float32, np.uint64...), whose dtype is fixed by the type."""
    import numpy as np      # already imported: an object of numpy's was passed
    return issubclass(cls, np.generic)


def _pack(kernel: Kernel, i: int, kind: str, value):
    """The (C type, value) pair of argument ``i`` for a parameter of type ``kind``."""
    cls = type(value)
    if cls is int:
        lo, hi = _RANGES.get(kind, (None, None))
        if lo is None:                        # f32 / f64
            return kind, _float(kernel, i, kind, value)
        if not lo <= value <= hi:
            raise ValueError(_bad(kernel, i, kind, value, f"out of range for {kind} ({lo} .. {hi})"
                                  + _signed_hint(kernel, i, kind, value)))
        return kind, value
    if cls is float:
        if kind in ("f32", "f64"):
            return kind, _float(kernel, i, kind, value)
        raise TypeError(_bad(kernel, i, kind, value, "a float for an integer parameter; pass an int"))
    if value is None and kind in ("ptr", "u64"):
        return "ptr", 0
    if isinstance(value, bool):
        raise TypeError(_bad(kernel, i, kind, value, "bool is not accepted; pass int(value)"))
    if hasattr(value, "dtype") and getattr(value, "shape", None) == () and cls.__module__ == "numpy":
        v = _numpy_scalar(kernel, i, kind, value)
        return _pack(kernel, i, kind, v if kind in ("f32", "f64") else int(v))
    if isinstance(value, int):                # int subclasses (IntEnum...)
        return _pack(kernel, i, kind, int(value))
    if isinstance(value, float):              # float subclasses
        return _pack(kernel, i, kind, float(value))
    if kind in ("ptr", "u64") and hasattr(value, "ptr"):
        return "ptr", _pointer(kernel, i, kind, value)
    if hasattr(value, "ptr"):
        raise TypeError(_bad(kernel, i, kind, value, f"device memory for a {kind} parameter (the kernel "
                                                     "takes a number here)"))
    if kind in _PTR_KINDS:
        foreign = (" (a CUDA-array-interface array: pass its address, "
                   "obj.__cuda_array_interface__['data'][0])" if hasattr(value, "__cuda_array_interface__") else "")
        raise TypeError(_bad(kernel, i, kind, value, f"expected a Buffer, a typed view, an int address or None{foreign}"))
    raise TypeError(_bad(kernel, i, kind, value, f"expected {'an int' if kind in _RANGES else 'a float'}"))


def _float(kernel, i, kind, value) -> float:
    try:
        f = float(value)
    except OverflowError:
        raise ValueError(_bad(kernel, i, kind, value, f"too large for {kind}")) from None
    # C (IEEE 754 round to nearest, ties to even) takes a double to FLT_MAX below half an ulp past
    # it (FLT_MAX + 2**103, where the tie goes to inf: FLT_MAX's significand is odd).
    if kind == "f32" and abs(f) >= _F32_ROUNDS_TO_INF and f == f and abs(f) != float("inf"):
        raise ValueError(_bad(kernel, i, kind, value, "beyond the float32 range (it would become inf)"))
    return f


def _check_reference(kernel: Kernel) -> None:
    """On a simulator: the kernel needs a registered Python reference with matching parameters.
    The reference found matching is remembered on the kernel, so later launches only check
    that the registry still holds that same entry (registering again makes a new one)."""
    from ..sim import kernels as simk
    ref = simk.lookup(kernel.name)
    if ref is not None and ref is kernel._sim_ref:
        return
    example = ", ".join(kernel.params)
    if ref is None:
        raise AcceleratorError(
            f"launch({kernel.name}): the simulator has no Python reference for kernel {kernel.name!r}; "
            f"register one before launching: accel.sim.register_kernel({kernel.name!r}, fn, {example!r}) "
            f"with fn(grid, block, view, *args) computing the whole launch", library="accel.sim")
    if not simk.matches(ref, kernel.params):
        raise ValueError(f"launch({kernel.name}): the simulator's reference takes ({', '.join(ref.argtypes)}) "
                         f"but the kernel's parameters are ({example}); register it with that signature")
    kernel._sim_ref = ref


def _sim_registry() -> dict:
    """The simulator's kernel registry (name -> reference), imported on first use."""
    global _registry
    if _registry is None:
        from ..sim import kernels as simk
        _registry = simk._registry
    return _registry


_registry = None


def _launch_here(backend, kernel: Kernel, grid, block, packed, shared_mem: int, stream, lim: dict):
    """Queue the checked launch; the kernel's device is current.  Under the module's lock, which
    Module.close takes to drop the handle: a close in another thread cannot unload the module
    between the check and the launch (a function of an unloaded module is undefined behaviour
    for the driver).  Returns the table of the accel.Graph capture the stream takes part in
    (``streams._capture_table``), or None."""
    module = kernel.module
    with module._lock:
        if module._handle is None:
            module._live()          # raises: closed (in another thread since launch checked)
        return _launch_locked(backend, kernel, grid, block, packed, shared_mem, stream, lim)


def _kernel_bounds(backend, kernel: Kernel) -> Tuple[int, int]:
    """(most threads per block, static shared bytes) of the kernel's function on the current
    device (cudaFuncGetAttributes: its __launch_bounds__ or registers lower the device's thread
    limit; Metal: the pipeline's maxTotalThreadsPerThreadgroup, static threadgroup memory not
    reported: 0).  Backends that cannot say check the kernel's limit at launch themselves: no
    limit here."""
    try:
        attrs = backend.function_attributes(kernel.handle)
    except NotImplementedError:
        return 1 << 62, 0
    return attrs["max_threads_per_block"], attrs.get("shared_size_bytes", 0)


def _opt_in_shared(backend, kernel: Kernel, shared_mem: int, static: int, lim: dict) -> None:
    """Let ``kernel``'s function take ``shared_mem`` bytes of dynamic shared memory (its static
    bytes ``static`` beside them), as a launch or an occupancy query of that size needs; the
    caller holds the module's lock and checked the device's opt-in limit."""
    if shared_mem <= lim["max_shared_per_block"] - static:
        return
    # CUDA Programming Guide, "Shared Memory" (7.x+): above 48 KB a kernel must opt in (its
    # default maxDynamicSharedSizeBytes is 48 KB less its static shared memory).  The
    # attribute is the function's (cudaFuncSetAttribute), shared by every Kernel object of it
    # (another signature, a copy): kept per handle in its module, under the module's lock,
    # and only ever raised.
    optin = kernel.module._smem_optin
    if shared_mem > optin.get(kernel.handle, 0):
        backend.function_set_max_dynamic_shared(kernel.handle, shared_mem)
        optin[kernel.handle] = shared_mem


#: What lowers a kernel's thread limit below the device's, per backend (for the launch's error).
_WHY_LIMIT = {"cuda": "its __launch_bounds__ / PTX .maxntid, or the registers it uses",
              "mps": "this Metal pipeline's maxTotalThreadsPerThreadgroup, which its "
                     "[[max_total_threads_per_threadgroup]] or resources lower"}


def _launch_locked(backend, kernel: Kernel, grid, block, packed, shared_mem: int, stream, lim: dict):
    if kernel.module._functions.get(kernel.name) != kernel.handle:
        kernel._function()      # destroyed by a failed unload: looked up again (or it raises)
    bounds = kernel._bounds
    if bounds is None:
        bounds = kernel._bounds = _kernel_bounds(backend, kernel)
    most_threads, static = bounds
    threads = block[0] * block[1] * block[2]
    if threads > most_threads:
        raise ValueError(f"launch({kernel.name}): block {block} has {threads} threads, above the kernel's own "
                         f"limit of {most_threads} threads per block (Kernel.max_threads_per_block: "
                         f"{_WHY_LIMIT.get(backend.name, _WHY_LIMIT['cuda'])}); launch smaller blocks")
    if static and static + shared_mem > lim["max_shared_per_block_optin"]:
        raise ValueError(f"launch({kernel.name}): shared_mem={shared_mem} bytes and the kernel's {static} bytes of "
                         f"static shared memory pass the device's limit of {lim['max_shared_per_block_optin']} "
                         f"bytes per block; at most {lim['max_shared_per_block_optin'] - static} bytes of "
                         f"dynamic shared memory fit")
    _opt_in_shared(backend, kernel, shared_mem, static, lim)
    # An accel.Graph capturing the stream keeps the module loaded: each replay launches the kernel.
    keep = _capture_table(backend, stream) if _capture_events else None    # first: it may raise
    backend.launch(kernel.handle, grid, block, packed, shared_mem, stream.handle)
    if keep is not None:
        keep[id(kernel.module)] = kernel.module
    return keep


def launch(kernel: Kernel, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
    """Queue ``kernel`` on ``stream`` (default: the current stream of the kernel's device) with a
    ``grid`` of blocks of ``block`` threads (each an int or a tuple of 1-3 ints, every dimension
    >= 1 and within the device's limits) and ``shared_mem`` bytes of dynamic shared memory.

    ``args`` are checked against the kernel's parameters (see this module's docstring): their
    number, their types and ranges, and that device memory is the kernel's device's.  Above
    48 KiB of shared memory the kernel is opted in first (CUDA:
    ``cudaFuncAttributeMaxDynamicSharedMemorySize``), up to the device's opt-in limit.
    The launch runs with the stream's device current, so a stream of another device than the
    current one works; it is captured like any work when the stream is capturing
    (:class:`accel.Graph`).  Buffers passed are noted as used on ``stream`` (their memory is
    not reused before the kernel ran).  On a simulator the kernel's Python reference runs
    (:func:`accel.sim.register_kernel`)."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"launch(kernel, ...): kernel must be an accel.Kernel (Module(...).function(name)), "
                        f"got {type(kernel).__name__}")
    kernel.module._live()
    backend, index, name = kernel._backend, kernel._index, kernel.name
    if stream is None:
        stream = current_stream(index)
    else:
        if type(stream) is not Stream:
            stream = _as_stream(stream, f"launch({name}, stream=)")
        if stream._index != index:
            raise ValueError(f"launch({name}): stream is on device {stream.device_index} but the kernel's "
                             f"module is loaded on device {index}; pass a stream of device {index} or "
                             f"load the module on device {stream.device_index}")
    grid = _dims(grid, "grid", name)
    block = _dims(block, "block", name)
    lim = _device_limits(backend, index)
    mg, mb = lim["max_grid"], lim["max_block"]
    if (grid[0] > mg[0] or grid[1] > mg[1] or grid[2] > mg[2] or block[0] > mb[0] or block[1] > mb[1]
            or block[2] > mb[2]):
        for what, dims, most in (("grid", grid, mg), ("block", block, mb)):
            for i, (d, m) in enumerate(zip(dims, most)):
                if d > m:
                    raise ValueError(f"launch({name}): {what}[{i}] is {d}, above the device's limit of {m} "
                                     f"(max {what} {tuple(most)})")
    threads = block[0] * block[1] * block[2]
    if threads > lim["max_threads_per_block"]:
        raise ValueError(f"launch({name}): block {block} has {threads} threads, above the device's "
                         f"{lim['max_threads_per_block']} threads per block")
    if kernel._required is not None and block != kernel._required:
        raise ValueError(f"launch({name}): block {block} is not the block shape {kernel._required} the kernel "
                         f"requires (its PTX .reqntid or SPIR-V LocalSize); launch it with block={kernel._required}")
    if type(shared_mem) is not int or shared_mem < 0:
        smem = shared_mem
        if not isinstance(smem, bool) and hasattr(type(smem), "__index__"):     # numpy integers too
            import operator
            smem = operator.index(smem)
        if type(smem) is not int or smem < 0:
            raise ValueError(f"launch({name}): shared_mem must be an int >= 0 (bytes), got {shared_mem!r}")
        shared_mem = smem
    if shared_mem > lim["max_shared_per_block_optin"]:
        raise ValueError(f"launch({name}): shared_mem={shared_mem} bytes is above the device's limit of "
                         f"{lim['max_shared_per_block_optin']} bytes of dynamic shared memory per block")
    params = kernel.params
    if len(args) != len(params):
        raise TypeError(f"launch({name}): the kernel takes {len(params)} argument(s) "
                        f"({', '.join(params) or 'none'}), {len(args)} given")
    # Hot path (issue 18 benchmark: host time per launch within 2x of a bare cudaLaunchKernel):
    # accel's own Buffers and in-range Python ints are packed inline; everything else by _pack.
    packed = []
    buffers = []        # accel Buffers passed: noted as used on the stream after the launch
    others = []         # other objects that may carry memory (typed views, foreign objects)
    # Each Buffer passed (a typed view's too) holds a pin from before its address is read to the
    # launch's end, as Buffer.fill_: a close() in another thread leaves the memory to the launch
    # instead of handing it to the next allocation while the kernel is still being queued on it.
    pins = []
    try:
        i = 0
        for kind, a in zip(params, args):
            cls = type(a)
            if ((cls is Buffer or isinstance(a, Buffer)) and kind in _PTR_KINDS and a._index == index
                    and a._backend is backend):     # (a subclass too: pinned and noted as a Buffer, r80a)
                pins.append((a, _begin_use(a)))
                packed.append(("ptr", a.ptr))
                buffers.append(a)
            elif cls is int and kind in _RANGES and _RANGES[kind][0] <= a <= _RANGES[kind][1]:
                packed.append((kind, a))
            elif (cls, kind) in _NUMPY_SAFE:
                packed.append((kind, _NUMPY_SAFE[cls, kind](a)))
            else:
                viewed = getattr(a, "_buffer", None)    # an accel.ArrayView's buffer
                if isinstance(viewed, Buffer):
                    pins.append((viewed, _begin_use(viewed)))
                packed.append(_pack(kernel, i, kind, a))
                if cls.__module__ == "numpy" and getattr(a, "shape", None) == () and _numpy_scalar_type(cls):
                    # _pack accepted this numpy scalar type for this parameter type: numpy's "safe"
                    # cast rule depends on the type alone, so later ones are converted directly.
                    # (Not a 0-d ndarray: its dtype is not its type's, so each one is checked.)
                    _NUMPY_SAFE[cls, kind] = float if kind in ("f32", "f64") else int
                elif cls is not int and cls is not float:
                    others.append(a)
            i += 1
        if lim["simulated"] and (kernel._sim_ref is None or _sim_registry().get(name) is not kernel._sim_ref):
            _check_reference(kernel)
        # The stream is held to the launch's end: another thread's close() of it waits (its handle is
        # not destroyed, and so not given to the next stream made, while the launch queues on it).
        with _Hold(stream):
            if backend.get_device() == index:         # on_device(backend, index) without its object
                keep = _launch_here(backend, kernel, grid, block, packed, shared_mem, stream, lim)
            else:
                with on_device(backend, index):
                    keep = _launch_here(backend, kernel, grid, block, packed, shared_mem, stream, lim)
            # _record, not _note: a buffer closed by another thread since is still pinned, so the
            # use is recorded (its free waits for the kernel) instead of raising after the launch
            for a in buffers:
                a._record(stream)
            for a in others:
                viewed = getattr(a, "_buffer", None)
                if isinstance(viewed, Buffer):
                    viewed._record(stream)
                    continue
                note = getattr(a, "_note", None)
                if note is not None and getattr(a, "device", None) is not None:
                    note(stream)
            if keep is not None:
                note_captured(keep, [b for b, _ in pins])    # its replays use them (r73e)
    finally:
        for b, key in pins:
            _end_use(b, key)
