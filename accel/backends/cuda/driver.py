"""Kernels through the CUDA driver API, reached from libcudart as torch reaches it.

Runtimes before 12.8 have no ``cudaLibrary*``; every runtime accel supports
has ``cudaGetDriverEntryPoint`` (12.5+ also ``...ByVersion``), which returns
the driver's own functions.  The pointers are cast to the driver's prototypes
(``PFN_*`` in ``accel/_ffi/_cudadrv.py``, generated from cudaTypedefs.h), so no
libcuda binding is opened.  Errors are CUresult codes, named through the
driver's cuGetErrorName ("cuModuleLoadData failed with
CUDA_ERROR_INVALID_PTX (218)").  The cuMem* virtual memory calls (:mod:`.vmm`)
and the primary-context query (:mod:`.devices`) are resolved the same way, by
:func:`resolve`.
"""

from __future__ import annotations

from typing import Dict, Tuple

#: driver symbol -> PFN type of the ABI accel calls (cudaTypedefs.h).
SYMBOLS: Dict[str, str] = {
    "cuModuleLoadData": "PFN_cuModuleLoadData_v2000",
    "cuModuleUnload": "PFN_cuModuleUnload_v2000",
    "cuModuleGetFunction": "PFN_cuModuleGetFunction_v2000",
    "cuLaunchKernel": "PFN_cuLaunchKernel_v4000",
    "cuGetErrorName": "PFN_cuGetErrorName_v6000",
    # kernel attributes, dynamic shared memory opt-in and occupancy (accel.Kernel)
    "cuFuncGetAttribute": "PFN_cuFuncGetAttribute_v2020",
    "cuFuncSetAttribute": "PFN_cuFuncSetAttribute_v9000",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": "PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050",
}
#: The ABI version asked of cudaGetDriverEntryPointByVersion: these PFN types are the ABIs current
#: in CUDA 12.0, and every runtime accel supports needs a 12.0+ driver anyway.
ABI_VERSION = 12000
_ENTRY_DEFAULT = 0              # cudaEnableDefault (legacy default stream semantics)
_QUERY_NAMES = {1: "cudaDriverEntryPointSymbolNotFound", 2: "cudaDriverEntryPointVersionNotSufficent"}


class NoKernelPath(Exception):
    """The runtime offers no way to load kernels; ``str`` says why."""


def plan(lib) -> Tuple[str, str]:
    """("library" | "driver" | "", why) from the symbols ``lib`` exports, without calling anything.
    (A declared symbol the library lacks raises ffi.error, not AttributeError: has_symbol.)"""
    from ..._ffi import has_symbol
    if all(has_symbol(lib, n) for n in ("cudaLibraryLoadData", "cudaLibraryGetKernel", "cudaLibraryUnload")):
        return "library", "cudaLibraryLoadData/cudaLibraryGetKernel + cudaLaunchKernel (runtime 12.8+)"
    for getter in ("cudaGetDriverEntryPointByVersion", "cudaGetDriverEntryPoint"):
        if has_symbol(lib, getter):
            return "driver", f"driver cuModuleLoadData/cuModuleGetFunction/cuLaunchKernel through {getter}"
    return "", ("no kernel path: this libcudart has neither cudaLibraryLoadData (12.8+) nor "
                "cudaGetDriverEntryPoint")


class NoDriverFunction(Exception):
    """A driver function could not be had from the runtime; ``str`` says which and why."""


