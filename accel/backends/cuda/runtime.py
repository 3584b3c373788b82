"""libcudart itself: opening it, the generated bindings of its major, and return codes turned
into exceptions (a mixin of :class:`accel.backends.cuda.CudaBackend`).

Which file is opened is the choice :mod:`.discovery` makes (:mod:`.libs`); it is opened through
the bindings of its own CUDA major (``accel._ffi.open_cudart``), and :meth:`_bindings` checks that
they are the runtime's (cudaDeviceProp's layout and some symbols differ between majors).  With
``ACCEL_SIM=cuda`` the library comes from ``accel.sim`` instead; everything below the library
calls is the same code.  The runtime is touched only by :meth:`CudaBackend.init` and what follows it.

``_check`` turns a cudaError_t into accel's exception (cudaErrorMemoryAllocation:
OutOfMemoryError, the capture errors: CaptureError, the kernel image errors: KernelImageError)
and clears the thread's last error; ``_check_driver`` does the same for a CUresult of a driver
function reached through cudaGetDriverEntryPoint (:mod:`.driver`, :mod:`.vmm`, :mod:`.kernels`).
``_cast`` reads the cdata kept for every stream and event handle :mod:`.streams` made, so hot calls skip
``ffi.cast``.  Every other mixin calls through these.
"""

from __future__ import annotations

from ..._errors import AcceleratorError, CaptureError, KernelImageError, OutOfMemoryError

# cudaError_t values with a dedicated exception type (driver_types.h).
_ERR_MEMORY_ALLOCATION = 2
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


def _cudart_ffi_for(lib):
    """The ffi of the generated bindings for ``lib``'s runtime major (cudaRuntimeGetVersion
    has one signature in every major and starts nothing, so any bindings can read it)."""
    from ..._ffi import _cudart, cudart_module
    v = _cudart.ffi.new("int *")
    if lib.cudaRuntimeGetVersion(v) != 0:
        return _cudart.ffi
    return cudart_module(v[0] // 1000).ffi


class CudaRuntimeMixin:
    """Opening libcudart, its bindings, ``_check``/``_check_driver`` and handle casts; state lives
    in ``CudaBackend.__init__``."""

    def _open(self, which: str):
        from ..._ffi import open_cudart
        if which == "cudart":
            choice = self.cudart_choice()
            if choice.chosen is None:
                raise OSError(choice.error)
        if self.simulated:
            from ... import sim
            from ..._ffi import _nvml
            if which == "nvml":
                return _nvml.ffi, sim.open_library("nvml"), "accel.sim (nvml)"
            sim.select_runtime(choice.chosen.version)   # "load" the chosen simulated runtime
            lib = sim.open_library("cudart")
            return _cudart_ffi_for(lib), lib, choice.chosen.path
        if which == "nvml":
            from ..._ffi import open_library
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

    def loads(self) -> bool:
        try:
            self._runtime()
            return True
        except AcceleratorError:
            pass
        # A libcudart that loads but that the driver cannot run (or an ACCEL_CUDART_PATH that
        # names none) still makes CUDA the accelerator type, so that the first device use raises
        # libcudart's reason (r82c: Level Zero's loader loaded next, and its "is an Intel GPU
        # driver installed?" was what the user saw)
        choice = self.cudart_choice()
        return choice.explicit or any(c.resolved for c in choice.candidates)

    def _bindings(self):
        """The generated module (accel._ffi.cudart_module) whose ffi the runtime was opened
        with, after checking it is the runtime's major: cudaDeviceProp's layout and some
        symbols (cudaGetDeviceProperties_v2 on 12.x) differ, and a library read through
        another major's declarations answers garbage (an H200 as 1 SM, "integrated")."""
        mod = self._rt_module
        if mod is not None:
            return mod
        from ..._ffi import CUDART_MAJORS, cudart_module
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

    def _check_driver(self, drv, rc: int, call: str) -> None:
        if rc == 0:
            return
        name = drv.error_name(rc)
        # CUresult shares these values with cudaError_t (cuda.h / driver_types.h).
        cls = (OutOfMemoryError if rc == _ERR_MEMORY_ALLOCATION else CaptureError if rc in _CAPTURE_ERRORS
               else KernelImageError if rc in _KERNEL_IMAGE_ERRORS else AcceleratorError)
        raise cls.from_call("libcuda (through cudaGetDriverEntryPoint)", call, rc, name)
