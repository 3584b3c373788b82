"""What the simulated CUDA driver does with a module image: PTX text, a cubin, or a fatbin.

:func:`load` reads an image the way cuModuleLoadData / cudaLibraryLoadData do
and answers which kernels it defines and whether loading it needed the PTX
JIT, or the vendor error code the real driver returns.  The containers' layouts
(cubin, fatbin) are read by :mod:`accel._cuda_containers`.
"""

from __future__ import annotations

import functools
import re
import struct
from typing import List, Optional, Tuple

from accel import _cuda_containers as _containers
from accel._cuda_containers import FATBIN_MAGIC, KIND_ELF, KIND_PTX

# Codes shared by cudaError_t and CUresult (driver_types.h / cuda.h give them the same values).
INVALID_KERNEL_IMAGE = 200    # cudaErrorInvalidKernelImage / CUDA_ERROR_INVALID_IMAGE
NO_KERNEL_IMAGE = 209         # cudaErrorNoKernelImageForDevice / CUDA_ERROR_NO_BINARY_FOR_GPU
INVALID_PTX = 218             # cudaErrorInvalidPtx / CUDA_ERROR_INVALID_PTX
UNSUPPORTED_PTX_VERSION = 222  # cudaErrorUnsupportedPtxVersion / CUDA_ERROR_UNSUPPORTED_PTX_VERSION
NOT_SUPPORTED = 801           # cudaErrorNotSupported / CUDA_ERROR_NOT_SUPPORTED

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
_TARGET_RE = re.compile(rb"^\s*\.target\s+sm_(\d+)([af]?)\b", re.M)


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
    if t is not None:
        why = _target_refusal(int(t.group(1)), t.group(2).decode(), cc)
        if why:
            raise ImageError(INVALID_PTX, why)
    ptx_bounds(ptx)     # ptxas refuses .maxntid with .reqntid, and too much static shared memory
    return names