def resolve(ffi, lib, symbols: Dict[str, str]):
    """({symbol: function cast to its PFN type}, the getter used) for ``symbols`` (symbol -> PFN
    type of ``accel._ffi._cudadrv``), through cudaGetDriverEntryPointByVersion (12.5+) or
    cudaGetDriverEntryPoint.  Raises :class:`NoDriverFunction` naming the first one missing."""
    from ..._ffi import _cudadrv, has_symbol
    dffi = _cudadrv.ffi
    fns = {}
    by_version = has_symbol(lib, "cudaGetDriverEntryPointByVersion")
    getter = "cudaGetDriverEntryPointByVersion" if by_version else "cudaGetDriverEntryPoint"
    if not by_version and not has_symbol(lib, "cudaGetDriverEntryPoint"):
        raise NoDriverFunction("this libcudart has no cudaGetDriverEntryPoint")
    fp = ffi.new("void **")
    status = ffi.new("enum cudaDriverEntryPointQueryResult *")
    for name, pfn in symbols.items():
        if by_version:
            rc = lib.cudaGetDriverEntryPointByVersion(name.encode(), fp, ABI_VERSION, _ENTRY_DEFAULT, status)
        else:
            rc = lib.cudaGetDriverEntryPoint(name.encode(), fp, _ENTRY_DEFAULT, status)
        if rc != 0:
            lib.cudaGetLastError()
            err = ffi.string(lib.cudaGetErrorName(rc)).decode()
            raise NoDriverFunction(f"{getter}({name!r}) failed with {err} ({rc})")
        if status[0] != 0 or fp[0] == ffi.NULL:
            why = _QUERY_NAMES.get(status[0], f"status {status[0]}")
            raise NoDriverFunction(f"{getter}({name!r}) found no driver function ({why})")
        fns[name] = dffi.cast(pfn, int(ffi.cast("uintptr_t", fp[0])))
    return fns, getter


def error_name(fns, rc: int) -> str:
    """The CUresult name of ``rc`` through the driver's cuGetErrorName (in ``fns``)."""
    from ..._ffi import _cudadrv
    dffi = _cudadrv.ffi
    get = fns.get("cuGetErrorName")
    if get is not None:
        p = dffi.new("const char **")
        if get(rc, p) == 0 and p[0] != dffi.NULL:
            return dffi.string(p[0]).decode()
    return dffi.typeof("CUresult").elements.get(rc, "unrecognized CUresult")


class DriverKernels:
    """The driver functions accel launches kernels with, resolved once per backend."""

    def __init__(self, ffi, lib):
        from ..._ffi import _cudadrv
        self.rffi, self.dffi = ffi, _cudadrv.ffi
        try:
            self.fns, self.getter = resolve(ffi, lib, SYMBOLS)
        except NoDriverFunction as exc:
            raise NoKernelPath(f"no kernel path: {exc}") from None

    def error_name(self, rc: int) -> str:
        return error_name(self.fns, rc)

    def load(self, image) -> Tuple[int, object]:
        """(CUmodule as int, rc) for the image (PTX NUL-terminated, or a fatbin/cubin)."""
        p = self.dffi.new("CUmodule *")
        rc = self.fns["cuModuleLoadData"](p, self.dffi.cast("void *", int(self.rffi.cast("uintptr_t", image))))
        return (int(self.dffi.cast("uintptr_t", p[0])) if rc == 0 else 0), rc

    def unload(self, module: int) -> int:
        return self.fns["cuModuleUnload"](self.dffi.cast("CUmodule", module))

    def function(self, module: int, name: str) -> Tuple[int, int]:
        p = self.dffi.new("CUfunction *")
        rc = self.fns["cuModuleGetFunction"](p, self.dffi.cast("CUmodule", module), name.encode())
        return (int(self.dffi.cast("uintptr_t", p[0])) if rc == 0 else 0), rc

    def launch(self, function: int, grid, block, argv, shared_mem: int, stream: int) -> int:
        d = self.dffi
        return self.fns["cuLaunchKernel"](d.cast("CUfunction", function), grid[0], grid[1], grid[2],
                                          block[0], block[1], block[2], shared_mem, d.cast("CUstream", stream),
                                          d.cast("void **", int(self.rffi.cast("uintptr_t", argv))), d.NULL)

    def func_get_attribute(self, function: int, attrib: int) -> Tuple[int, int]:
        """(value, rc) of CUfunction_attribute ``attrib`` of ``function`` (cuFuncGetAttribute)."""
        p = self.dffi.new("int *")
        rc = self.fns["cuFuncGetAttribute"](p, attrib, self.dffi.cast("CUfunction", function))
        return p[0], rc

    def func_set_attribute(self, function: int, attrib: int, value: int) -> int:
        return self.fns["cuFuncSetAttribute"](self.dffi.cast("CUfunction", function), attrib, value)

    def occupancy(self, function: int, block_size: int, dynamic_smem: int) -> Tuple[int, int]:
        p = self.dffi.new("int *")
        rc = self.fns["cuOccupancyMaxActiveBlocksPerMultiprocessor"](
            p, self.dffi.cast("CUfunction", function), block_size, dynamic_smem)
        return p[0], rc
