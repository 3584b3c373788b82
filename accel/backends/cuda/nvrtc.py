"""libnvrtc, the CUDA runtime compiler: CUDA C++ source to PTX (and a cubin for a real
architecture), for :func:`accel.compile`.

NVRTC needs no driver and no GPU.  The library is found by accel's loader
(``accel._ffi.open_nvrtc``: ``ACCEL_NVRTC_PATH``, the nvidia-cuda-nvrtc wheels, the
toolkit, the system), preferring the CUDA major of the libcudart the CUDA backend has
loaded when it is initialized: PTX carries a PTX ISA version (``.version 9.0`` from NVRTC
13.0, higher from later releases), and a driver JIT-compiles only the ISA versions of its
own CUDA release and older (REFERENCE.md "Runtime vs driver versions": PTX newer than the
driver cannot JIT; the load then fails with cudaErrorUnsupportedPtxVersion, which accel
raises as ``KernelImageError``).  So use an NVRTC no newer than the driver's CUDA version.

Every ``nvrtcProgram`` is destroyed on every path (try/finally).  The calls run with the
GIL released (cffi), so threads compile in parallel; NVRTC's API is thread-safe for
distinct programs.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..._errors import AcceleratorError, CompileError

#: What to install when no libnvrtc loads.
INSTALL_WHEEL = ("pip install 'accel[nvrtc]' (the nvidia-cuda-nvrtc wheel, CUDA 13; nvidia-cuda-nvrtc-cu12 "
                 "for CUDA 12)")
INSTALL_HINT = INSTALL_WHEEL + ", or set ACCEL_NVRTC_PATH to a libnvrtc.so"


def _runtime_major() -> Optional[int]:
    """The CUDA major of the libcudart the CUDA backend loaded or, before initialization, would
    load (its choice starts nothing), else None.  r70l: before initialization no major was
    preferred, so a compile first cached NVRTC 13 for the process, whose PTX a CUDA 12 driver
    running the chosen 12.4 runtime cannot JIT.  Left: in a process that selected no backend
    yet and names none, a compile before any device call still prefers no major."""
    from ... import _lazy
    backend = _lazy.ready
    if backend is None:
        # the CUDA backend already selected, or the one ACCEL_BACKEND/ACCEL_SIM asks for; not a
        # selection made here (it would count every runtime's devices and fix the choice early)
        from ... import backends
        try:
            if backends._selected_done:
                backend = backends._selected
            elif backends._requested() == "cuda":
                backend = backends.get("cuda")
            if backend is None or getattr(backend, "name", None) != "cuda":
                return None
            choice = backend.cudart_choice()
        except Exception:       # (no runtime at all: the compile says so itself)
            return None
    elif getattr(backend, "name", None) != "cuda":
        return None
    else:
        choice = getattr(backend, "_choice", None)
    chosen = getattr(choice, "chosen", None)
    version = getattr(chosen, "version", None)
    return version // 1000 if version else None


def open_lib():
    """``(ffi, lib, path)`` of libnvrtc; AcceleratorError (a RuntimeError) naming the wheel to
    install and every path tried when none loads."""
    from ..._ffi import LibraryNotFound, open_nvrtc
    try:
        return open_nvrtc(_runtime_major())
    except LibraryNotFound as exc:
        if exc.override:        # (r69g: installed, but the variable names a file that is not it)
            raise AcceleratorError(f"accel.compile needs NVRTC (libnvrtc): {exc} (to install it: {INSTALL_WHEEL})",
                                   library="nvrtc") from None
        raise AcceleratorError(f"accel.compile needs NVRTC (libnvrtc), which is not installed: {INSTALL_HINT}.\n"
                               f"{exc}", library="nvrtc") from None


def _error_name(ffi, lib, rc: int) -> str:
    return ffi.string(lib.nvrtcGetErrorString(rc)).decode("ascii", "replace")


def _check(ffi, lib, rc: int, call: str) -> None:
    if rc != 0:
        name = _error_name(ffi, lib, rc)
        raise AcceleratorError.from_call("nvrtc", call, rc, name)


def version() -> Tuple[int, int]:
    """NVRTC's (major, minor) version, e.g. (13, 0)."""
    ffi, lib, _path = open_lib()
    major, minor = ffi.new("int *"), ffi.new("int *")
    _check(ffi, lib, lib.nvrtcVersion(major, minor), "nvrtcVersion")
    return major[0], minor[0]


def missing() -> str:
    """Why NVRTC cannot be used here (the loader's first line, which names the wheel), or ''."""
    try:
        version()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return ""


def supported_archs() -> Tuple[int, ...]:
    """The architectures NVRTC can target, as ``10 * major + minor`` (75, 80, ..., 120)."""
    ffi, lib, _path = open_lib()
    n = ffi.new("int *")
    _check(ffi, lib, lib.nvrtcGetNumSupportedArchs(n), "nvrtcGetNumSupportedArchs")
    archs = ffi.new("int[]", max(n[0], 1))
    _check(ffi, lib, lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return tuple(sorted(archs[i] for i in range(n[0])))


def _output(ffi, lib, prog, size_fn, get_fn, what: str) -> bytes:
    size = ffi.new("size_t *")
    _check(ffi, lib, size_fn(prog, size), what + "Size")
    buf = ffi.new("char[]", max(size[0], 1))
    _check(ffi, lib, get_fn(prog, buf), what)
    return ffi.buffer(buf, size[0])[:]


def _log(ffi, lib, prog) -> str:
    data = _output(ffi, lib, prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog, "nvrtcGetProgramLog")
    return data.rstrip(b"\0").decode("utf-8", "replace")


def compile_program(source: bytes, name: Optional[bytes], options: List[bytes],
                    want_cubin: bool) -> Tuple[bytes, Optional[bytes], str]:
    """Compile ``source``; return ``(ptx, cubin or None, log)``.  ``ptx`` is the PTX text
    without NVRTC's terminating NUL.  Raises :class:`CompileError` with NVRTC's log when
    the compile fails (a syntax error, an option NVRTC rejects)."""
    ffi, lib, _path = open_lib()
    prog = ffi.new("nvrtcProgram *")
    _check(ffi, lib, lib.nvrtcCreateProgram(prog, source, name if name else ffi.NULL, 0, ffi.NULL, ffi.NULL),
           "nvrtcCreateProgram")
    try:
        keep = [ffi.new("char[]", o) for o in options]   # alive until the call returns
        rc = lib.nvrtcCompileProgram(prog[0], len(keep), ffi.new("char *[]", keep) if keep else ffi.NULL)
        log = _log(ffi, lib, prog[0])
        if rc != 0:
            code_name = _error_name(ffi, lib, rc)
            label = (name or b"default_program").decode("utf-8", "replace")
            opts = " ".join(o.decode("utf-8", "replace") for o in options)
            raise CompileError(f"NVRTC could not compile {label!r} ({code_name}, {rc}; options: {opts or 'none'})"
                               f":\n{log.strip() or '(NVRTC wrote no log)'}",
                               log=log, library="nvrtc", call="nvrtcCompileProgram", code=rc, code_name=code_name)
        ptx = _output(ffi, lib, prog[0], lib.nvrtcGetPTXSize, lib.nvrtcGetPTX, "nvrtcGetPTX")
        if ptx.endswith(b"\0"):
            ptx = ptx[:-1]
        cubin = None
        if want_cubin:
            cubin = _output(ffi, lib, prog[0], lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN, "nvrtcGetCUBIN")
        return ptx, cubin, log
    finally:
        lib.nvrtcDestroyProgram(prog)
