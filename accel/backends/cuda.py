"""CUDA backend over libcudart (runtime API) and libnvidia-ml (counting).

Counting (NVML, fork-safe) and the choice of libcudart live in ``_cuda_discovery``;
virtual memory (cuMem* through the driver entry points) in ``_cuda_vmm``, stream-ordered
allocation (cudaMallocAsync and the default memory pool) in ``_cuda_mempool``; this file is
the runtime: init, devices, memory, streams, events, copies, graphs and kernels.  The
runtime is touched only by :meth:`CudaBackend.init` and what follows it.  With ``ACCEL_SIM=cuda`` both libraries come from
``accel.sim`` instead; everything below the library calls is the same code.

Kernels (a fatbin with SASS, or PTX the driver JITs) are loaded with
``cudaLibraryLoadData`` / ``cudaLibraryGetKernel`` and launched with
``cudaLaunchKernel`` where the runtime has them (12.8+); older runtimes reach
the driver's cuModuleLoadData / cuModuleGetFunction / cuLaunchKernel through
``cudaGetDriverEntryPoint`` (``_cuda_driver``).  No nvrtc, no libcuda binding.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from typing import List, Optional, Tuple

from .. import _locks
from .._errors import AcceleratorError, CaptureError, KernelImageError, OutOfMemoryError
from ._cuda_discovery import _ERR_INSUFFICIENT_DRIVER, CudaDiscoveryMixin
from ._cuda_mempool import CudaMemPoolMixin
from ._cuda_nvml import CudaNvmlMixin
from ._cuda_vmm import CudaVmmMixin
from ._signals import deferred
from .base import Backend, DeviceProperties

# Integer #defines from driver_types.h (CUDA 13).
_STREAM_NON_BLOCKING = 0x01        # cudaStreamNonBlocking
_EVENT_BLOCKING_SYNC = 0x01        # cudaEventBlockingSync
_EVENT_DISABLE_TIMING = 0x02       # cudaEventDisableTiming
_EVENT_RECORD_EXTERNAL = 0x01      # cudaEventRecordExternal
_EVENT_WAIT_EXTERNAL = 0x01        # cudaEventWaitExternal
_HOST_ALLOC_DEFAULT = 0x00         # cudaHostAllocDefault
_MEMCPY_DEFAULT = 4                # cudaMemcpyDefault: direction inferred from unified addresses
_CAPTURE_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}  # cudaStreamCaptureMode
_GRAPH_AUTO_FREE_ON_LAUNCH = 1     # cudaGraphInstantiateFlagAutoFreeOnLaunch
_CAPTURE_STATUS_NONE = 0           # cudaStreamCaptureStatusNone

# cudaError_t values with a dedicated exception type (driver_types.h).
_ERR_MEMORY_ALLOCATION = 2
_ERR_NOT_READY = 600
_ERR_INVALID_RESOURCE_HANDLE = 400
# cudaStreamLegacy / cudaStreamPerThread (driver_types.h): aliases, not streams of their own
_STREAM_LEGACY, _STREAM_PER_THREAD = 1, 2
# cudaErrorStreamCapture* (900-906, 908) and cudaErrorCapturedEvent (907); 909 is
# cudaErrorTimeout and 910 cudaErrorGraphExecUpdateFailure, which are not capture misuse.
_CAPTURE_ERRORS = frozenset(range(900, 909))
# The device cannot run the kernel image: cudaErrorInvalidKernelImage (200),
# cudaErrorNoKernelImageForDevice (209), cudaErrorInvalidPtx (218),
# cudaErrorJitCompilerNotFound (221), cudaErrorUnsupportedPtxVersion (222),
# cudaErrorJitCompilationDisabled (223).  With lazy loading (CUDA_MODULE_LOADING=LAZY,
# the default since 12.2) they come from the first cudaLibraryGetKernel, not from
# cudaLibraryLoadData (measured on an H100: tests/conformance/cuda_h100_2026-12-05.json).
_KERNEL_IMAGE_ERRORS = frozenset({200, 209, 218, 221, 222, 223})
# Drivers before CUDA 12.3 refuse to load a module while a stream capture is underway (900, the
# capture invalidated); NVIDIA Warp, warp.capture_begin: kernels "can be loaded during graph
# capture on more recent drivers" (CUDA 12.3 or newer).  Unloading is refused by every driver
# (Warp issue 401), so accel unloads only when no capture is underway (accel/sim/cudart/modules.py,
# module_call_in_capture).
_MODULE_LOAD_IN_CAPTURE = 12030


# cudaDeviceAttr (driver_types.h) for the few properties read one by one.
_ATTR_COMPUTE_MAJOR = 75
_ATTR_COMPUTE_MINOR = 76
_ATTR_MULTIPROCESSOR_COUNT = 16    # cudaDevAttrMultiProcessorCount
_ATTR_INTEGRATED = 18              # cudaDevAttrIntegrated

_NUMPY_DTYPES = frozenset({
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "complex64", "complex128",
})

_ARG_CTYPES = {"ptr": "uint64_t *", "u32": "uint32_t *", "i32": "int32_t *", "u64": "uint64_t *",
               "i64": "int64_t *", "f32": "float *", "f64": "double *"}


def _declared_arity(module, symbol: str) -> int:
    """Number of parameters of ``symbol`` as declared in generated module ``module``."""
    import re
    m = re.search(r"\b%s\((.*?)\);" % re.escape(symbol), module.CDEF, re.S)
    params = m.group(1).strip()
    return 0 if params in ("", "void") else params.count(",") + 1


def _cudart_ffi_for(lib):
    """The ffi of the generated bindings for ``lib``'s runtime major (cudaRuntimeGetVersion
    has one signature in every major and starts nothing, so any bindings can read it)."""
    from .._ffi import _cudart, cudart_module
    v = _cudart.ffi.new("int *")
    if lib.cudaRuntimeGetVersion(v) != 0:
        return _cudart.ffi
    return cudart_module(v[0] // 1000).ffi


def _arg_cells(ffi, n: int):
    """A set of kernelParams for a launch of ``n`` arguments (CudaBackend.launch): ``(argv, slots,
    dims, owners)``.  ``argv`` is the ``void *[]`` pointing at one 8-byte cell per argument;
    ``slots[kind]`` is (view, stride): argument ``i`` of type ``kind`` is written at
    ``view[i * stride]``, its cell's first bytes (a 4-byte type through a 4-byte view).  ``dims`` is
    ``[grid, grid dim3, block, block dim3]``, the dimensions the two dim3s hold (None: not yet
    written).  ``owners``: the cdata that own the memory (casts, items and pointer arithmetic do
    not keep it alive)."""
    cells = ffi.new("uint64_t[]", max(n, 1))
    argv = ffi.new("void *[]", [ffi.cast("void *", cells + i) for i in range(n)] or [ffi.NULL])
    u64 = ffi.cast("uint64_t *", cells)
    slots = {"ptr": (u64, 1), "u64": (u64, 1), "i64": (ffi.cast("int64_t *", cells), 1),
             "f64": (ffi.cast("double *", cells), 1), "u32": (ffi.cast("uint32_t *", cells), 2),
             "i32": (ffi.cast("int32_t *", cells), 2), "f32": (ffi.cast("float *", cells), 2)}
    dim3s = ffi.new("dim3[2]")
    return argv, slots, [None, dim3s[0], None, dim3s[1]], (cells, dim3s)


class _ArgPools(threading.local):
    """Per thread, argument count -> [_arg_cells sets free for a launch] (CudaBackend.launch).
    Per thread so that the sets are bounded by the live threads: a thread's die with it (a shared
    pool kept as many as were ever in flight at once)."""

    def __init__(self):
        self.by_count = {}


class _DeferredDevice(threading.local):
    """A device scope's restore that CudaBackend.restore_device deferred (-1: none), per thread
    as CUDA's current device is."""
    index = -1


