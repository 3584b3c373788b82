"""Modules and kernels: loading images (cudaLibraryLoadData), kernel handles, function
attributes, occupancy, the driver entry points, and kernel launches.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Dict, Tuple

from .. import _cuda_images, kernels
from ..core import ffi
from .state import (
    _CHARP, _NULL, _SHARED_PER_BLOCK, KernelHandle, Library, Runtime, Stream, cudaErrorInvalidDeviceFunction,
    cudaErrorLaunchOutOfResources, cudaErrorInvalidResourceHandle, cudaErrorInvalidValue, cudaErrorNotSupported,
    cudaErrorSymbolNotFound, cudaSuccess, blocks_per_sm, shared_per_block_optin, shared_per_sm,
    shared_reserved_per_block, threads_per_sm,
)
from .common import (
    _c_string, _enqueue, _freed_ranges, _is_null, _lookup, _put, _put_ptr, _stream, _unmade_pointers, _unsafe_call,
    guard_freed,
)
from .devices import _device_view, _set_fields


# -- kernels ------------------------------------------------------------------------------

ptx_entries = _cuda_images.ptx_entries


_MODULE_LOAD_IN_CAPTURE = 12030    # the first driver (CUDA 12.3) that loads modules during a capture


def module_call_in_capture(R: Runtime, loading: bool) -> int:
    """0, or cudaErrorStreamCaptureUnsupported (= CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) after
    invalidating the captures that prohibit this thread's potentially unsafe calls
    (:func:`_unsafe_call`), for loading (cudaLibraryLoadData, cuModuleLoadData) or unloading
    (cudaLibraryUnload, cuModuleUnload) a module while a capture is underway.

    The CUDA documentation lists neither among the calls prohibited during capture.  Drivers
    before CUDA 12.3 refuse a load with 900 (NVIDIA Warp, warp.capture_begin: "kernels can be
    loaded during graph capture on more recent drivers", CUDA 12.3 or newer; Warp reports
    "error 900: operation not permitted when stream is capturing" from cuModuleLoadDataEx on a
    12.2 driver); an unload during a capture fails the same way on current drivers (Warp issue
    401, "Module unloading causes errors during graph capture").  Both are refused as the
    other potentially unsafe calls: the calling thread's relaxed mode allows them."""
    if not R.captures or (loading and R.cfg.driver_version >= _MODULE_LOAD_IN_CAPTURE):
        return cudaSuccess
    return _unsafe_call(R)


# -- lazy loading ---------------------------------------------------------------------------
#
# CUDA Programming Guide, "Lazy Loading" (https://docs.nvidia.com/cuda/cuda-programming-guide/
# 04-special-topics/lazy-loading.html; 12.2 edition: .../archive/12.2.1/cuda-c-programming-guide/
# lazy-loading.html): introduced in CUDA 11.7, the default on Linux since 12.2, chosen with
# CUDA_MODULE_LOADING=LAZY or EAGER; "loading a module (cuModuleLoad*() family of functions) will
# not be loading kernels immediately, instead it will delay loading of a kernel until
# cuModuleGetFunction() is called ... relevant to both CUDA Runtime and CUDA Driver users".
#
# Measured on an H100 (driver 580.159.04, libcudart 13.0, CUDA_MODULE_LOADING unset;
# tests/conformance/cuda_h100_2026-12-05.json), scenario library_bad_images: cudaLibraryLoadData
# returned 0 for every bad image (PTX .version 9.9, PTX without .entry, PTX without .version, PTX
# .target sm_100 on the cc 9.0 device, bytes that are no image); cudaLibraryGetKernel returned 222,
# 500, 200, 218 and 200, cudaGetLastError then the same code, and cudaLibraryUnload 0.  Scenario
# driver_module_calls_in_capture of the same run: cuModuleLoadData(PTX .target sm_100) returned
# 218 at load, so the driver JITs a PTX module when it is loaded, lazy or not; the simulator's
# cuModuleLoadData checks every image at load in both modes (at least as strict; the scenarios
# driver_module_bad_images[_eager] of tools/cuda_conformance.py record the rest).
#
# The simulator reads CUDA_MODULE_LOADING at each cudaLibraryLoadData call (a real runtime reads it
# once, when it starts), so a library keeps the mode it was loaded in.  "EAGER" (any case): every
# image is checked at load, with the codes of _cuda_images.load; otherwise (unset, "LAZY") the
# bytes are kept and checked at the library's first cudaLibraryGetKernel, with the codes measured
# there.  Runtimes or drivers before 11.7 always load eagerly, and before 12.2 only LAZY asks.
_LAZY_FIRST = 11070           # CUDA 11.7: lazy loading needs a runtime and a driver this new
_LAZY_DEFAULT = 12020         # CUDA 12.2: lazy loading is the default


