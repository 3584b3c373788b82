"""Kernels: modules, functions, launches, limits and occupancy (a mixin of
:class:`accel.backends.cuda.CudaBackend`).

Kernels (a fatbin with SASS, or PTX the driver JITs) are loaded with ``cudaLibraryLoadData`` /
``cudaLibraryGetKernel`` and launched with ``cudaLaunchKernel`` where the runtime has them
(12.8+); older runtimes reach the driver's cuModuleLoadData / cuModuleGetFunction /
cuLaunchKernel through ``cudaGetDriverEntryPoint`` (:mod:`.driver`).  No libcuda binding.
(NVRTC, :mod:`.nvrtc`, compiles CUDA C++ for ``accel.compile``; the backend only loads images.)

A launch is a hot path: its argument cells, their ``void *[]`` and the dim3s come from a
per-thread pool (:func:`_arg_cells`, :class:`_ArgPools`) instead of being made per call.  On
drivers before CUDA 12.3 a module load during a capture is refused before the driver would
refuse it and invalidate the capture; unloads wait for the last capture to end.
"""

from __future__ import annotations

import contextlib
import threading

from ..._errors import AcceleratorError, CaptureError

# Drivers before CUDA 12.3 refuse to load a module while a stream capture is underway (900, the
# capture invalidated); NVIDIA Warp, warp.capture_begin: kernels "can be loaded during graph
# capture on more recent drivers" (CUDA 12.3 or newer).  Unloading is refused by every driver
# (Warp issue 401), so accel unloads only when no capture is underway (accel/sim/cudart/modules.py,
# module_call_in_capture).
_MODULE_LOAD_IN_CAPTURE = 12030

_ARG_CTYPES = {"ptr": "uint64_t *", "u32": "uint32_t *", "i32": "int32_t *", "u64": "uint64_t *",
               "i64": "int64_t *", "f32": "float *", "f64": "double *"}


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


class CudaKernelsMixin:
    """kernel_path, module_*, launch and the user-kernel queries; state lives in
    ``CudaBackend.__init__``."""

    def kernel_path(self) -> dict:
        """How kernels load on this runtime, from its exported symbols (calls nothing):
        {"kernel_path": "library" | "driver" | None, "kernel_path_detail": ...}."""
        from .driver import plan
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
            from .driver import DriverKernels, NoKernelPath, plan
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