def _thread_alive(ident: int) -> bool:
    """Whether a thread with this ident runs (threads Python started, and foreign ones that
    called into it: those stay listed, so a foreign owner is taken to be alive)."""
    return any(t.ident == ident for t in threading.enumerate())


class CudaBackend(CudaDiscoveryMixin, CudaVmmMixin, CudaMemPoolMixin, CudaNvmlMixin, Backend):
    """The CUDA runtime (libcudart) as a :class:`Backend`."""

    name = "cuda"
    kernel_language = "ptx"
    supports_graphs = True
    supports_external_events = True   # cudaEventRecordWithFlags / cudaStreamWaitEvent flags (CUDA >= 11.1)
    shared_default_stream = True  # handle 0, the legacy stream of the *current* device
    supports_vmm = True           # cuMem* through cudaGetDriverEntryPoint (_cuda_vmm); vmm_supported per device
    _vmm_fns = None               # _cuda_vmm.DriverVmm, or why there is none (str), resolved at first use
    supports_async_alloc = True   # cudaMallocAsync + the default pool (_cuda_mempool); async_alloc_supported per device

    def __init__(self, simulated: bool):
        self.simulated = simulated
        self._lock = threading.Lock()
        # accel._locks.Lock: a __del__ run by a collection inside the first count that counts
        # devices (device_count, manual_seed) is refused instead of waiting on its own thread (r70m)
        self._count_lock = _locks.Lock("counting CUDA devices")
        self._rt = None          # (ffi, lib, path) of libcudart, opened on first use
        self._rt_error = None    # why libcudart could not be opened
        self._nvml = None        # (ffi, lib, path) of NVML, opened on first count
        self._nvml_error = None
        self._nvml_missing = False   # the library does not load (a failed nvmlInit_v2 is tried again)
        self._nvml_lock = _locks.Lock("initializing NVML")
        self._count = None
        self._count_env = None    # CUDA_VISIBLE_DEVICES the count was computed for
        self._smi_by_uuid: dict = {}   # CUDA index -> NVML index, matched by UUID (_cuda_nvml)
        self._uuids: Optional[List[str]] = None   # each device's "GPU-..." UUID, read at init
        self._count_final = False  # the runtime counted: it read the variable once, at cuInit
        self._count_path = ""
        self._count_reason = ""
        self._handles = {}       # int handle -> cdata, so hot calls skip ffi.cast
        self._arg_pools = _ArgPools()  # this thread's argument cells free for a launch
        self._live_modules = {}  # library handle -> PTX buffer kept alive for the runtime
        self._after_capture = deque()  # (fn, args): releases drivers refuse while a capture is underway
        self._driver_cuda = None  # cudaDriverGetVersion, read at first need
        self._kpath = None       # kernel path: "library", a _cuda_driver.DriverKernels, or why none
        self._captures = 0       # stream captures underway in this process
        # Backend.capture_gate: held from a "no capture underway" check through the potentially
        # unsafe calls it allows (cudaMalloc outside relaxed mode and the cuMem* calls here; the
        # allocators' event and stream queries, synchronizes and frees), and by capture_begin from
        # its count through cudaStreamBeginCapture (r63: a CI flake; r64: the queries)
        self.capture_gate = threading.RLock()
        self._capture_owners = {}  # capturing stream handle -> thread that began a non-relaxed capture
        self._capture_devices = {}  # capturing stream handle -> its device (host_wait_refused)
        self._out = threading.local()  # per-thread out-pointers for hot getters (no ffi.new per call)
        self._deferred = _DeferredDevice()  # per thread: a restore waiting for a primary context
        # threads that may have one (a hint, so the hot get_device skips the thread-local lookup)
        self._deferring = [0]
        self._deferring_lock = threading.Lock()
        self._ctx_fns = None     # cuDeviceGet + cuDevicePrimaryCtxGetState, or why there are none (str)
        self._ctx_seen = bytearray()   # [index]: 1 once that device's primary context was seen active
        self._rt_module = None   # accel._ffi.cudart_module of the opened runtime's major (checked)
        self._capture_info = (None, ())  # cudaStreamGetCaptureInfo[_v2] and its NULL outputs
        self._choice = None      # _cuda_libs.Choice: which libcudart, and every candidate's verdict
        self._choice_lock = _locks.Lock("choosing the CUDA runtime")
        self._rt_refused = None  # (ffi, lib, path) of an ACCEL_CUDART_PATH runtime the driver cannot run

    def fresh_locks_in_child(self) -> None:
        # _lock: opening libcudart and the kernel path; the others: counting, the runtime choice
        self._lock = threading.Lock()
        self._count_lock = _locks.Lock("counting CUDA devices")
        self._choice_lock = _locks.Lock("choosing the CUDA runtime")
        self._nvml_lock = _locks.Lock("initializing NVML")

    # -- libraries -------------------------------------------------------------
    def _open(self, which: str):
        from .._ffi import open_cudart
        if which == "cudart":
            choice = self.cudart_choice()
            if choice.chosen is None:
                raise OSError(choice.error)
        if self.simulated:
            from .. import sim
            from .._ffi import _nvml
            if which == "nvml":
                return _nvml.ffi, sim.open_library("nvml"), "accel.sim (nvml)"
            sim.select_runtime(choice.chosen.version)   # "load" the chosen simulated runtime
            lib = sim.open_library("cudart")
            return _cudart_ffi_for(lib), lib, choice.chosen.path
        if which == "nvml":
            from .._ffi import open_library
            return open_library("nvml")
        # the chosen file, through the bindings of its own major
        return open_cudart(choice.chosen.path, choice.chosen.version // 1000)

    def _runtime(self):
        rt = self._rt
        if rt is None:
            with self._lock:
                if self._rt is None and self._rt_error is None:
                    try:
                        opened = self._open("cudart")
                        choice = self._choice
                        if choice is not None and choice.error:
                            # ACCEL_CUDART_PATH honoured, but the driver cannot run it: say so at
                            # first runtime use instead of cudaErrorInsufficientDriver (35) from
                            # every call (report() still shows the library)
                            self._rt_refused, self._rt_error = opened, choice.error
                        else:
                            self._rt = opened
                    except OSError as exc:
                        why = str(exc)   # the chooser's "no libcudart the driver can run: ..." needs no prefix
                        self._rt_error = why if why.startswith("no libcudart") else f"libcudart could not be loaded: {why}"
                rt = self._rt
            if rt is None:
                raise AcceleratorError(self._rt_error, library="libcudart")
            self.ffi, self.lib = rt[0], rt[1]
        return rt

    def _check(self, rc: int, call: str, detail: str = "") -> None:
        if rc == 0:
            return
        ffi, lib = self.ffi, self.lib
        # A failed call also leaves rc in the thread's last-error slot (CUDA Runtime API,
        # cudaGetLastError: "Returns the last error that has been produced by any of the
        # runtime calls in the same instance of the CUDA Runtime library in the host
        # thread and resets it to cudaSuccess").  The error is reported here, as a Python
        # exception, so clear the slot as torch's C10_CUDA_CHECK does: otherwise torch in
        # the same process reports it again at its next launch check.  Sticky errors
        # (a faulted context) are not cleared by this; every later call returns them.
        lib.cudaGetLastError()
        name = ffi.string(lib.cudaGetErrorName(rc)).decode()
        text = ffi.string(lib.cudaGetErrorString(rc)).decode()
        if rc == _ERR_MEMORY_ALLOCATION:
            cls = OutOfMemoryError
        elif rc in _CAPTURE_ERRORS:
            cls = CaptureError
        elif rc in _KERNEL_IMAGE_ERRORS:
            cls = KernelImageError
        else:
            cls = AcceleratorError
        raise cls.from_call("libcudart", call, rc, name, f"{text}; {detail}" if detail else text)

    def clear_error(self) -> None:
        rt = self._rt
        if rt is not None:
            rt[1].cudaGetLastError()

    def _cast(self, ctype: str, handle: int):
        cdata = self._handles.get(handle)
        if cdata is None:
            # NULL (the legacy default stream, 0) passes for any pointer type, without a cast
            cdata = self.ffi.cast(ctype, handle) if handle else self.ffi.NULL
        return cdata

    def _as_int(self, cdata) -> int:
        return int(self.ffi.cast("uintptr_t", cdata))

    # -- discovery -------------------------------------------------------------
    def loads(self) -> bool:
        try:
            self._runtime()
            return True
        except AcceleratorError:
            return False

    # -- runtime ---------------------------------------------------------------
    def init(self) -> None:
        ffi, lib, _ = self._runtime()
        n = ffi.new("int *")
        rc = lib.cudaGetDeviceCount(n)
        self.driver_started = True
        if rc == _ERR_INSUFFICIENT_DRIVER:
            # the vendor's text ("driver version is insufficient") also where no driver is installed
            lib.cudaGetLastError()
            raise AcceleratorError.from_call("libcudart", "cudaGetDeviceCount", rc, "cudaErrorInsufficientDriver",
                                             self._insufficient_driver(ffi, lib))
        self._check(rc, "cudaGetDeviceCount")
        if n[0] == 0:
            raise AcceleratorError("libcudart: cudaGetDeviceCount reports no CUDA device",
                                   library="libcudart", call="cudaGetDeviceCount")
        self._reconcile_count(n[0])
        self.get_device = self._bind_get_device()
        self._uuids = self._read_uuids(n[0])

    def _read_uuids(self, count: int) -> Optional[List[str]]:
        """Each device's UUID as NVML prints it, read once at init so that NVML readings find
        their GPU by it later, in a child forked after init too, where the runtime refuses
        every call (_cuda_nvml.smi_index); None when one cannot be read."""
        ffi = self.ffi
        get_properties = self._rt_fn("cudaGetDeviceProperties")
        prop = ffi.new("struct cudaDeviceProp *")
        out = []
        for i in range(count):
            if get_properties(prop, i):
                self.lib.cudaGetLastError()      # (not sticky; cleared so no later call reports it)
                return None
            h = bytes(ffi.buffer(prop.uuid.bytes, 16)).hex()
            out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
        return out

    def _bindings(self):
        """The generated module (accel._ffi.cudart_module) whose ffi the runtime was opened
        with, after checking it is the runtime's major: cudaDeviceProp's layout and some
        symbols (cudaGetDeviceProperties_v2 on 12.x) differ, and a library read through
        another major's declarations answers garbage (an H200 as 1 SM, "integrated")."""
        mod = self._rt_module
        if mod is not None:
            return mod
        from .._ffi import CUDART_MAJORS, cudart_module
        ffi, lib = self.ffi, self.lib
        mod = next((cudart_module(m) for m in CUDART_MAJORS if cudart_module(m).ffi is ffi), None)
        v = ffi.new("int *")
        rc = lib.cudaRuntimeGetVersion(v)
        if rc != 0:
            self._check(rc, "cudaRuntimeGetVersion")
        major = v[0] // 1000
        have = int(mod.HEADER_VERSIONS["CUDART_VERSION"]) // 1000 if mod is not None else None
        if have != major:
            raise AcceleratorError(
                f"libcudart {self._rt[2] if self._rt else ''} is CUDA {major}.{v[0] % 1000 // 10} but was "
                f"opened with the CUDA {have} bindings; its struct layouts differ (use "
                f"accel._ffi.cudart_module({major}).ffi for it)", library="libcudart")
        self._rt_module = mod
        return mod

    def _rt_fn(self, name: str):
        """Library function ``name`` under the symbol the runtime major's headers give it."""
        return getattr(self.lib, self._bindings().ALIASES.get(name, name))

    def properties(self, index: int) -> DeviceProperties:
        ffi = self.ffi
        get_properties = self._rt_fn("cudaGetDeviceProperties")   # 12.x: cudaGetDeviceProperties_v2
        prop = ffi.new("struct cudaDeviceProp *")
        self._check(get_properties(prop, index), "cudaGetDeviceProperties")
        # The fields that shift between the CUDA 12 and 13 layouts come from
        # cudaDeviceGetAttribute, which is layout-free; the struct must agree with it, or
        # it was read through the wrong declarations (name, uuid and totalGlobalMem have
        # no attribute: they sit before the first difference of the layouts).
        sm = self._device_attribute(_ATTR_MULTIPROCESSOR_COUNT, index)
        integrated = self._device_attribute(_ATTR_INTEGRATED, index)
        cc = (self._device_attribute(_ATTR_COMPUTE_MAJOR, index),
              self._device_attribute(_ATTR_COMPUTE_MINOR, index))
        if (prop.multiProcessorCount, prop.integrated, prop.major, prop.minor) != (sm, integrated) + cc:
            raise AcceleratorError(
                f"libcudart: cudaDeviceProp of device {index} disagrees with cudaDeviceGetAttribute "
                f"(multiProcessorCount {prop.multiProcessorCount} vs {sm}, integrated {prop.integrated} vs "
                f"{integrated}): the struct layout of the bindings ({self._bindings().__name__}) is not "
                f"the runtime's", library="libcudart", call="cudaGetDeviceProperties")
        return DeviceProperties(
            index=index,
            name=ffi.string(prop.name).decode(errors="replace"),
            total_memory=prop.totalGlobalMem,
            compute_capability=cc,
            multi_processor_count=sm,
            supported_dtypes=_NUMPY_DTYPES,
            uuid=bytes(ffi.buffer(prop.uuid.bytes, 16)),     # torch's props.uuid; "GPU-" + str() for nvidia-smi's
            unified_memory=bool(integrated),
            # torch.cuda's names (torch/csrc/cuda/Module.cpp); gcnArchName is ROCm's only
            L2_cache_size=prop.l2CacheSize, warp_size=prop.warpSize,
            max_threads_per_multi_processor=prop.maxThreadsPerMultiProcessor,
            pci_bus_id=prop.pciBusID, pci_device_id=prop.pciDeviceID, pci_domain_id=prop.pciDomainID,
            # accel's names before these (kept)
            extra={"pci_bus_id": prop.pciBusID, "warp_size": prop.warpSize,
                   "max_threads_per_block": prop.maxThreadsPerBlock,
                   "l2_cache_size": prop.l2CacheSize},
        )

    def _device_attribute(self, attr: int, index: int) -> int:
        value = self.ffi.new("int *")
        self._check(self.lib.cudaDeviceGetAttribute(value, attr, index), "cudaDeviceGetAttribute")
        return value[0]

    def set_device(self, index: int) -> None:
        self._check(self.lib.cudaSetDevice(index), "cudaSetDevice")
        if self._deferring[0] and self._deferred.index >= 0:
            self._deferred.index = -1
            with self._deferring_lock:
                self._deferring[0] -= 1

    def get_device(self) -> int:
        # Replaced per instance by init() with _bind_get_device's closure; this
        # form only serves a backend used before init (which the layers never do).
        if self._deferring[0] and self._deferred.index >= 0:
            return self._deferred.index
        return self._runtime_device()

    def _runtime_device(self) -> int:
        """The runtime's current device of this thread (cudaGetDevice), whatever is deferred."""
        p = self.ffi.new("int *")
        self._check(self.lib.cudaGetDevice(p), "cudaGetDevice")
        return p[0]

    def device_deferred(self) -> bool:
        return bool(self._deferring[0]) and self._deferred.index >= 0

    def restore_device(self, index: int) -> None:
        """As torch's c10::cuda::MaybeSetDevice: cudaSetDevice creates the device's primary
        context (CUDA Programming Guide, "Initialization": "As of CUDA 12.0, ... cudaSetDevice()
        ... initialize[s] the primary context"), so a scope on device 1 must not end by making
        device 0 current when device 0 has none: work on device 1 alone would hold memory on
        device 0 for good.  Such a device is only recorded: get_device names it, and the next
        scope on it (on_device) makes it current."""
        if index != self._runtime_device() and not self.has_primary_context(index):
            if self._deferred.index < 0:
                with self._deferring_lock:
                    self._deferring[0] += 1
            self._deferred.index = index
            return
        self.set_device(index)

    def has_primary_context(self, index: int) -> bool:
        """Whether device ``index``'s primary context is active (cuDevicePrimaryCtxGetState,
        through the driver entry points; creates nothing).  True when the driver function
        cannot be reached: then restores stay eager, as before.  The entry points are looked
        up at the first restore, while the scope's device (which has its context) is current:
        the simulator counts cudaGetDriverEntryPoint as a call needing the current device's
        context, the runtime documentation being silent on it."""
        seen = self._ctx_seen
        if not seen:
            seen.extend(bytes(self.count()))    # one entry per device, made at the first question
        if index < len(seen) and seen[index]:
            return True             # accel never releases a primary context: once active, active
        fns = self._ctx_fns
        if fns is None:
            from ._cuda_driver import NoDriverFunction, resolve
            try:
                fns = resolve(self.ffi, self.lib, {"cuDeviceGet": "PFN_cuDeviceGet_v2000",
                                                   "cuDevicePrimaryCtxGetState":
                                                       "PFN_cuDevicePrimaryCtxGetState_v7000"})[0]
            except NoDriverFunction as exc:
                fns = str(exc)
            self._ctx_fns = fns
        if isinstance(fns, str):
            return True
        from .._ffi import _cudadrv
        d = _cudadrv.ffi
        dev = d.new("CUdevice_v1 *")
        flags = d.new("unsigned int *")
        active = d.new("int *")
        if fns["cuDeviceGet"](dev, index) or fns["cuDevicePrimaryCtxGetState"](dev[0], flags, active):
            return True          # unknown: restore eagerly (what cudaSetDevice reports is then checked)
        if active[0]:
            if index < len(seen):
                seen[index] = 1
        return bool(active[0])

    def _bind_get_device(self):
        """get_device as a closure over the library function and a per-thread out-pointer:
        current_stream() calls it for every queued operation, so no attribute lookups."""
        cuda_get_device, ffi, check, out = self.lib.cudaGetDevice, self.ffi, self._check, self._out
        deferred, deferring = self._deferred, self._deferring

        def get_device() -> int:
            if deferring[0] and deferred.index >= 0:
                return deferred.index
            try:
                p = out.int_p
            except AttributeError:
                p = out.int_p = ffi.new("int *")
            rc = cuda_get_device(p)
            if rc:
                check(rc, "cudaGetDevice")
            return p[0]

        get_device.__doc__ = CudaBackend.get_device.__doc__
        return get_device

    def device_synchronize(self) -> None:
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def mem_info(self) -> Tuple[int, int]:
        free, total = self.ffi.new("size_t *"), self.ffi.new("size_t *")
        self._check(self.lib.cudaMemGetInfo(free, total), "cudaMemGetInfo")
        return free[0], total[0]

    # -- memory ----------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        return self._alloc_maybe_capturing("cudaMalloc", self.lib.cudaMalloc, self.lib.cudaFree, nbytes,
                                           what="device memory")

    def _alloc_maybe_capturing(self, call: str, alloc, free, nbytes, *args, what: str) -> int:
        """``alloc(void **, nbytes, *args)`` (cudaMalloc, cudaHostAlloc), checked (the error
        names ``nbytes`` of ``what``); the pointer as an int."""
        p = self.ffi.new("void **")
        rc = None
        try:
            # cudaMalloc is a "potentially unsafe" call that invalidates a global-mode capture; it
            # is fine as long as the memory outlives replays, so the mode is relaxed around it
            # (torch's cudaMallocMaybeCapturing does the same)
            rc = self._call_maybe_capturing(alloc, p, nbytes, *args)
            self._check(rc, call, f"requested {nbytes} bytes of {what}")
            return self._as_int(p[0])
        except BaseException:
            # The memory is allocated but the caller never gets it: a KeyboardInterrupt as the
            # runtime returned (CPython runs a signal's handler right after a C call, before its
            # result is stored), or the capture mode's restore failing after the allocation (the
            # thread is still relaxed then, so the free is allowed).  Freed here, so a failed or
            # interrupted allocation leaves nothing (the runtime writes the pointer only on
            # success; p starts NULL).
            if rc in (None, 0) and p[0] != self.ffi.NULL:
                # (relaxed as the allocation was: in a global capture a plain cudaFree is refused
                # and invalidates it, r69a)
                self._call_maybe_capturing(free, p[0])
            raise

    def _call_maybe_capturing(self, fn, *args) -> int:
        """``fn(*args)``'s return code, in relaxed capture mode while a capture is underway in
        this process (no capture begins meanwhile: the gate), for a "potentially unsafe" call
        that acts at once and must not invalidate a capture (allocations, memory pool calls)."""
        # (rc stored inside the with: a signal checked as the call returns then lands in the
        # with's cleanup range, which releases the gate; tests/test_interrupt_fresh_r57.py)
        with self.capture_gate:
            if self._captures:
                rc = self._call_relaxed(fn, *args)
            else:
                rc = fn(*args)
        return rc

    @deferred
    def _call_relaxed(self, fn, *args) -> int:
        """``fn(*args)`` with this thread in relaxed capture mode, its own mode restored after.
        Signals are deferred (none of these calls waits): a Ctrl-C between the two exchanges
        would leave the thread relaxed, every later unsafe call of it unchecked (r69a).  A
        failed restore is tried once more before it raises, for the same reason."""
        exchange = self.lib.cudaThreadExchangeStreamCaptureMode
        mode = self.ffi.new("enum cudaStreamCaptureMode *", _CAPTURE_MODES["relaxed"])
        self._check(exchange(mode), "cudaThreadExchangeStreamCaptureMode")
        try:
            rc = fn(*args)
        finally:
            err = exchange(mode)     # (a failed exchange leaves *mode as it was)
            if err:
                err = exchange(mode)
                if not err:
                    self.lib.cudaGetLastError()      # (the first failure's, now moot)
        self._check(err, "cudaThreadExchangeStreamCaptureMode", "restoring this thread's capture mode")
        return rc

    def mem_free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(self.ffi.cast("void *", ptr)), "cudaFree")

    def host_alloc(self, nbytes: int) -> int:
        return self._alloc_maybe_capturing("cudaHostAlloc", self.lib.cudaHostAlloc, self.lib.cudaFreeHost,
                                           nbytes, _HOST_ALLOC_DEFAULT, what="pinned host memory")

    def host_free(self, ptr: int) -> None:
        self._check(self.lib.cudaFreeHost(self.ffi.cast("void *", ptr)), "cudaFreeHost")

    # -- streams ---------------------------------------------------------------
    def stream_create(self, priority: int = 0) -> int:
        p = self.ffi.new("cudaStream_t *")
        self._check(self.lib.cudaStreamCreateWithPriority(p, _STREAM_NON_BLOCKING, priority),
                    "cudaStreamCreateWithPriority")
        handle = self._as_int(p[0])
        self._handles[handle] = p[0]
        return handle

    def stream_destroy(self, stream: int) -> None:
        self._check(self.lib.cudaStreamDestroy(self._cast("cudaStream_t", stream)), "cudaStreamDestroy")
        self._handles.pop(stream, None)

    def default_stream(self, index: int) -> int:
        return 0  # the legacy default stream; each device's is selected by the current device

    def foreign_stream(self, stream: int) -> Tuple[int, Optional[int]]:
        if stream in (0, _STREAM_LEGACY):
            return 0, None      # the legacy default stream of the current device, as handle 0
        if stream == _STREAM_PER_THREAD:
            raise ValueError("handle 2 is cudaStreamPerThread, which names another stream in every host "
                             "thread: accel keys cached memory and events by the handle value, so it cannot "
                             "wrap it; create a stream (accel.Stream()) or pass a created stream's handle")
        from .._ffi import has_symbol
        if not has_symbol(self.lib, "cudaStreamGetDevice"):
            return stream, None     # before CUDA 12.8 the runtime cannot say (nor can torch)
        out = self.ffi.new("int *")
        rc = self.lib.cudaStreamGetDevice(self._cast("cudaStream_t", stream), out)
        if rc == _ERR_INVALID_RESOURCE_HANDLE:
            self.lib.cudaGetLastError()     # reported here: clear the thread's last-error slot
            raise ValueError(f"{stream:#x} is not a live CUDA stream (cudaStreamGetDevice: "
                             f"cudaErrorInvalidResourceHandle); pass the cudaStream_t of a stream that "
                             f"exists, and keep it alive while accel uses it")
        self._check(rc, "cudaStreamGetDevice")
        return stream, out[0]

    def stream_priority_range(self) -> Tuple[int, int]:
        least, greatest = self.ffi.new("int *"), self.ffi.new("int *")
        self._check(self.lib.cudaDeviceGetStreamPriorityRange(least, greatest),
                    "cudaDeviceGetStreamPriorityRange")
        return least[0], greatest[0]

    def stream_synchronize(self, stream: int) -> None:
        self._check(self.lib.cudaStreamSynchronize(self._cast("cudaStream_t", stream)),
                    "cudaStreamSynchronize")

    def stream_query(self, stream: int) -> bool:
        # Hot path (polled): the cached cdata read inline (_cast's lookup), _check only on failure.
        rc = self.lib.cudaStreamQuery(self._handles.get(stream) or self._cast("cudaStream_t", stream))
        if rc:
            if rc == _ERR_NOT_READY:
                return False
            self._check(rc, "cudaStreamQuery")
        return True

    def stream_wait_event(self, stream: int, event: int, external: bool = False) -> None:
        # As torch's CUDAEvent::block: cudaEventWaitExternal only while the stream captures
        # (cuda.h, CUevent_wait_flags: the flag "is invalid when used outside of capture").
        flags = _EVENT_WAIT_EXTERNAL if external and self.stream_is_capturing(stream) else 0
        self._check(self.lib.cudaStreamWaitEvent(self._cast("cudaStream_t", stream),
                                                 self._cast("cudaEvent_t", event), flags),
                    "cudaStreamWaitEvent")

    # -- events ----------------------------------------------------------------
    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int:
        flags = (0 if enable_timing else _EVENT_DISABLE_TIMING) | (_EVENT_BLOCKING_SYNC if blocking else 0)
        p = self.ffi.new("cudaEvent_t *")
        self._check(self.lib.cudaEventCreateWithFlags(p, flags), "cudaEventCreateWithFlags")
        handle = self._as_int(p[0])
        self._handles[handle] = p[0]
        return handle

    def event_destroy(self, event: int) -> None:
        self._check(self.lib.cudaEventDestroy(self._cast("cudaEvent_t", event)), "cudaEventDestroy")
        self._handles.pop(event, None)

    def event_record(self, event: int, stream: int, external: bool = False) -> None:
        if external and self.stream_is_capturing(stream):
            # An event record node (torch's CUDAEvent::record with external_): cuda.h,
            # CUevent_record_flags: cudaEventRecordExternal "is invalid when used outside of capture".
            self._check(self.lib.cudaEventRecordWithFlags(self._cast("cudaEvent_t", event),
                                                          self._cast("cudaStream_t", stream),
                                                          _EVENT_RECORD_EXTERNAL), "cudaEventRecordWithFlags")
            return
        # Hot path: the cached cdata read inline (_cast's lookup), _check only on failure.
        handles = self._handles
        rc = self.lib.cudaEventRecord(handles.get(event) or self._cast("cudaEvent_t", event),
                                      handles.get(stream) or self._cast("cudaStream_t", stream))
        if rc:
            self._check(rc, "cudaEventRecord")

    def event_synchronize(self, event: int) -> None:
        self._check(self.lib.cudaEventSynchronize(self._cast("cudaEvent_t", event)), "cudaEventSynchronize")

    def event_query(self, event: int) -> bool:
        rc = self.lib.cudaEventQuery(self._cast("cudaEvent_t", event))
        if rc == _ERR_NOT_READY:
            return False
        self._check(rc, "cudaEventQuery")
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        ms = self.ffi.new("float *")
        self._check(self.lib.cudaEventElapsedTime(ms, self._cast("cudaEvent_t", start),
                                                  self._cast("cudaEvent_t", end)), "cudaEventElapsedTime")
        return ms[0]

    # -- copies ----------------------------------------------------------------
    def _registered(self, ptr: int) -> bool:
        """True when ``ptr`` lies in memory the runtime knows (device, pinned or managed)."""
        attrs = self.ffi.new("struct cudaPointerAttributes *")
        self._check(self.lib.cudaPointerGetAttributes(attrs, self.ffi.cast("void *", ptr)),
                    "cudaPointerGetAttributes")
        return attrs.type != self.lib.cudaMemoryTypeUnregistered

    def pointer_location(self, ptr: int) -> Optional[Tuple[str, int]]:
        # cudaPointerGetAttributes (Runtime API, Unified Addressing): type Device/Managed/Host/
        # Unregistered and the device of the allocation, for any address inside one.
        attrs = self.ffi.new("struct cudaPointerAttributes *")
        self._check(self.lib.cudaPointerGetAttributes(attrs, self.ffi.cast("void *", ptr)),
                    "cudaPointerGetAttributes")
        kind = {self.lib.cudaMemoryTypeDevice: "device", self.lib.cudaMemoryTypeManaged: "managed",
                self.lib.cudaMemoryTypeHost: "host"}.get(attrs.type)
        return (kind, attrs.device) if kind is not None else ("unknown", -1)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        cast = self.ffi.cast
        if nbytes and not self._registered(dst) and not self._registered(src):
            # cudaMemcpyDefault takes two unknown pointers as host memory and memmoves on the host:
            # a freed device pointer there crashes the process.  accel never copies host to host.
            raise ValueError(f"cuda: memcpy_async({dst:#x}, {src:#x}, {nbytes}): neither pointer is inside a "
                             f"live CUDA allocation (freed or foreign memory?); copy to or from memory "
                             f"returned by mem_alloc/host_alloc that has not been freed")
        self._check(self.lib.cudaMemcpyAsync(cast("void *", dst), cast("void *", src), nbytes,
                                             _MEMCPY_DEFAULT, self._cast("cudaStream_t", stream)),
                    "cudaMemcpyAsync")

    def memcpy_peer_async(self, dst: int, dst_index: int, src: int, src_index: int, nbytes: int,
                          stream: int) -> None:
        # Between devices without peer access the driver stages the copy through the host, and
        # only cudaMemcpyPeerAsync does so for pool (cudaMallocAsync) and mapped (cuMemMap)
        # memory (torch, ATen/native/cuda/Copy.cu and CUDACachingAllocator's memcpyAsync:
        # "when p2p is not enabled, only cudaMemcpyPeerAsync correctly handles memory not
        # allocated via cudaMalloc"); cudaMemcpyAsync faults there (cudaErrorIllegalAddress).
        cast = self.ffi.cast
        self._check(self.lib.cudaMemcpyPeerAsync(cast("void *", dst), dst_index, cast("void *", src), src_index,
                                                 nbytes, self._cast("cudaStream_t", stream)),
                    "cudaMemcpyPeerAsync")

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        # Hot path: the cached cdata read inline (_cast's lookup), _check only on failure.
        rc = self.lib.cudaMemsetAsync(self.ffi.cast("void *", ptr), value, nbytes,
                                      self._handles.get(stream) or self._cast("cudaStream_t", stream))
        if rc:
            self._check(rc, "cudaMemsetAsync")

    # -- graphs ------------------------------------------------------------------
    def capture_begin(self, stream: int, mode: str) -> None:
        if mode not in _CAPTURE_MODES:
            raise ValueError(f"capture mode must be one of {', '.join(_CAPTURE_MODES)}, got {mode!r}")
        handle = self._cast("cudaStream_t", stream)
        # Counted (and owned) before the call, taken back when no capture began: a KeyboardInterrupt
        # as the call returns must not leave a capture the count misses (capture_underway() then
        # lets event queries invalidate it).
        me = threading.get_ident()
        device = self.get_device()      # (the caller makes the stream's device current)
        with self.capture_gate:
            try:
                self._captures += 1
                self._capture_devices[stream] = device
                if mode != "relaxed":
                    self._capture_owners[stream] = me
                self._check(self.lib.cudaStreamBeginCapture(handle, _CAPTURE_MODES[mode]),
                            "cudaStreamBeginCapture")
            except BaseException:
                if not self._still_capturing(handle, unknown=False):
                    self._captures -= 1
                    self._capture_owners.pop(stream, None)
                    self._capture_devices.pop(stream, None)
                raise

    def capture_end(self, stream: int) -> int:
        owner = self._capture_owners.get(stream)
        if owner is not None and owner != threading.get_ident() and _thread_alive(owner):
            # Only the thread that began a global or thread_local capture may end it (Runtime API,
            # cudaStreamEndCapture: cudaErrorStreamCaptureWrongThread), and the refused call still
            # ends the capture, discarding it (measured on an H200, tools/cuda_conformance.py): so it
            # is not made, and the capture goes on for its own thread to end.  When that thread has
            # exited, nothing else ever could (r72e: every later synchronize, free and capture was
            # refused): the call is made, and the capture discarded with its error.
            raise CaptureError(f"cudaStreamEndCapture from another thread than the one that began the capture "
                               f"of stream {stream:#x}: CUDA refuses it (cudaErrorStreamCaptureWrongThread) and "
                               f"discards the capture, so accel did not call it; end the capture on the thread "
                               f"that began it, or capture with capture_error_mode='relaxed'",
                               library="libcudart", call="cudaStreamEndCapture")
        p = self.ffi.new("cudaGraph_t *")
        handle = self._cast("cudaStream_t", stream)
        with self.capture_gate:
            # (the gate: until the call has ended the capture, no other thread may find it ended
            # by the count and make a call that invalidates it)
            rc = self._end_capture(stream, owner, handle, p)
        self._check(rc, "cudaStreamEndCapture")
        return self._as_int(p[0])

    def _end_capture(self, stream: int, owner, handle, p) -> int:
        """capture_end's call, the gate held: its return code, the count and owners updated, and
        the releases queued during the captures run once the last one ended."""
        # Uncounted before the call, counted again while the capture goes on: a KeyboardInterrupt
        # as the call returns must not leave an ended capture counted (capture_underway() would
        # then refuse syncs and frees for good).
        device = self._capture_devices.get(stream)
        try:
            self._captures -= 1
            self._capture_devices.pop(stream, None)
            if owner is not None:
                del self._capture_owners[stream]
            rc = self.lib.cudaStreamEndCapture(handle, p)
            if rc != 0 and self._still_capturing(handle):
                # A failed cudaStreamEndCapture ends only an invalidated capture (CUDA Runtime API,
                # cudaStreamEndCapture); one still underway would forbid syncs, frees and new
                # captures in the whole process, so end it again and discard what it captured.
                again = self.ffi.new("cudaGraph_t *")
                if self.lib.cudaStreamEndCapture(handle, again) == 0 and again[0] != self.ffi.NULL:
                    # deferred while another capture is underway, as graph_destroy
                    if not self._after_captures(self._graph_destroy_now, self._as_int(again[0])):
                        self.lib.cudaGraphDestroy(again[0])
        except BaseException:
            if self._still_capturing(handle, unknown=False):
                self._captures += 1
                self._capture_devices[stream] = device
                if owner is not None:
                    self._capture_owners[stream] = owner
            raise
        if rc != 0 and self._still_capturing(handle):
            self._captures += 1
            self._capture_devices[stream] = device
            if owner is not None:
                self._capture_owners[stream] = owner
        elif not self._captures and self._after_capture:
            self._run_after_captures()
        return rc

    def _still_capturing(self, handle, unknown: bool = True) -> bool:
        """Whether ``handle`` is being captured; ``unknown`` when the runtime cannot tell (True
        after a failed end: assume it is; False after an interrupted begin or end: the count
        then follows the call's own outcome)."""
        status = self.ffi.new("enum cudaStreamCaptureStatus *")
        if self.lib.cudaStreamIsCapturing(handle, status) != 0:
            return unknown
        return status[0] != _CAPTURE_STATUS_NONE

    def stream_is_capturing(self, stream: int) -> bool:
        status = self.ffi.new("enum cudaStreamCaptureStatus *")
        self._check(self.lib.cudaStreamIsCapturing(self._cast("cudaStream_t", stream), status),
                    "cudaStreamIsCapturing")
        return status[0] != _CAPTURE_STATUS_NONE

    def capture_id(self, stream: int) -> Optional[int]:
        out = self._out         # per-thread out-pointers: asked at every event record and wait in a capture
        try:
            status, ident = out.capture_info
        except AttributeError:
            status, ident = out.capture_info = (self.ffi.new("enum cudaStreamCaptureStatus *"),
                                                self.ffi.new("unsigned long long *"))
        # The first three parameters (stream, status, id) are the same in every version of
        # cudaStreamGetCaptureInfo (CUDA 12 headers: cudaStreamGetCaptureInfo_v2, 6 parameters;
        # CUDA 13: 7); the optional outputs after them are NULL.
        fn, nulls = self._capture_info
        if fn is None:
            mod = self._bindings()
            fn = self._rt_fn("cudaStreamGetCaptureInfo")
            nulls = (self.ffi.NULL,) * (_declared_arity(mod, mod.ALIASES.get("cudaStreamGetCaptureInfo",
                                                                              "cudaStreamGetCaptureInfo")) - 3)
            self._capture_info = (fn, nulls)
        self._check(fn(self._cast("cudaStream_t", stream), status, ident, *nulls), "cudaStreamGetCaptureInfo")
        return None if status[0] == _CAPTURE_STATUS_NONE else ident[0]

    def captures_underway(self) -> int:
        return self._captures

    def host_wait_refused(self, stream: int) -> Optional[str]:
        # Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled Operations": synchronizing
        # a stream not being captured is valid, except the legacy stream, which synchronizes with
        # the blocking streams of its device (those in a capture included).  But cudaStreamSynchronize
        # and cudaEventSynchronize are "potentially unsafe" calls (cudaStreamBeginCapture's modes):
        # measured on an H100 (tests/conformance/cuda_h100_2026-12-05.json, unsafe_cudaStreamSynchronize_*)
        # they fail with 900 and invalidate the capture while this thread has a global or thread_local
        # capture, or another thread a global one (thread_local ones of other threads allow them; the
        # mode is not kept per stream here, so those refuse too)
        if not self._captures:
            return None
        if stream == 0 and (len(self._capture_devices) < self._captures
                            or self.get_device() in self._capture_devices.values()):
            # (the current device's legacy stream: it synchronizes with that device's blocking
            # streams only, Programming Guide "Implicit Synchronization")
            return "the legacy default stream synchronizes with the streams being captured"
        me = threading.get_ident()
        for owner in self._capture_owners.values():
            return ("this thread's global or thread_local capture forbids a host wait" if owner == me
                    else "another thread's global capture forbids a host wait")
        return None

    def graph_instantiate(self, graph: int) -> int:
        p = self.ffi.new("cudaGraphExec_t *")
        # As torch's CUDAGraph::instantiate: allocations a graph does not free itself (its
        # outputs, with backend:cudaMallocAsync) are freed by its next launch (cudaGraphLaunch
        # fails with unfreed allocations otherwise); no effect on graphs without them.
        self._check(self.lib.cudaGraphInstantiate(p, self.ffi.cast("cudaGraph_t", graph),
                                                  _GRAPH_AUTO_FREE_ON_LAUNCH), "cudaGraphInstantiate")
        return self._as_int(p[0])

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        self._check(self.lib.cudaGraphLaunch(self.ffi.cast("cudaGraphExec_t", graph_exec),
                                             self._cast("cudaStream_t", stream)), "cudaGraphLaunch")

    def graph_destroy(self, graph: int) -> None:
        """cudaGraphDestroy; while a capture is underway in this process, once the last one ended
        (drivers refuse it during a capture and invalidate the capture: PyTorch PR 161037)."""
        self._now_or_after_captures(self._graph_destroy_now, graph)

    def _graph_destroy_now(self, graph: int) -> None:
        self._check(self.lib.cudaGraphDestroy(self.ffi.cast("cudaGraph_t", graph)), "cudaGraphDestroy")

    def graph_exec_destroy(self, graph_exec: int) -> None:
        """cudaGraphExecDestroy, deferred during captures as :meth:`graph_destroy`."""
        self._now_or_after_captures(self._graph_exec_destroy_now, graph_exec)

    def _graph_exec_destroy_now(self, graph_exec: int) -> None:
        self._check(self.lib.cudaGraphExecDestroy(self.ffi.cast("cudaGraphExec_t", graph_exec)),
                    "cudaGraphExecDestroy")

    def graph_node_count(self, graph: int) -> Optional[int]:
        n = self.ffi.new("size_t *")
        self._check(self.lib.cudaGraphGetNodes(self._cast("cudaGraph_t", graph), self.ffi.NULL, n),
                    "cudaGraphGetNodes")
        return int(n[0])

    def graph_debug_dot(self, graph: int, path: str) -> None:
        self._check(self.lib.cudaGraphDebugDotPrint(self.ffi.cast("cudaGraph_t", graph),
                                                    os.fsencode(path), 1),  # cudaGraphDebugDotFlagsVerbose
                    "cudaGraphDebugDotPrint")

    # -- kernels -----------------------------------------------------------------
    def kernel_path(self) -> dict:
        """How kernels load on this runtime, from its exported symbols (calls nothing):
        {"kernel_path": "library" | "driver" | None, "kernel_path_detail": ...}."""
        from ._cuda_driver import plan
        try:
            _, lib, _ = self._runtime()
        except AcceleratorError as exc:
            return {"kernel_path": None, "kernel_path_detail": str(exc)}
        path, why = plan(lib)
        return {"kernel_path": path or None, "kernel_path_detail": why}

    def _kernels(self):
        """The resolved kernel path: "library", or the DriverKernels; AcceleratorError if none."""
        path = self._kpath
        if path is None:
            from ._cuda_driver import DriverKernels, NoKernelPath, plan
            with self._lock:
                if self._kpath is None:
                    kind, why = plan(self.lib)
                    try:
                        if not kind:
                            raise NoKernelPath(why)
                        self._kpath = "library" if kind == "library" else DriverKernels(self.ffi, self.lib)
                    except NoKernelPath as exc:
                        self._kpath = str(exc)
                path = self._kpath
        if isinstance(path, str) and path != "library":
            raise AcceleratorError(f"libcudart: {path}; kernels run on the host path instead",
                                   library="libcudart")
        return path

    def _check_driver(self, drv, rc: int, call: str) -> None:
        if rc == 0:
            return
        name = drv.error_name(rc)
        # CUresult shares these values with cudaError_t (cuda.h / driver_types.h).
        cls = (OutOfMemoryError if rc == _ERR_MEMORY_ALLOCATION else CaptureError if rc in _CAPTURE_ERRORS
               else KernelImageError if rc in _KERNEL_IMAGE_ERRORS else AcceleratorError)
        raise cls.from_call("libcuda (through cudaGetDriverEntryPoint)", call, rc, name)

    def _driver_cuda_version(self) -> int:
        """The CUDA version the driver supports (cudaDriverGetVersion, e.g. 12020)."""
        v = self._driver_cuda
        if v is None:
            p = self.ffi.new("int *")
            self._check(self.lib.cudaDriverGetVersion(p), "cudaDriverGetVersion")
            v = self._driver_cuda = p[0]
        return v

    def module_load(self, source: bytes) -> int:
        if isinstance(source, str):
            source = source.encode()
        path = self._kernels()
        old = self._driver_cuda_version() < _MODULE_LOAD_IN_CAPTURE
        # (on such a driver, the gate: no capture begins between the check and the load)
        with self.capture_gate if old else contextlib.nullcontext():
            if old and self._captures:
                v = self._driver_cuda_version()
                # refused before the driver would refuse it, which would also invalidate the capture
                raise CaptureError(f"cannot load a module while a stream capture is underway: the driver "
                                   f"supports CUDA {v // 1000}.{v % 1000 // 10}, and drivers before CUDA 12.3 "
                                   f"refuse it (and invalidate the capture); load the module before the "
                                   f"capture begins, or update the driver", library="libcudart",
                                   call="module_load")
            return self._load(path, source)

    def _load(self, path, source: bytes) -> int:
        image = self.ffi.new("char[]", source)  # NUL-terminated, as the JIT requires for PTX
        if path != "library":
            handle, rc = path.load(image)
            self._check_driver(path, rc, "cuModuleLoadData")
            self._live_modules[handle] = image
            return handle
        p = self.ffi.new("cudaLibrary_t *")
        NULL = self.ffi.NULL
        self._check(self.lib.cudaLibraryLoadData(p, image, NULL, NULL, 0, NULL, NULL, 0),
                    "cudaLibraryLoadData")
        handle = self._as_int(p[0])
        self._live_modules[handle] = image
        return handle

    def module_unload(self, module: int) -> None:
        """Unload ``module`` (of the current device); while a capture is underway in this process
        the unload waits for the last capture to end (a driver refuses it, 900, and invalidates
        the capture)."""
        self._now_or_after_captures(self._unload_on, module, self.get_device())

    def _unload_now(self, module: int) -> None:
        path = self._kernels()
        if path != "library":
            self._check_driver(path, path.unload(module), "cuModuleUnload")
        else:
            self._check(self.lib.cudaLibraryUnload(self.ffi.cast("cudaLibrary_t", module)), "cudaLibraryUnload")
        self._live_modules.pop(module, None)

    def _unload_on(self, module: int, index: int) -> None:
        """Unload ``module`` with its device ``index`` current (cuModuleUnload unloads "from the
        current context")."""
        prev = self.get_device()
        if prev != index:
            self.set_device(index)
        try:
            self._unload_now(module)
        finally:
            if prev != index:
                self.set_device(prev)

    def module_function(self, module: int, name: str) -> int:
        path = self._kernels()
        if path != "library":
            handle, rc = path.function(module, name)
            self._check_driver(path, rc, "cuModuleGetFunction")
            return handle
        p = self.ffi.new("cudaKernel_t *")
        self._check(self.lib.cudaLibraryGetKernel(p, self.ffi.cast("cudaLibrary_t", module), name.encode()),
                    "cudaLibraryGetKernel")
        return self._as_int(p[0])

    def launch(self, function, grid, block, args, shared_mem, stream) -> None:
        # Hot path (issue 18: host time per launch within 2x of a bare cudaLaunchKernel): the
        # argument cells, their void *[] and the dim3s are reused, not made per call.  cuLaunchKernel
        # (under cudaLaunchKernel): each kernelParams entry points to "a region of memory from which
        # the actual kernel parameter will be copied", at the call (a capture copies them into the
        # node), so once the call returns the cells are free for the next launch.  A set is taken
        # from the calling thread's pool for this call alone (popped: a launch reentered on this
        # thread from a finalizer or signal handler takes another), and goes back only after a
        # call that returned: an error or a Ctrl-C in between leaves that set (maybe half
        # written) to the collector.
        pools = self._arg_pools.by_count
        try:
            cells = pools[len(args)].pop()
        except (KeyError, IndexError):
            cells = _arg_cells(self.ffi, len(args))
        argv, slots, dims, _ = cells
        try:
            i = 0
            for kind, value in args:
                view, at = slots[kind]
                view[i * at] = value
                i += 1
        except KeyError as exc:
            raise ValueError(f"unknown kernel argument type {exc.args[0]!r}; "
                             f"expected one of {', '.join(_ARG_CTYPES)}") from None
        path = self._kpath
        if path is not None and path != "library":
            rc = path.launch(function, tuple(grid), tuple(block), argv, shared_mem, stream)
            pools.setdefault(len(args), []).append(cells)
            self._check_driver(path, rc, "cuLaunchKernel")
            return
        # cudaLaunchKernel accepts a cudaKernel_t in place of a host function pointer.  dim3 is
        # passed by value (cffi copies it into the call): the set's two are rewritten only when
        # the launch's dimensions differ from its last ones.
        if dims[0] != grid:
            d = dims[1]
            d.x, d.y, d.z = grid
            dims[0] = grid if type(grid) is tuple else None
        if dims[2] != block:
            d = dims[3]
            d.x, d.y, d.z = block
            dims[2] = block if type(block) is tuple else None
        rc = self.lib.cudaLaunchKernel(self.ffi.cast("void *", function), dims[1], dims[3], argv, shared_mem,
                                       self._handles.get(stream) or self._cast("cudaStream_t", stream))
        pools.setdefault(len(args), []).append(cells)
        if rc:
            self._check(rc, "cudaLaunchKernel")

    # -- user kernels: limits, attributes, occupancy (accel.kernels) ---------------------------
    def launch_limits(self, index: int) -> dict:
        a = self._device_attribute
        # cudaDevAttrMaxBlockDimX..Z (2-4), MaxGridDimX..Z (5-7), MaxThreadsPerBlock (1),
        # MaxSharedMemoryPerBlock (8), MaxSharedMemoryPerBlockOptin (97)
        return {"max_block": (a(2, index), a(3, index), a(4, index)),
                "max_grid": (a(5, index), a(6, index), a(7, index)),
                "max_threads_per_block": a(1, index), "max_shared_per_block": a(8, index),
                "max_shared_per_block_optin": a(97, index)}

    # CUfunction_attribute (cuda.h): the driver path reads them one by one
    _CU_FUNC_ATTRS = {"max_threads_per_block": 0, "shared_size_bytes": 1, "num_regs": 4,
                      "max_dynamic_shared_size_bytes": 8}

    def function_attributes(self, function: int) -> dict:
        path = self._kernels()
        if path != "library":
            out = {}
            for key, attrib in self._CU_FUNC_ATTRS.items():
                value, rc = path.func_get_attribute(function, attrib)
                self._check_driver(path, rc, "cuFuncGetAttribute")
                out[key] = value
            return out
        attr = self.ffi.new("struct cudaFuncAttributes *")
        self._check(self.lib.cudaFuncGetAttributes(attr, self.ffi.cast("void *", function)),
                    "cudaFuncGetAttributes")
        return {"max_threads_per_block": attr.maxThreadsPerBlock, "num_regs": attr.numRegs,
                "shared_size_bytes": attr.sharedSizeBytes,
                "max_dynamic_shared_size_bytes": attr.maxDynamicSharedSizeBytes}

    def function_set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        # cudaFuncAttributeMaxDynamicSharedMemorySize = CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
        path = self._kernels()
        if path != "library":
            self._check_driver(path, path.func_set_attribute(function, 8, nbytes), "cuFuncSetAttribute")
            return
        self._check(self.lib.cudaFuncSetAttribute(self.ffi.cast("void *", function), 8, nbytes),
                    "cudaFuncSetAttribute")

    def occupancy_max_active_blocks(self, function: int, block_size: int, dynamic_smem: int) -> int:
        path = self._kernels()
        if path != "library":
            n, rc = path.occupancy(function, block_size, dynamic_smem)
            self._check_driver(path, rc, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            return n
        n = self.ffi.new("int *")
        self._check(self.lib.cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            n, self.ffi.cast("void *", function), block_size, dynamic_smem),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor")
        return n[0]


def create() -> CudaBackend:
    return CudaBackend(simulated=os.environ.get("ACCEL_SIM", "").strip().lower() == "cuda")