def lazy_loading(R: Runtime) -> bool:
    """Whether a cudaLibraryLoadData call now loads lazily (CUDA_MODULE_LOADING, see above)."""
    mode = os.environ.get("CUDA_MODULE_LOADING", "").strip().upper()
    if mode == "EAGER":
        return False
    newest_both = min(R.cfg.runtime_version, R.cfg.driver_version)
    return newest_both >= (_LAZY_FIRST if mode == "LAZY" else _LAZY_DEFAULT)


#: runtime -> {Library loaded lazily and not looked up yet: its image bytes, or one whose image
#: failed at its first lookup: the code every lookup returns} (a library of neither has no entry)
_lazy_images: "weakref.WeakKeyDictionary[Runtime, Dict[Library, object]]" = weakref.WeakKeyDictionary()
_lazy_lock = threading.Lock()


def _resolve(R: Runtime, lib: Library) -> int:
    """0, or the image error of ``lib``: a library loaded lazily is read at its first lookup."""
    pending = _lazy_images.get(R)
    if not pending or lib not in pending:
        return cudaSuccess
    with _lazy_lock:
        data = pending.get(lib, cudaSuccess)
        if isinstance(data, bytes):
            try:
                names, jit = _cuda_images.load(data, R.cfg.compute_capability, R.cfg.driver_version, lazy=True)
            except _cuda_images.ImageError as exc:
                pending[lib] = exc.code
                return exc.code
            del pending[lib]
            lib.names, lib.params = frozenset(names), _cuda_images.declared_params(data)
            lib.bounds = _cuda_images.declared_bounds(data)
            if jit:
                R.jit_compiles += 1
            return cudaSuccess
        return data


def load_image(R: Runtime, code, device=None):
    """(Library, 0) for the module image at ``code`` (PTX, cubin or fatbin), or (None, error code).
    ``device`` set: a driver module of that device's context (cuModuleLoadData), checked at load;
    None: a context-independent cudaLibrary_t, checked at load or, loaded lazily, at its first
    cudaLibraryGetKernel (:func:`_resolve`)."""
    rc = module_call_in_capture(R, True)
    if rc:
        return None, rc
    if device is None and lazy_loading(R):
        lib = Library(R.new_handle(), frozenset(), None)
        with _lazy_lock:
            _lazy_images.setdefault(R, {})[lib] = _cuda_images.image_bytes(ffi, code, _CHARP)
        Runtime.put(R.libraries, lib)
        return lib, cudaSuccess
    try:
        data = _cuda_images.image_bytes(ffi, code, _CHARP)
        # Every simulated device has the configured compute capability.
        names, jit = _cuda_images.load(data, R.cfg.compute_capability, R.cfg.driver_version)
    except _cuda_images.ImageError as exc:
        return None, exc.code
    if jit:
        R.jit_compiles += 1
    lib = Library(R.new_handle(), frozenset(names), device, _cuda_images.declared_params(data),
                  _cuda_images.declared_bounds(data))
    Runtime.put(R.libraries, lib)
    return lib, cudaSuccess


def cudaLibraryLoadData(R, library, code, jitOptions=None, jitOptionsValues=None, numJitOptions=0,
                        libraryOptions=None, libraryOptionValues=None, numLibraryOptions=0):
    if _is_null(library) or _is_null(code):
        return cudaErrorInvalidValue
    # (r72a) CUDA Runtime API, cudaLibraryLoadData: "Options are passed as an array via jitOptions and
    # any corresponding parameters are passed in jitOptionsValues. The number of total JIT options is
    # supplied via numJitOptions. Any outputs will be returned via jitOptionsValues" (the wall time,
    # the info and error logs and their sizes); the library options likewise.  A count with no array
    # to read it from is not described (cuLibraryLoadData would read through NULL): refused,
    # cudaErrorInvalidValue.  Options themselves are not simulated -- the simulator ignored them, so a
    # program read its own bytes back as the JIT's log or wall time, and cudaLibraryBinaryIsPreserved
    # went unhonoured -- refused, cudaErrorNotSupported, nothing loaded, as the unsimulated cuMemCreate
    # properties are (cuda_driver.py).  accel passes none.
    for count, options, values in ((numJitOptions, jitOptions, jitOptionsValues),
                                   (numLibraryOptions, libraryOptions, libraryOptionValues)):
        if count and (_is_null(options) or _is_null(values)):
            return cudaErrorInvalidValue
    if numJitOptions or numLibraryOptions:
        return cudaErrorNotSupported
    lib, rc = load_image(R, code)
    if lib is None:
        return rc
    _put_ptr(library, lib.key)
    return cudaSuccess