def _target_refusal(sm: int, suffix: str, cc: Tuple[int, int]) -> str:
    """Why PTX of ``.target sm_<sm><suffix>`` does not JIT for compute capability ``cc`` ("": it does).

    CUDA Programming Guide, "PTX Compatibility": PTX "can always be compiled to binary code of
    greater or equal compute capability".  PTX ISA, "Target ISA notes" (.target): "Target
    architectures with suffix 'a', such as sm_90a, include architecture-accelerated features that
    are supported on the specified architecture only, hence such targets do not follow the onion
    layer model.  Therefore, PTX code generated for such targets cannot be run on later generation
    devices" (quoted from the PTX manual in LLVM review D155851).  NVIDIA technical blog "NVIDIA
    Blackwell and NVIDIA CUDA 12.9 Introduce Family-Specific Architecture Features": an 'f' target
    runs on the later devices of its family only (sm_100f: compute capability 10.0 and 10.3, not
    12.x).  ptxas 13.0 refuses the same: "Program with .target 'sm_90a' cannot be compiled to
    future architecture", "... 'sm_100f' cannot be compiled to different SM-family architecture"."""
    target, have = f"sm_{sm}{suffix}", f"compute capability {cc[0]}.{cc[1]}"
    if suffix == "a" and (sm // 10, sm % 10) != cc:
        return (f"PTX .target {target} is architecture-specific: it runs on compute capability "
                f"{sm // 10}.{sm % 10} only, not {have}")
    if suffix == "f" and (sm // 10 != cc[0] or sm % 10 > cc[1]):
        return (f"PTX .target {target} is family-specific: it runs on compute capability {sm // 10}.x "
                f"from {sm // 10}.{sm % 10} only, not {have}")
    if sm > cc[0] * 10 + cc[1]:
        return f"PTX .target {target} is above the device's {have}"
    return ""


# -- per-entry launch bounds and static shared memory (PTX ISA, "Performance-Tuning Directives") --
#
# PTX ISA 11.4.2 ".maxntid": "The maximum number of threads in the thread block, computed as the
# product of the maximum extent specified for each dimension, is guaranteed not to be exceeded in
# any invocation of the kernel in which this directive appears.  Exceeding the maximum number of
# threads results in a runtime error or kernel launch failure" (only the total is bounded, not
# each dimension).  11.4.3 ".reqntid": "The size of each CTA dimension specified in any invocation
# of the kernel is required to be equal to that specified in this directive.  Specifying a
# different CTA dimension at launch will result in a runtime error or kernel launch failure";
# "The .reqntid directive cannot be used in conjunction with the .maxntid directive".  Both "may
# be applied per-entry and must appear between an .entry directive and its body" (11.4), with one
# to three extents (".maxntid nx, ny, nz").  A kernel's static shared memory is its .shared
# variables (PTX ISA, "State Spaces": .shared; `.extern .shared` arrays of no size are the dynamic
# shared memory sized at launch, not counted).  The CUDA Runtime API reports both per function:
# cudaFuncAttributes::maxThreadsPerBlock "The maximum number of threads per block, beyond which a
# launch of the function would fail" and ::sharedSizeBytes "The size in bytes of statically-
# allocated shared memory per block required by this function".

#: Static shared memory one block may declare: CUDA Programming Guide, "Shared Memory" for compute
#: capability 7.x, 8.x and 9.0: "Kernels relying on shared memory allocations over 48 KB per block
#: are architecture-specific, as such they must use dynamic shared memory (rather than statically
#: sized arrays)"; ptxas refuses a kernel that declares more ("uses too much shared data").
MAX_STATIC_SHARED = 48 * 1024


class EntryBounds:
    """What the PTX of one ``.entry`` says about its launches: ``maxntid`` / ``reqntid`` (3-tuples
    of extents, or None) and ``shared`` (bytes of static shared memory per block)."""
    __slots__ = ("maxntid", "reqntid", "shared")

    def __init__(self, maxntid=None, reqntid=None, shared=0):
        self.maxntid, self.reqntid, self.shared = maxntid, reqntid, shared

    def max_threads(self, device_limit: int = 1024) -> int:
        """cudaFuncAttributes::maxThreadsPerBlock: the device's limit, lowered by the directive."""
        dims = self.reqntid or self.maxntid
        return device_limit if dims is None else min(device_limit, dims[0] * dims[1] * dims[2])

    def __repr__(self):
        return f"EntryBounds(maxntid={self.maxntid}, reqntid={self.reqntid}, shared={self.shared})"


_COMMENTS = re.compile(rb"//[^\n]*|/\*.*?\*/", re.S)
_ENTRY_HEAD = re.compile(rb"\.entry\s+([A-Za-z_$%][\w$%]*)\s*(\([^)]*\))?")
_NTID = re.compile(rb"\.(maxntid|reqntid)\s+([0-9][^.{]*)")
# a declaration starts a statement: `.shared .align 4 .b8 name[64];` (not `ld.shared.u32`)
_SHARED_DECL = re.compile(rb"(?:^|(?<=[;{}]))[ \t\r\n]*(\.extern\s+)?\.shared\s+([^;{}]*);", re.M)
_TYPE_SIZES = {b"b8": 1, b"u8": 1, b"s8": 1, b"b16": 2, b"u16": 2, b"s16": 2, b"f16": 2, b"bf16": 2,
               b"f16x2": 4, b"b32": 4, b"u32": 4, b"s32": 4, b"f32": 4, b"b64": 8, b"u64": 8, b"s64": 8,
               b"f64": 8, b"b128": 16}
_VAR = re.compile(rb"([A-Za-z_$%][\w$%]*)\s*((?:\[\s*\d*\s*\])*)\s*(?:=.*)?$", re.S)


_BRACES = re.compile(rb"[{}]")


def _blocks(text: bytes) -> List[Tuple[int, int]]:
    """(start, end) of every top-level { ... } block of ``text`` (comments removed)."""
    out, depth, start = [], 0, 0
    for m in _BRACES.finditer(text):
        i = m.start()
        if m.group() == b"{":
            if depth == 0:
                start = i
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                out.append((start, i + 1))
    return out


def _shared_vars(text: bytes, where: str) -> List[Tuple[bytes, int, int]]:
    """[(name, size, alignment)] of the non-extern .shared declarations in ``text``."""
    out = []
    for m in _SHARED_DECL.finditer(text):
        if m.group(1):
            continue            # .extern .shared: dynamic shared memory, sized at launch
        first, *more = m.group(2).split(b",")
        tokens = first.split()
        align, vec, size, names, i = 0, 1, None, [], 0
        while i < len(tokens):
            t = tokens[i]
            if t == b".align" and i + 1 < len(tokens) and tokens[i + 1].isdigit():
                align, i = int(tokens[i + 1]), i + 2
                continue
            if t[:1] == b"." and t[1:] in (b"v2", b"v4", b"v8"):
                vec = int(t[2:])
            elif t[:1] == b"." and t[1:] in _TYPE_SIZES:
                size = _TYPE_SIZES[t[1:]]
            elif t[:1] != b".":
                names.append(t)
            i += 1
        if size is None:
            raise ImageError(INVALID_PTX, f"{where}: .shared declaration {m.group(2).decode(errors='replace')!r} "
                                          "has no type accel.sim can size")
        for part in [b" ".join(names)] + more:
            v = _VAR.match(part.strip())
            if v is None:
                continue
            count = 1
            for d in re.findall(rb"\[\s*(\d*)\s*\]", v.group(2)):
                count *= int(d) if d else 0
            out.append((v.group(1), size * vec * count, max(align, size * vec)))
    return out


def _layout(variables) -> int:
    """Bytes of shared memory the variables take laid out in order, each at its alignment."""
    offset = 0
    for _name, size, align in variables:
        offset = -(-offset // align) * align + size
    return offset


def _extents(entry: str, kind: bytes, spec: bytes) -> Tuple[int, int, int]:
    parts = [p.strip() for p in spec.split(b",")]
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ImageError(INVALID_PTX, f"kernel {entry}: .{kind.decode()} {spec.decode(errors='replace').strip()!r} "
                                      "is not 1 to 3 positive extents")
    dims = [int(p) for p in parts] + [1, 1]
    return dims[0], dims[1], dims[2]


def ptx_bounds(ptx) -> dict:
    """{entry: :class:`EntryBounds`} of PTX text ``ptx`` (str or bytes).  ImageError (218, as the
    JIT's ptxas refuses them) for an entry with both .maxntid and .reqntid, extents that are not
    1 to 3 positive integers, or more than 48 KiB of static shared memory."""
    if isinstance(ptx, str):
        ptx = ptx.encode()
    return dict(_ptx_bounds(bytes(ptx)))


# The same image is loaded again by nearly every test (the Philox kernels, on each device of each
# fresh runtime), and parsing its PTX dominated a load: the result is a function of the bytes.
@functools.lru_cache(maxsize=16)
def _ptx_bounds(ptx: bytes) -> dict:
    text = _COMMENTS.sub(b" ", ptx.split(b"\0", 1)[0])
    blocks = _blocks(text)
    # module-scope .shared variables (outside every body): an entry uses one its body, or any
    # .func body (which an entry may call), names
    outside, pos = [], 0
    for a, b in blocks:
        outside.append(text[pos:a])
        pos = b
    outside.append(text[pos:])
    module_vars = _shared_vars(b" ".join(outside), "module scope")
    entries, funcs, prev = [], [], 0
    for a, b in blocks:
        m = None
        for m in _ENTRY_HEAD.finditer(text, prev, a):
            pass                # the last .entry header before this body (if any) owns it
        if m is not None and b".func" not in text[m.end():a]:
            entries.append((m, (a, b)))
        else:
            funcs.append(text[a:b])
        prev = b
    funcs = b" ".join(funcs)
    out = {}
    for m, body in entries:
        name = m.group(1).decode()
        head = text[m.end():body[0]]
        found = {}
        for d in _NTID.finditer(head):
            found[d.group(1)] = _extents(name, d.group(1), d.group(2))
        if len(found) == 2:
            raise ImageError(INVALID_PTX, f"kernel {name}: .reqntid cannot be used in conjunction with .maxntid "
                                          "(PTX ISA, .reqntid)")
        own = text[body[0]:body[1]]
        used = [v for v in module_vars if re.search(rb"(?<![\w$%])" + re.escape(v[0]) + rb"(?![\w$%])", own + funcs)]
        shared = _layout(used + _shared_vars(own, f"kernel {name}"))
        if shared > MAX_STATIC_SHARED:
            raise ImageError(INVALID_PTX, f"kernel {name} declares {shared} bytes of static shared memory, above "
                                          f"the {MAX_STATIC_SHARED} a block may declare statically (use dynamic "
                                          "shared memory and cudaFuncAttributeMaxDynamicSharedMemorySize)")
        out[name] = EntryBounds(found.get(b"maxntid"), found.get(b"reqntid"), shared)
    return out


# -- a cubin's launch bounds and static shared memory ---------------------------------------------
#
# NVIDIA does not document a cubin's per-kernel attributes; they are read as ptxas 13.0 writes them
# (cubins of /usr/local/cuda/bin/nvcc, tests/test_user_kernels_r83c.py) and as Hayes et al., "Decoding
# CUDA Binary" (CGO 2019; github.com/decodecudabinary/Decoding-CUDA-Binary, tools/src/elfmanip.hpp) read
# them.  Section .nv.info.<kernel> is a list of records: format (u8; 1 NVAL, 2 BVAL, 3 HVAL: the value is
# the u16 that follows the attribute; 4 SVAL: that u16 is the size of the payload after it), attribute
# (u8), u16.  EIATTR_MAX_THREADS (0x05) is __launch_bounds__ / .maxntid and EIATTR_REQNTID (0x10)
# .reqntid, each three u32 extents.  The kernel's static shared memory is the size of its NOBITS section
# .nv.shared.<kernel>; for sm_90 and later ptxas starts that section with the 1 KiB the device reserves
# per block (the cubin then has a .nv.shared.reserved.N section): a kernel declaring 16 KiB has a
# section of 17408 bytes, and `ptxas -v` reports "16384 bytes smem", the number given here as the
# function's sharedSizeBytes (not yet checked against a GPU's cudaFuncGetAttributes).
_EIATTR_MAX_THREADS, _EIATTR_REQNTID = 0x05, 0x10
_EIFMT_SVAL = 4
_RESERVED_SMEM = 1024


@functools.lru_cache(maxsize=16)
def cubin_bounds(elf: bytes) -> dict:
    """{kernel: :class:`EntryBounds`} of a cubin's kernels, or ImageError (200) for an .nv.info
    section it cannot read."""
    try:
        sections = _containers.elf_sections(elf)
    except _containers.ContainerError as e:
        raise ImageError(INVALID_KERNEL_IMAGE, str(e)) from None
    reserved = _RESERVED_SMEM if any(n.startswith(".nv.shared.reserved.") for n in sections) else 0
    out = {}
    for name in elf_entries(elf):
        found = {}
        info = sections.get(f".nv.info.{name}")
        if info is not None:
            body, pos = elf[info[1]:info[1] + info[2]], 0
            while pos + 4 <= len(body):
                fmt, attr, value = struct.unpack_from("<BBH", body, pos)
                if fmt not in (1, 2, 3, 4) or (fmt == _EIFMT_SVAL and pos + 4 + value > len(body)):
                    raise ImageError(INVALID_KERNEL_IMAGE, f"kernel {name}: .nv.info record {fmt}/{attr:#x} at "
                                                           f"byte {pos} is not one the simulator can read")
                if fmt == _EIFMT_SVAL and attr in (_EIATTR_MAX_THREADS, _EIATTR_REQNTID) and value == 12:
                    found[attr] = struct.unpack_from("<III", body, pos + 4)
                pos += 4 + (value if fmt == _EIFMT_SVAL else 0)
        shared = sections.get(f".nv.shared.{name}")
        out[name] = EntryBounds(found.get(_EIATTR_MAX_THREADS), found.get(_EIATTR_REQNTID),
                                max(0, shared[2] - reserved) if shared else 0)
    return out


def elf_entries(elf: bytes) -> List[str]:
    """Kernel names in a cubin (:func:`accel._cuda_containers.elf_entries`), or the driver's refusal."""
    try:
        return _containers.elf_entries(elf)
    except _containers.ContainerError as e:
        raise ImageError(INVALID_KERNEL_IMAGE, str(e)) from None


def fatbin_entries(data: bytes, skipped: Optional[list] = None) -> List[Tuple[int, int, bytes]]:
    """[(kind, sm, payload)] of a fatbin (:func:`accel._cuda_containers.fatbin_entries`: the
    compressed entries it cannot inflate go to ``skipped``), or the driver's refusal."""
    try:
        return _containers.fatbin_entries(data, skipped)
    except _containers.ContainerError as e:
        raise ImageError(INVALID_KERNEL_IMAGE, str(e)) from None


def _compressed_refusal(kind: int, sm: int) -> ImageError:
    """The simulator's refusal of a fatbin whose entry for the device is compressed and cannot be
    read here (:mod:`accel._cuda_containers`).  A real driver inflates it; the simulator, which
    must read the PTX to JIT it (or the cubin's kernels), cannot: cudaErrorNotSupported, the code
    it gives for what it does not simulate."""
    what = f"SASS sm_{sm}" if kind == KIND_ELF else f"compute_{sm} PTX"
    return ImageError(NOT_SUPPORTED, (
        f"the fatbin's {what}, which this device would run, is compressed and the simulator cannot "
        f"inflate it (nvcc 13 compresses a fatbin's PTX by default: zstd, fatbin entry flag 0x8000, which "
        f"it reads only where a compression.zstd or zstandard module is importable); a real driver reads "
        f"it.  Build the fatbin with -Xfatbin -compress-mode=none, or load the PTX (nvcc -ptx) or a cubin "
        f"for this device instead"))


def load(data: bytes, cc: Tuple[int, int], driver_version: int, lazy: bool = False) -> Tuple[List[str], bool]:
    """(kernel names, JIT used) for image ``data`` on a device of compute capability ``cc``.

    ``lazy``: the checks a lazily loaded cudaLibrary_t meets at its first cudaLibraryGetKernel,
    with the codes measured there (PTX without .version or .entry is read as _jit says); the
    other checks and codes are the same at load and at the lookup."""
    if data[:4] == struct.pack("<I", FATBIN_MAGIC):
        skipped: list = []
        entries = fatbin_entries(data, skipped)
        # CUDA Programming Guide, "Binary Compatibility": a cubin for sm_XY runs on devices of
        # compute capability X.Z with Z >= Y; otherwise "PTX code ... can always be compiled to
        # binary code of greater or equal compute capability" by the driver's JIT.  An entry of
        # those the driver would take that is compressed and unreadable here: refused.
        def runs(kind, sm):
            if kind == KIND_ELF:
                return sm // 10 == cc[0] and sm % 10 <= cc[1]
            return kind == KIND_PTX and sm <= cc[0] * 10 + cc[1]
        for kind in (KIND_ELF, KIND_PTX):
            found = [(sm, body) for k, sm, body in entries if k == kind and runs(k, sm)]
            if found and kind == KIND_ELF:
                cubin_bounds(max(found)[1])
                return elf_entries(max(found)[1]), False
            if found:
                return _jit(max(found)[1].split(b"\0", 1)[0], cc, driver_version, lazy), True
            hidden = [sm for k, sm in skipped if k == kind and runs(k, sm)]
            if hidden:
                raise _compressed_refusal(kind, max(hidden))
        listed = [(k, sm) for k, sm, _ in entries] + skipped
        have = ", ".join(f"{'sm' if k == KIND_ELF else 'compute'}_{sm}" for k, sm in listed) or "nothing"
        raise ImageError(NO_KERNEL_IMAGE, f"the fatbin holds {have}: no SASS for sm_{cc[0]}{cc[1]} "
                                          "and no PTX it can JIT")
    if data[:4] == b"\x7fELF":
        e_flags, = struct.unpack_from("<I", data, 0x30)
        # EI_ABIVERSION 8 (CUDA 12.8+ toolkits) keeps the sm in bits 8-15 of e_flags, older in 0-7.
        sm = (e_flags >> 8) & 0xFF if data[8] >= 8 else e_flags & 0xFF
        if sm // 10 != cc[0] or sm % 10 > cc[1]:
            raise ImageError(NO_KERNEL_IMAGE, f"cubin for sm_{sm} does not run on compute capability "
                                              f"{cc[0]}.{cc[1]}")
        cubin_bounds(data)      # an .nv.info the simulator cannot read: 200
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
    entries of a fatbin that are readable here); {} for a cubin, whose parameter lists accel does
    not read."""
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


def declared_bounds(data: bytes) -> dict:
    """{entry: :class:`EntryBounds`} of image ``data``: from its PTX (.maxntid, .reqntid, .shared),
    a cubin's .nv.info and .nv.shared sections (:func:`cubin_bounds`), or a fatbin's readable
    entries of both (the PTX's taken where both give a kernel)."""
    try:
        if data[:4] == struct.pack("<I", FATBIN_MAGIC):
            out: dict = {}
            entries = fatbin_entries(data)
            for kind, _sm, body in entries:
                if kind == KIND_ELF:
                    out.update(cubin_bounds(body))
            for kind, _sm, body in entries:
                if kind == KIND_PTX:
                    out.update(ptx_bounds(body))
            return out
        if data[:4] == b"\x7fELF":
            return cubin_bounds(data)
        return ptx_bounds(data)
    except ImageError:
        return {}       # not loadable: load() said why
