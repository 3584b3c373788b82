"""Addresses of host Python buffers, for copies the runtime performs.

Uses a bare ``_cffi_backend.FFI`` (no declarations, no parser): only the
built-in C types are needed to take a buffer's address and move bytes.
"""

from __future__ import annotations

_ffi = None


def _get_ffi():
    global _ffi
    if _ffi is None:
        import _cffi_backend
        _ffi = _cffi_backend.FFI()
    return _ffi


def address_of(view) -> int:
    """Address of the first byte of a contiguous buffer (kept alive by the caller)."""
    ffi = _get_ffi()
    return int(ffi.cast("uintptr_t", ffi.from_buffer(view)))


def copy_into(address: int, view) -> None:
    """Copy the bytes of ``view`` to host memory at ``address``."""
    ffi = _get_ffi()
    ffi.memmove(ffi.cast("void *", address), view, view.nbytes)