def cudaLibraryUnload(R, library):
    lib = _lookup(R.libraries, library)
    if lib is None or lib.device is not None:    # a driver CUmodule is not a cudaLibrary_t
        return cudaErrorInvalidResourceHandle
    rc = module_call_in_capture(R, False)
    if rc:
        return rc
    unload(R, lib)
    return cudaSuccess


def unload(R: Runtime, lib: Library) -> None:
    lib.unloaded = True
    pending = _lazy_images.get(R)
    if pending:
        with _lazy_lock:
            pending.pop(lib, None)
    Runtime.drop(R.libraries, lib)
    for k in lib.kernels.values():
        Runtime.drop(R.kernels, k)


def kernel_of(R: Runtime, lib: Library, name: str) -> "KernelHandle":
    """The one handle of kernel ``name`` (in ``lib.names``) of ``lib``."""
    k = lib.kernels.get(name)
    if k is None:
        k = lib.kernels[name] = KernelHandle(R.new_handle(), name, lib)
        Runtime.put(R.kernels, k)
    return k


def cudaLibraryGetKernel(R, pKernel, library, name):
    lib = _lookup(R.libraries, library)
    if lib is None or lib.device is not None:
        return cudaErrorInvalidResourceHandle
    n = _c_string(name)
    if _is_null(pKernel) or n is None:
        return cudaErrorInvalidValue
    rc = _resolve(R, lib)      # a lazily loaded library's image errors come here (see lazy_loading)
    if rc:
        return rc
    if n not in lib.names:
        return cudaErrorSymbolNotFound
    _put_ptr(pKernel, kernel_of(R, lib, n).key)
    return cudaSuccess


# -- driver entry points -------------------------------------------------------------------

_ENTRY_FLAGS = (0, 1, 2)   # cudaEnableDefault, cudaEnableLegacyStream, cudaEnablePerThreadDefaultStream
_ENTRY_FOUND, _ENTRY_NOT_FOUND, _ENTRY_VERSION_NOT_SUFFICIENT = 0, 1, 2   # cudaDriverEntryPointQueryResult


def _entry_point(R, symbol, funcPtr, version, flags, driverStatus):
    """CUDA Runtime API, cudaGetDriverEntryPoint[ByVersion]: the driver function ``symbol`` of ABI
    ``version`` in ``*funcPtr``, or NULL with driverStatus SymbolNotFound (the driver has no such
    symbol) / VersionNotSufficent (``version`` predates the symbol's first ABI)."""
    name = _c_string(symbol)
    if name is None or _is_null(funcPtr) or flags not in _ENTRY_FLAGS:
        return cudaErrorInvalidValue
    from .. import cuda_driver
    status, fn = cuda_driver.entry_point(name, version, R.cfg.driver_version, flags)   # r70d: flags too
    _put_ptr(funcPtr, fn if fn is not None else _NULL)
    if not _is_null(driverStatus):
        _put(driverStatus, status)
    return cudaSuccess


def cudaGetDriverEntryPoint(R, symbol, funcPtr, flags, driverStatus=None):
    # Without a version the runtime asks for the ABI of its own CUDA version.
    return _entry_point(R, symbol, funcPtr, R.cfg.runtime_version, flags, driverStatus)


def cudaGetDriverEntryPointByVersion(R, symbol, funcPtr, cudaVersion, flags, driverStatus=None):
    # cuda_runtime_api.h: "If the specified CUDA version is greater than the driver version, the
    # API will return cudaErrorInvalidValue."
    if cudaVersion > R.cfg.driver_version:
        return cudaErrorInvalidValue
    return _entry_point(R, symbol, funcPtr, cudaVersion, flags, driverStatus)


