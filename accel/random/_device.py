"""Running fills on a device: the kernel path, or the host path plus a copy.

The backend's ``kernel_language`` picks a kernel source from
:data:`_SOURCES`: ``"ptx"`` the shipped ``kernels/philox.ptx`` (CUDA),
``"msl"`` ``kernels/philox.metal`` (Metal).  A language may also have a
prebuilt image in :data:`_BINARIES`, loaded first: for CUDA
``kernels/philox.fatbin`` (SASS for sm_75..sm_120 plus the same PTX), so a
supported GPU starts without JIT-compiling anything; the PTX is the fallback
when the fatbin is missing or the driver rejects it.  Another language is added with
:func:`register_kernel_source`.  A source may define any subset of the
kernels named in ``_fills.KERNEL_NAMES``, with the argument lists of
``tools/philox_kernel.cu`` and the same number layout; a fill whose kernel is
missing (or any fill on a backend without a source) is computed on the host
(bit-identical by construction) and copied through pinned staging memory on
the current stream.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Callable, Dict, Optional, Tuple

from .. import _lazy, _locks
from .._errors import AcceleratorError, CaptureError, KernelImageError
from ..buffer.capture import captured_table, note_captured
from . import _fills, philox

_BLOCK = 256
_MAX_BLOCKS = 1024   # grid-stride loops cover the rest; ~ resident blocks of a large GPU


def _shipped(filename: str) -> Callable[[], bytes]:
    def load() -> bytes:
        from importlib import resources
        return resources.files(__package__).joinpath("kernels").joinpath(filename).read_bytes()
    load.__name__ = f"load_{filename.replace('.', '_')}"
    return load


#: the backends' ``kernel_language`` values (CUDA, Metal, Level Zero)
_LANGUAGES = ("ptx", "msl", "spirv")
#: kernel language -> function returning the source text (bytes)
_SOURCES: Dict[str, Callable[[], bytes]] = {"ptx": _shipped("philox.ptx"), "msl": _shipped("philox.metal")}
#: kernel language -> function returning a prebuilt image of the same kernels, tried first
_BINARIES: Dict[str, Callable[[], bytes]] = {"ptx": _shipped("philox.fatbin")}

#: Held across the kernels' load (loader(), module_load: calls and allocations, where a collection
#: may run a user's gc callback or __del__ that draws random numbers): an accel._locks.Lock, which
#: refuses that re-entry instead of waiting forever on its own thread (r71i).  A forked child
#: finds it free (accel._locks).
_lock = _locks.Lock("loading the Philox kernels")
_functions: Dict[Tuple[int, int], Optional[Dict[str, int]]] = {}


def register_kernel_source(language: str, loader: Callable[[], bytes]) -> None:
    """Use ``loader()`` as the Philox kernel source for backends whose
    ``kernel_language`` is ``language`` (e.g. ``"msl"``)."""
    if language not in _LANGUAGES:
        raise ValueError(f"register_kernel_source: unknown kernel language {language!r}; the backends' "
                         f"languages are {', '.join(map(repr, _LANGUAGES))}")
    if not callable(loader):
        raise TypeError(f"register_kernel_source: loader must be a function returning the source bytes, "
                        f"got {loader!r}")
    with _lock:
        _SOURCES[language] = loader
        _BINARIES.pop(language, None)   # the shipped image is of the shipped source
        _functions.clear()


def _reset() -> None:
    with _lock:
        _functions.clear()


_lazy.register_reset_hook(_reset)


_DEFINITION = re.compile(r"(?:\.entry|\bkernel\s+void)\s+(\w+)\s*\(")


def defined_kernels(source: bytes) -> Tuple[str, ...]:
    """The names of ``_fills.KERNEL_NAMES`` that ``source`` defines (PTX ``.entry``, MSL ``kernel void``)."""
    return _defined_kernels(bytes(source))


@functools.lru_cache(maxsize=8)     # each fresh runtime loads the same source again
def _defined_kernels(source: bytes) -> Tuple[str, ...]:
    found = set(_DEFINITION.findall(source.decode("utf-8", "replace")))
    return tuple(name for name in _fills.KERNEL_NAMES if name in found)


def kernel_functions(backend, index: int) -> Optional[Dict[str, int]]:
    """Kernel handles by name on device ``index`` (those the source defines), or None when
    the backend has no kernel path."""
    key = (id(backend), index)
    try:
        return _functions[key]
    except KeyError:
        pass
    with _lock:
        if key in _functions:
            return _functions[key]
        loader = _SOURCES.get(backend.kernel_language or "")
        fns = None
        if loader is not None:
            from ..streams import on_device
            try:
                source = loader()
                with on_device(backend, index):
                    fns = _load(backend, source, _BINARIES.get(backend.kernel_language))
            except AcceleratorError as exc:
                warnings.warn(f"accel.random: could not load the Philox {backend.kernel_language} kernels "
                              f"on {backend.name}:{index} ({exc}); using the host path (same numbers, "
                              f"slower, not capturable)", RuntimeWarning, stacklevel=3)
                if not isinstance(exc, KernelImageError):
                    return None     # a failed call, not an image this device cannot run: retried next time
                fns = None
        _functions[key] = fns
        return fns


def _load(backend, source: bytes, binary: Optional[Callable[[], bytes]]) -> Dict[str, int]:
    """Kernel handles of ``source``'s kernels, from the prebuilt image when it loads, else from
    ``source`` (the driver JITs it).

    With CUDA's lazy loading (the default since 12.2) a load accepts an image the device cannot
    run and the kernel lookup (:func:`_functions_of`) refuses it with the same KernelImageError:
    both fall back from the prebuilt image to the source, the refused module unloaded."""
    names = defined_kernels(source)
    if not names:
        return {}    # none of the kernels: nothing to load (a loaded module would never be unloaded)
    if binary is not None:
        try:
            image = binary()
        except OSError:
            image = None     # not shipped (a source checkout without the image): use the source
        if image is not None:
            try:
                return _functions_of(backend, backend.module_load(image), names)
            except KernelImageError:
                pass         # e.g. a driver that refuses these cubins: its JIT takes the PTX below
    return _functions_of(backend, backend.module_load(source), names)


def _functions_of(backend, module: int, names) -> Dict[str, int]:
    """The kernels ``names`` of a loaded ``module``; the module is unloaded when one fails (a
    lazily loaded image's errors come from these lookups)."""
    index = backend.get_device()    # (the caller made the module's device current: the retry does too)
    try:
        return {name: backend.module_function(module, name) for name in names}
    except BaseException:
        # the lookup's error is the one raised; a failing unload is tried once more at the next
        # safe point, as a finalizer's (r67d: its error replaced the lookup's, the module leaked)
        from .. import _finalize
        from ..kernels._module import _unload
        _finalize.finalize(_unload, backend, index, module)
        raise


def _give_up_kernels(backend, index: int, exc: KernelImageError) -> None:
    """The device cannot run the loaded kernels (JIT failed at the first launch):
    use the host path on this device from now on, saying so once."""
    with _lock:
        key = (id(backend), index)
        if _functions.get(key) is None:
            return  # another thread already gave up (and warned)
        _functions[key] = None
    warnings.warn(f"accel.random: the Philox {backend.kernel_language} kernels do not run on "
                  f"{backend.name}:{index} ({exc}); using the host path (same numbers, slower, "
                  f"not capturable)", RuntimeWarning, stacklevel=4)


def _grid(counters: int) -> Tuple[int, int, int]:
    return (max(1, min(-(-counters // _BLOCK), _MAX_BLOCKS)), 1, 1)


def fill(buf, plan: "_fills.Plan", generator) -> None:
    """Fill ``buf`` as ``plan`` says, drawing from ``generator`` on the current stream."""
    from ..buffer import _begin_use, _end_use
    from ..streams import _Hold, current_stream, on_device
    backend = _lazy.lazy_init()
    index = buf.device_index
    stream = current_stream(index)
    if plan.n == 0:
        return
    # The buffer holds a pin (as Buffer.fill_'s): a close() in another thread leaves the memory
    # to the fill's end instead of handing it to the next allocation under the queued fill; and
    # the fill holds its stream, whose close() in another thread waits for it (the handle is not
    # destroyed, and so not given to the next stream made, while the fill still queues on it).
    key = _begin_use(buf)
    try:
        # A launch needs the stream's device current (cudaLaunchKernel: a stream of another
        # device is cudaErrorInvalidResourceHandle), and so does every call on a shared
        # default stream, whose handle names the current device's.
        with _Hold(stream), on_device(backend, index):
            _fill_here(backend, index, buf, plan, generator, stream)
    finally:
        _end_use(buf, key)


def _fill_here(backend, index: int, buf, plan: "_fills.Plan", generator, stream) -> None:
    fns = kernel_functions(backend, index)
    kernel = fns.get(plan.kernel) if fns else None
    capturing = backend.supports_graphs and backend.stream_is_capturing(stream.handle)
    if capturing and generator.device_index != index:
        # (a captured fill reads the generator's state from its device's memory at each replay)
        raise ValueError(f"a capture on device {index} cannot draw from the generator of device "
                         f"{generator.device_index}: its replays read the state from that device's "
                         f"memory; use default_generator({index}) or a Generator({index})")
    if capturing and kernel is None:
        raise CaptureError(
            f"random fills of this kind cannot be captured on {backend.name}: it has no {plan.kernel} "
            "kernel, and the host path would bake one set of numbers into the graph")
    # the table of the accel.Graph capturing the stream (its replays use buf: r73e); first, it may raise
    captured = captured_table(stream) if capturing else None
    ptr = buf.ptr
    if kernel is None:
        philox._threads()       # a bad ACCEL_RNG_THREADS is refused before the generator's offset moves
    try:
        args = generator.philox_args(plan.words, graph=capturing)
    except RuntimeError as exc:
        if not capturing:
            raise       # (an exhausted offset: nothing captures, so no CaptureError)
        raise CaptureError(str(exc)) from None
    if kernel is not None:
        kernel_args = [("ptr", ptr), ("u64", plan.n), ("u64", args.seed), ("u64", args.offset),
                       ("ptr", args.seed_ptr), ("ptr", args.offset_ptr)] + plan.kernel_args
        try:
            backend.launch(kernel, _grid(plan.counters), (_BLOCK, 1, 1), kernel_args, 0, stream.handle)
        except KernelImageError as exc:
            _give_up_kernels(backend, index, exc)
            if capturing:
                raise CaptureError(f"random fill during capture: {exc}; the host path cannot be "
                                   "captured") from exc
            kernel = None
    if kernel is None:
        values = plan.host(args.seed, args.offset)
        _copy_to_device(backend, ptr, values, stream.handle, index)
    # the buffer's last-use stream (the allocator skips its own stream); _record, not
    # record_stream: a close() in another thread meanwhile left the memory to fill()'s pin
    buf._record(stream)
    if captured is not None:
        note_captured(captured, (buf,))


def _copy_to_device(backend, dst: int, values, stream: int, device_index: int) -> None:
    """Queue a copy of the numpy array ``values`` to ``dst`` on ``stream`` (of device
    ``device_index``) via pinned staging."""
    import weakref
    from .. import memory
    from .._hostmem import _Token, copy_into
    view = memoryview(values).cast("B")
    host = memory.host_allocator()
    token = _Token()        # the staging block's owner until this call ends (a Ctrl-C: see _Token)
    staging = host.malloc(view.nbytes, weakref.ref(token))
    try:
        copy_into(staging, view)
        backend.memcpy_async(dst, staging, view.nbytes, stream)
        host.record_stream(staging, stream, device_index)
    finally:
        host.free(staging)


def write_state(device_index: int, seed_ptr: int, offset_ptr: int, seed: int, offset: int,
                stream: int) -> None:
    """Queue writes of ``seed`` and ``offset`` (uint64 each) to device memory on ``stream``
    (graph replay: the captured kernels read them)."""
    from ..streams import on_device
    backend = _lazy.lazy_init()
    with on_device(backend, device_index):   # as fill(): the launch and the copies need it
        _write_state_here(backend, device_index, seed_ptr, offset_ptr, seed, offset, stream)


def _write_state_here(backend, device_index, seed_ptr, offset_ptr, seed, offset, stream) -> None:
    fns = kernel_functions(backend, device_index)
    if fns and _fills.STORE_STATE in fns:
        try:
            backend.launch(fns[_fills.STORE_STATE], (1, 1, 1), (1, 1, 1),
                           [("ptr", seed_ptr), ("ptr", offset_ptr), ("u64", seed), ("u64", offset)], 0, stream)
            return
        except KernelImageError as exc:
            _give_up_kernels(backend, device_index, exc)
    import numpy as np
    if offset_ptr == seed_ptr + 8:
        _copy_to_device(backend, seed_ptr, np.array([seed, offset], dtype=np.uint64), stream, device_index)
    else:
        _copy_to_device(backend, seed_ptr, np.array([seed], dtype=np.uint64), stream, device_index)
        _copy_to_device(backend, offset_ptr, np.array([offset], dtype=np.uint64), stream, device_index)
