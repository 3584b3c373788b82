"""What the simulated CUDA driver does with a module image: PTX text, a cubin, or a fatbin.

:func:`load` reads an image the way cuModuleLoadData / cudaLibraryLoadData do
and answers which kernels it defines and whether loading it needed the PTX
JIT, or the vendor error code the real driver returns.  The fatbin container
(nvcc -fatbin, fatbinary --create) is undocumented; the layout read here is
the one fatbinary 13.0 writes, checked against its output
(tests/test_kernel_paths.py): a 16-byte header (magic 0xBA55ED50, version,
header size, size of the entries) and entries of (kind 1 = PTX / 2 = ELF,
header size, payload size, flags, sm) followed by the payload.
"""

from __future__ import annotations

import re
import struct
from typing import List, Optional, Tuple

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
_FLAG_COMPRESSED = 0x2000     # fatbinary --compress: the payload is compressed

# Codes shared by cudaError_t and CUresult (driver_types.h / cuda.h give them the same values).
INVALID_KERNEL_IMAGE = 200    # cudaErrorInvalidKernelImage / CUDA_ERROR_INVALID_IMAGE
NO_KERNEL_IMAGE = 209         # cudaErrorNoKernelImageForDevice / CUDA_ERROR_NO_BINARY_FOR_GPU
INVALID_PTX = 218             # cudaErrorInvalidPtx / CUDA_ERROR_INVALID_PTX
UNSUPPORTED_PTX_VERSION = 222  # cudaErrorUnsupportedPtxVersion / CUDA_ERROR_UNSUPPORTED_PTX_VERSION

# The newest PTX ISA each CUDA release's JIT compiles (PTX ISA manual, "Release Notes": PTX 6.3 came
# with CUDA 10.0, 7.0 with 11.0, 8.0 with 12.0, ..., 8.5 with 12.5 (and 12.6), 8.7 with 12.8,
# 8.8 with 12.9, 9.0 with 13.0).  A driver JITs PTX up to the ISA of the CUDA version it supports.
_PTX_ISA = [
    (10000, (6, 3)), (10010, (6, 4)), (10020, (6, 5)),
    (11000, (7, 0)), (11010, (7, 1)), (11020, (7, 2)), (11030, (7, 3)), (11040, (7, 4)),
    (11050, (7, 5)), (11060, (7, 6)), (11070, (7, 7)), (11080, (7, 8)),
    (12000, (8, 0)), (12010, (8, 1)), (12020, (8, 2)), (12030, (8, 3)), (12040, (8, 4)),
    (12050, (8, 5)), (12060, (8, 5)), (12080, (8, 7)), (12090, (8, 8)), (13000, (9, 0)),
]

_VERSION_RE = re.compile(rb"^\s*\.version\s+(\d+)\.(\d+)", re.M)
_TARGET_RE = re.compile(rb"^\s*\.target\s+sm_(\d+)", re.M)


class ImageError(Exception):
    """The driver refuses the image: ``code`` is the vendor error, ``str`` says why."""

    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


def max_ptx_isa(driver_version: int) -> Optional[Tuple[int, int]]:
    """The newest PTX ISA a driver supporting CUDA ``driver_version`` can JIT (None: unknown)."""
    best = None
    for version, isa in _PTX_ISA:
        if version <= driver_version:
            best = isa
    return best


def ptx_entries(text: bytes) -> List[str]:
    """Kernel names declared in PTX text (``.entry NAME`` / ``.visible .entry NAME(``), read
    with comments removed (PTX ISA, "Comments": they are whitespace) by the parser accel uses."""
    from accel import _ptx
    return list(_ptx.ptx_entries(text))