_FUNC_ATTR_MAX_DYNAMIC_SHARED = 8          # cudaFuncAttributeMaxDynamicSharedMemorySize
_FUNC_ATTR_PREFERRED_CARVEOUT = 9          # cudaFuncAttributePreferredSharedMemoryCarveout


def cudaFuncSetAttribute(R, func, attr, value):
    """Set a kernel attribute for the current device (cudaKernel_t handles as ``func``).

    CUDA Runtime API, cudaFuncSetAttribute: cudaErrorInvalidDeviceFunction for an unknown
    function; cudaErrorInvalidValue for an attribute that cannot be written or a bad value.
    cudaFuncAttributeMaxDynamicSharedMemorySize: "The sum of this value and the function attribute
    sharedSizeBytes cannot exceed the device attribute cudaDevAttrMaxSharedMemoryPerBlockOptin"
    (the kernel's static shared memory, read from its PTX, counts); the carveout is a percentage
    (-1: default)."""
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    if attr == _FUNC_ATTR_MAX_DYNAMIC_SHARED:
        if not (0 <= value <= shared_per_block_optin(R.cfg.compute_capability) - bounds_of(k).shared):
            return cudaErrorInvalidValue
        k.max_dynamic_shared[R.tls.device] = value
        return cudaSuccess
    if attr == _FUNC_ATTR_PREFERRED_CARVEOUT:
        if not -1 <= value <= 100:
            return cudaErrorInvalidValue
        k.carveout[R.tls.device] = value
        return cudaSuccess
    return cudaErrorInvalidValue


def cudaFuncGetAttributes(R, attr, func):
    """``struct cudaFuncAttributes`` of a kernel (cudaKernel_t handles as ``func``) on the
    current device.  CUDA Runtime API, cudaFuncGetAttributes: cudaErrorInvalidDeviceFunction
    for an unknown function.  The struct has the same layout in CUDA 12 and 13; fields are
    set by name.  The simulated kernels use no constant or local memory; the static shared memory
    and the thread limit are read from the kernel's PTX or cubin (:func:`bounds_of`)."""
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    if _is_null(attr):
        return cudaErrorInvalidValue
    _set_fields(attr, function_attributes(R, k))
    return cudaSuccess


def function_attributes(R: Runtime, k: "KernelHandle") -> Dict[str, int]:
    """The fields of ``struct cudaFuncAttributes`` of ``k`` on the current device (also what the
    driver's cuFuncGetAttribute reads)."""
    d = R.tls.device
    major, minor = R.cfg.compute_capability
    b = bounds_of(k)
    # cudaFuncAttributes::maxThreadsPerBlock: "The maximum number of threads per block, beyond which
    # a launch of the function would fail" (.maxntid / .reqntid lower it: PTX ISA 11.4.2, 11.4.3);
    # ::sharedSizeBytes: "The size in bytes of statically-allocated shared memory per block required
    # by this function"; ::maxDynamicSharedSizeBytes: what cudaFuncAttributeMaxDynamicSharedMemorySize
    # set, by default what is left of the 48 KiB a block gets without the opt-in.
    return {
        "sharedSizeBytes": b.shared, "constSizeBytes": 0, "localSizeBytes": 0,
        "maxThreadsPerBlock": b.max_threads(),
        "numRegs": _SIM_NUM_REGS, "ptxVersion": major * 10 + minor, "binaryVersion": major * 10 + minor,
        "cacheModeCA": 0, "maxDynamicSharedSizeBytes": max_dynamic_shared(k, d),
        "preferredShmemCarveout": k.carveout.get(d, -1), "clusterDimMustBeSet": 0,
        "requiredClusterWidth": 0, "requiredClusterHeight": 0, "requiredClusterDepth": 0,
        "clusterSchedulingPolicyPreference": 0, "nonPortableClusterSizeAllowed": 0,
    }


_NO_BOUNDS = _cuda_images.EntryBounds()


def bounds_of(k: "KernelHandle") -> "_cuda_images.EntryBounds":
    """The launch bounds and static shared memory of kernel ``k``, from its image's PTX or cubin
    (:func:`accel.sim._cuda_images.declared_bounds`; none where the image says nothing of it)."""
    return k.library.bounds.get(k.name, _NO_BOUNDS)


def max_dynamic_shared(k: "KernelHandle", device: int) -> int:
    """cudaFuncAttributes::maxDynamicSharedSizeBytes of ``k`` on ``device``: "The maximum size in
    bytes of dynamic shared memory per block for this function.  Any launch must have a dynamic
    shared memory size smaller than this value" (the H100 refused 80 KiB after the attribute was set
    to 64 KiB, cudaErrorInvalidValue: tests/conformance/cuda_h100_2026-12-05.json, scenario
    launch_dynamic_shared_memory).  Without cudaFuncSetAttribute, what the kernel's static shared
    memory leaves of the 48 KiB per block (Programming Guide, "Shared Memory": above 48 KB a kernel
    must opt in)."""
    return k.max_dynamic_shared.get(device, _SHARED_PER_BLOCK - bounds_of(k).shared)


_REGS_PER_SM = 65536               # cudaDevAttrMaxRegistersPerMultiprocessor
_SIM_NUM_REGS = 32                 # what cudaFuncGetAttributes reports for a simulated kernel


def cudaOccupancyMaxActiveBlocksPerMultiprocessor(R, numBlocks, func, blockSize, dynamicSMemSize):
    """CUDA Runtime API, cudaOccupancyMaxActiveBlocksPerMultiprocessor: the blocks of the kernel
    resident on one SM at once.  cudaErrorInvalidDeviceFunction for an unknown function,
    cudaErrorInvalidValue for a NULL result or a block size outside 1..maxThreadsPerBlock.
    Computed from the limits the CUDA Programming Guide ("Compute Capabilities", table of
    technical specifications) gives for the device's compute capability (state._SM_RESIDENCY:
    blocks and threads per SM; 9.0: 32 and 2048), 64K registers (allocated per warp) and the
    SM's shared memory, of which each block also reserves 1 KiB for the system from 8.0 on."""
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    if _is_null(numBlocks) or not (1 <= blockSize <= 1024) or dynamicSMemSize < 0:
        return cudaErrorInvalidValue
    warps = -(-blockSize // 32)
    b = bounds_of(k)
    cc = R.cfg.compute_capability
    limits = [blocks_per_sm(cc), threads_per_sm(cc) // (warps * 32),
              _REGS_PER_SM // (warps * 32 * _SIM_NUM_REGS)]
    if dynamicSMemSize > max_dynamic_shared(k, R.tls.device) or blockSize > b.max_threads():
        limits.append(0)        # no block of this size or shared memory can launch (see launch)
    else:
        need = b.shared + dynamicSMemSize + shared_reserved_per_block(cc)
        if need:
            limits.append(shared_per_sm(cc) // need)
    _put(numBlocks, max(0, min(limits)))
    return cudaSuccess


def _dim3(d) -> Tuple[int, int, int]:
    if isinstance(d, int):
        return (d, 1, 1)
    if isinstance(d, (tuple, list)):
        t = tuple(int(v) for v in d) + (1, 1, 1)
        return t[:3]
    if isinstance(d, dict):
        return (d.get("x", 1), d.get("y", 1), d.get("z", 1))
    return (d.x, d.y, d.z)


def _launch_config_ok(grid, block) -> bool:
    if min(grid) < 1 or min(block) < 1:
        return False
    if block[0] > 1024 or block[1] > 1024 or block[2] > 64 or block[0] * block[1] * block[2] > 1024:
        return False
    return grid[0] <= 2 ** 31 - 1 and grid[1] <= 65535 and grid[2] <= 65535


def cudaLaunchKernel(R, func, gridDim, blockDim, args, sharedMem, stream):
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    return launch(R, k, _dim3(gridDim), _dim3(blockDim), args, sharedMem, s)


def launch(R: Runtime, k: "KernelHandle", grid, block, args, sharedMem, s: Stream) -> int:
    """Launch ``k`` on stream ``s`` (cudaLaunchKernel and the driver's cuLaunchKernel);
    returns a cudaError_t code."""
    # CUDA Programming Guide, "Multi-Device System" (Stream and Event Behavior): "A kernel launch
    # will fail if it is issued to a stream that is not associated to the current device."
    if s.device != R.tls.device:
        return cudaErrorInvalidResourceHandle
    if not _launch_config_ok(grid, block):
        # Measured on an H100 (driver 580.159.04, libcudart 13.0; tests/conformance/
        # cuda_h100_2026-12-05.json, scenario launch_configurations): block 1025, block (32, 32, 2),
        # grid 0 and grid.y 65536 are cudaErrorInvalidValue, not cudaErrorInvalidConfiguration.
        return cudaErrorInvalidValue
    b = bounds_of(k)
    threads = block[0] * block[1] * block[2]
    if threads > b.max_threads():
        # PTX ISA 11.4.2 .maxntid: "Exceeding the maximum number of threads results in a runtime
        # error or kernel launch failure"; 11.4.3 .reqntid the same for another block shape;
        # cudaFuncAttributes::maxThreadsPerBlock: "beyond which a launch of the function would
        # fail".  No code is documented: cudaErrorLaunchOutOfResources (701, "too many resources
        # requested for launch"; CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES), the code CUDA documents for
        # "too many threads for the kernel's register count", the other per-function thread limit
        # (tools/cuda_conformance.py --only kernel_launch_bounds --real records what a GPU returns for these cases).
        return cudaErrorLaunchOutOfResources
    if b.reqntid is not None and tuple(block) != b.reqntid:
        # PTX ISA 11.4.3 .reqntid: "The size of each CTA dimension specified in any invocation of
        # the kernel is required to be equal to that specified in this directive.  Specifying a
        # different CTA dimension at launch will result in a runtime error or kernel launch
        # failure."  No code is documented: refused with cudaErrorInvalidValue (what an H100 gave
        # for block shapes outside the device's limits, scenario launch_configurations).
        return cudaErrorInvalidValue
    # CUDA Programming Guide, "Shared Memory" (compute capability 7.x+): more than 48 KB of
    # shared memory per block needs an explicit opt-in with cudaFuncSetAttribute(
    # cudaFuncAttributeMaxDynamicSharedMemorySize); a launch whose dynamic shared memory is above
    # the function's maxDynamicSharedSizeBytes (by default 48 KiB less its static shared memory:
    # max_dynamic_shared) fails with cudaErrorInvalidValue (CUDA_ERROR_INVALID_VALUE from
    # cuLaunchKernel), as the H100 did (scenario launch_dynamic_shared_memory).
    if sharedMem > max_dynamic_shared(k, s.device):
        return cudaErrorInvalidValue
    ref = kernels.lookup(k.name)
    if ref is None:
        # No Python reference registered (accel.sim.register_kernel): the simulator cannot run it.
        return cudaErrorInvalidDeviceFunction
    declared = k.library.params.get(k.name)
    if declared is not None and not kernels.matches(ref, declared):
        # The kernel reads its parameters as its .entry declares them (PTX ISA, "Kernel Function
        # Parameters"); a reference registered with another list would read other bytes.  The
        # driver does not check argument lists (it cannot); the simulator refuses the launch.
        return cudaErrorInvalidValue
    try:
        values = kernels.decode_args(ref, args)
    except ValueError:
        return cudaErrorInvalidValue
    ptrs = tuple(v for t, v in zip(ref.argtypes, values) if t == "ptr")
    if R.making and _unmade_pointers(R, ptrs, s):
        # cudaMallocAsync: "The allocation must not be accessed until the allocation operation
        # completes"; the launch's stream is not ordered after the allocation of memory it is
        # passed.  No code is documented: refused (cudaErrorInvalidValue), nothing queued.
        return cudaErrorInvalidValue
    fn, view, vmm_lock, device = ref.fn, _device_view(R, s.device), R.vmm.lock, s.device

    def run(freed=()):
        # holding the mapped pages (the space's lock, shared): no cuMemUnmap pulls them from under
        # a running kernel, and other work can still be queued and run meanwhile.  ``freed``: the
        # memory cudaFreeAsync freed before this launch (or, for a graph's kernel node, before the
        # graph launch) was queued; touching it faults (common.guard_freed).
        with vmm_lock.shared():
            fn(grid, block, guard_freed(view, freed, device) if freed else view, *values)
    run.ptrs = ptrs         # the pointers the kernel is passed (a graph launch checks them too)
    work = run
    if s.capture is None and R.freeing:
        freed = _freed_ranges(R)
        if freed:
            work = functools.partial(run, freed)
    return _enqueue(R, s, work, "kernel", f"{k.name} grid{grid} block{block}", kernel=k)[0]