def _jit(ptx: bytes, cc: Tuple[int, int], driver_version: int, lazy: bool = False) -> List[str]:
    m = _VERSION_RE.search(ptx)
    names = ptx_entries(ptx)
    if lazy:
        # Measured on an H100 (driver 580.159.04, libcudart 13.0; tests/conformance/
        # cuda_h100_2026-12-05.json, scenario library_bad_images), cudaLibraryGetKernel of a library
        # loaded lazily: text without a .version directive is no image at all, 200 (as bytes that
        # are no image); PTX with .version but no .entry loads, without kernels (a lookup is 500).
        if m is None:
            raise ImageError(INVALID_KERNEL_IMAGE, "neither a fatbin, a cubin nor PTX (no .version directive)")
    elif m is None or not names:
        raise ImageError(INVALID_PTX, "PTX without a .version directive or any .entry")
    isa = (int(m.group(1)), int(m.group(2)))
    limit = max_ptx_isa(driver_version)
    # CUDA Programming Guide, "Just-in-Time Compilation" / REFERENCE.md "Runtime vs driver
    # versions": the driver JITs only PTX whose ISA version it knows.
    if limit is None or isa > limit:
        raise ImageError(UNSUPPORTED_PTX_VERSION,
                         f"PTX ISA {isa[0]}.{isa[1]} is newer than this driver (CUDA "
                         f"{driver_version // 1000}.{driver_version % 1000 // 10}) can JIT")
    t = _TARGET_RE.search(ptx)
    if t is not None and int(t.group(1)) > cc[0] * 10 + cc[1]:
        raise ImageError(INVALID_PTX, f"PTX .target sm_{t.group(1).decode()} is above the device's "
                                      f"compute capability {cc[0]}.{cc[1]}")
    return names


def elf_entries(elf: bytes) -> List[str]:
    """Kernel names in a cubin: global FUNC symbols marked STO_CUDA_ENTRY (st_other 0x10)."""
    if elf[:4] != b"\x7fELF" or len(elf) < 64:
        raise ImageError(INVALID_KERNEL_IMAGE, "not an ELF image")
    e_shoff, = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", elf, 0x3A)
    try:
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, e_shoff + i * e_shentsize) for i in range(e_shnum)]
        names = []
        for sec in sections:
            if sec[1] != 2:          # SHT_SYMTAB
                continue
            off, size, link, entsize = sec[4], sec[5], sec[6], sec[9]
            stroff = sections[link][4]
            for i in range(size // entsize):
                st_name, st_info, st_other, _shndx, _value, _size = struct.unpack_from("<IBBHQQ", elf, off + i * entsize)
                if st_info & 0xF == 2 and st_info >> 4 == 1 and st_other & 0x10:
                    names.append(elf[stroff + st_name:elf.index(b"\0", stroff + st_name)].decode())
        return names
    except (struct.error, ValueError, IndexError):
        raise ImageError(INVALID_KERNEL_IMAGE, "truncated ELF image") from None


def fatbin_entries(data: bytes) -> List[Tuple[int, int, bytes]]:
    """[(kind, sm, payload)] of a fatbin."""
    magic, _version, hsize, fat_size = struct.unpack_from("<IHHQ", data, 0)
    if magic != FATBIN_MAGIC:
        raise ImageError(INVALID_KERNEL_IMAGE, "not a fatbin")
    out, pos, end = [], hsize, hsize + fat_size
    if end > len(data):
        raise ImageError(INVALID_KERNEL_IMAGE, "truncated fatbin")
    while pos < end:
        kind, _v, ehsize, payload = struct.unpack_from("<HHIQ", data, pos)
        sm, = struct.unpack_from("<I", data, pos + 28)
        flags, = struct.unpack_from("<Q", data, pos + 40)
        body = data[pos + ehsize:pos + ehsize + payload]
        if len(body) != payload or ehsize < 48:
            raise ImageError(INVALID_KERNEL_IMAGE, "truncated fatbin entry")
        if flags & _FLAG_COMPRESSED:
            # The real driver inflates these; the simulator does not model the compression.
            raise ImageError(INVALID_KERNEL_IMAGE, "accel.sim does not read compressed fatbin entries "
                                                   "(build with fatbinary --compress=false)")
        out.append((kind, sm, body))
        pos += ehsize + payload
    return out


def load(data: bytes, cc: Tuple[int, int], driver_version: int, lazy: bool = False) -> Tuple[List[str], bool]:
    """(kernel names, JIT used) for image ``data`` on a device of compute capability ``cc``.

    ``lazy``: the checks a lazily loaded cudaLibrary_t meets at its first cudaLibraryGetKernel,
    with the codes measured there (PTX without .version or .entry is read as _jit says); the
    other checks and codes are the same at load and at the lookup."""
    if data[:4] == struct.pack("<I", FATBIN_MAGIC):
        entries = fatbin_entries(data)
        # CUDA Programming Guide, "Binary Compatibility": a cubin for sm_XY runs on devices of
        # compute capability X.Z with Z >= Y; otherwise "PTX code ... can always be compiled to
        # binary code of greater or equal compute capability" by the driver's JIT.
        sass = [(sm, body) for kind, sm, body in entries
                if kind == KIND_ELF and sm // 10 == cc[0] and sm % 10 <= cc[1]]
        if sass:
            return elf_entries(max(sass)[1]), False
        ptx = [(sm, body) for kind, sm, body in entries if kind == KIND_PTX and sm <= cc[0] * 10 + cc[1]]
        if ptx:
            return _jit(max(ptx)[1].split(b"\0", 1)[0], cc, driver_version, lazy), True
        have = ", ".join(f"{'sm' if k == KIND_ELF else 'compute'}_{sm}" for k, sm, _ in entries) or "nothing"
        raise ImageError(NO_KERNEL_IMAGE, f"the fatbin holds {have}: no SASS for sm_{cc[0]}{cc[1]} "
                                          "and no PTX it can JIT")
    if data[:4] == b"\x7fELF":
        e_flags, = struct.unpack_from("<I", data, 0x30)
        # EI_ABIVERSION 8 (CUDA 12.8+ toolkits) keeps the sm in bits 8-15 of e_flags, older in 0-7.
        sm = (e_flags >> 8) & 0xFF if data[8] >= 8 else e_flags & 0xFF
        if sm // 10 != cc[0] or sm % 10 > cc[1]:
            raise ImageError(NO_KERNEL_IMAGE, f"cubin for sm_{sm} does not run on compute capability "
                                              f"{cc[0]}.{cc[1]}")
        return elf_entries(data), False
    return _jit(data.split(b"\0", 1)[0], cc, driver_version, lazy), True


def image_bytes(ffi, code, charp) -> bytes:
    """The bytes of the image at ``code`` (a cdata pointer or bytes): a fatbin or cubin is
    sized by its header, PTX text ends at its NUL (cuModuleLoadData takes no length)."""
    if isinstance(code, (bytes, bytearray, memoryview)):
        return bytes(code)
    p = ffi.cast(charp, code)
    head = ffi.buffer(p, 4)[:]
    if head == struct.pack("<I", FATBIN_MAGIC):
        _m, _v, hsize, fat_size = struct.unpack("<IHHQ", ffi.buffer(p, 16)[:])
        return ffi.buffer(p, hsize + fat_size)[:]
    if head == b"\x7fELF":
        hdr = ffi.buffer(p, 64)[:]
        e_shoff, = struct.unpack_from("<Q", hdr, 0x28)
        e_shentsize, e_shnum = struct.unpack_from("<HH", hdr, 0x3A)
        return ffi.buffer(p, e_shoff + e_shentsize * e_shnum)[:]
    return ffi.string(p)


def declared_params(data: bytes) -> dict:
    """{entry: accel argument types or None} from the PTX of image ``data`` (PTX text, or the PTX
    entries of a fatbin); {} for a cubin, whose parameter lists accel does not read."""
    from accel import _ptx
    if data[:4] == struct.pack("<I", FATBIN_MAGIC):
        out: dict = {}
        try:
            for kind, _sm, body in fatbin_entries(data):
                if kind == KIND_PTX:
                    out.update(_ptx.ptx_entries(body))
        except ImageError:
            return {}
        return out
    if data[:4] == b"\x7fELF":
        return {}
    return _ptx.ptx_entries(data)
