"""Kernel parameter lists read from kernel images: PTX ``.entry`` declarations, MSL
``kernel void NAME(`` entries and SPIR-V ``OpEntryPoint`` names.

No dependencies, so both :mod:`accel.kernels` and the simulators (:mod:`accel.sim`) use it.

PTX parameter types map to accel's kernel argument types
(:data:`accel.backends.base.KERNEL_ARG_TYPES`) as follows (PTX ISA, "Kernel Function
Parameters" and "Fundamental Types"):

==========================  =======
PTX                         accel
==========================  =======
``.u32``, ``.b32``          ``u32``
``.s32``                    ``i32``
``.u64``, ``.b64``          ``u64`` (a pointer is a ``.u64`` too: a Buffer passes its address)
``.u64 .ptr ...``           ``ptr``
``.s64``                    ``i64``
``.f32``                    ``f32``
``.f64``                    ``f64``
==========================  =======

Anything else (``.u8``/``.u16``/``.f16`` scalars, ``.b8 name[N]`` structs passed by value)
has no accel type: :func:`ptx_params` names it in the error, and the caller passes an
explicit signature instead.
"""

from __future__ import annotations

import re
import struct
from typing import Dict, List, Optional, Tuple

#: PTX parameter type -> accel argument type.
PTX_TYPES = {"u32": "u32", "b32": "u32", "s32": "i32", "u64": "u64", "b64": "u64", "s64": "i64",
             "f32": "f32", "f64": "f64"}

#: The accel argument types and their size in bytes.
ARG_SIZES = {"ptr": 8, "u32": 4, "i32": 4, "u64": 8, "i64": 8, "f32": 4, "f64": 8}

# PTX ISA, ".entry": ".entry kernel-name ( param-list ) kernel-body" or ".entry kernel-name
# kernel-body" (a kernel with no parameters may have no list at all).
_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$%][\w$%]*)\s*(?:\(([^)]*)\))?", re.S)
_PARAM_RE = re.compile(r"\.param\s+(.*?)\s*(?:,|$)", re.S)
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_MSL_RE = re.compile(r"\bkernel\s+void\s+([A-Za-z_]\w*)\s*\(")


class UnsupportedParam(ValueError):
    """A PTX parameter whose type accel cannot pass (``str`` names it)."""


def _param_type(decl: str, entry: str, i: int) -> str:
    words = decl.split()
    kinds = [w[1:] for w in words if w.startswith(".")]
    if "ptr" in kinds and not any(k in ("u32", "b32", "s32") for k in kinds):
        return "ptr"            # (a .u32 .ptr is a 32-bit address: typed by its .u32 below)
    for k in kinds:
        if k in PTX_TYPES:
            if "[" in decl:     # .b32 name[4]: an array (a struct by value)
                break
            return PTX_TYPES[k]
    raise UnsupportedParam(f"kernel {entry}: parameter {i} is declared '.param {decl}', which accel "
                           f"cannot pass (supported: {', '.join('.' + t for t in PTX_TYPES)} and .u64 "
                           f"pointers); give Module.function(name, signature=...) instead")


def _ptx_text(text) -> str:
    """PTX source (str, or bytes ending at a NUL as a driver reads them) with comments removed
    (PTX ISA, "Comments": they are whitespace)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).split(b"\0", 1)[0].decode("utf-8", "replace")
    return _COMMENT_RE.sub(" ", text)


def ptx_entries(text) -> Dict[str, Optional[Tuple[str, ...]]]:
    """{entry name: parameter types} of every ``.entry`` in PTX ``text`` (str or bytes), in order.
    An entry with a parameter accel cannot pass maps to None (:func:`ptx_params` says why)."""
    text = _ptx_text(text)
    out: Dict[str, Optional[Tuple[str, ...]]] = {}
    for m in _ENTRY_RE.finditer(text):
        try:
            out[m.group(1)] = _params(m.group(1), m.group(2))
        except UnsupportedParam:
            out[m.group(1)] = None
    return out


#: PTX fundamental types by size in bytes (PTX ISA, "Fundamental Types")
_PTX_TYPE_BYTES = {t: n for n, ts in ((1, "b8 u8 s8"), (2, "b16 u16 s16 f16 bf16"), (4, "b32 u32 s32 f32"),
                                      (8, "b64 u64 s64 f64")) for t in ts.split()}
_DIMS_RE = re.compile(r"\[\s*(\d*)\s*\]")


def ptx_param_sizes(text) -> Dict[str, Tuple[Optional[int], ...]]:
    """{entry name: the size in bytes of each parameter, None where PTX does not size it} of
    every ``.entry`` in PTX ``text``: what a signature given for a kernel whose parameters accel
    cannot type (a struct by value, ``.param .align 8 .b8 p[16]``) must still agree with."""
    text = _ptx_text(text)
    out: Dict[str, Tuple[Optional[int], ...]] = {}
    for m in _ENTRY_RE.finditer(text):
        sizes: List[Optional[int]] = []
        for d in (d.strip() for d in (m.group(2) or "").split(",")):
            if not d:
                continue
            kinds = [w[1:] for w in d.split() if w.startswith(".")]
            size = next((_PTX_TYPE_BYTES[k] for k in kinds if k in _PTX_TYPE_BYTES), 8 if "ptr" in kinds else None)
            for n in _DIMS_RE.findall(d):
                size = size * int(n) if size is not None and n else None
            sizes.append(size)
        out[m.group(1)] = tuple(sizes)
    return out


def ptx_params(text, entry: str) -> Tuple[str, ...]:
    """The accel argument types of kernel ``entry`` declared in PTX ``text``.
    KeyError when there is no such entry; :class:`UnsupportedParam` for a type accel cannot pass."""
    text = _ptx_text(text)
    for m in _ENTRY_RE.finditer(text):
        if m.group(1) == entry:
            return _params(entry, m.group(2))
    raise KeyError(entry)


def _params(entry: str, body: Optional[str]) -> Tuple[str, ...]:
    decls = [d.strip() for d in (body or "").split(",") if d.strip()]
    out = []
    for i, d in enumerate(decls):
        if not d.startswith(".param"):
            raise UnsupportedParam(f"kernel {entry}: parameter {i} ({d!r}) is not a .param declaration")
        out.append(_param_type(d[len(".param"):].strip(), entry, i))
    return tuple(out)


# PTX ISA 11.4.3 ".reqntid": "The size of each CTA dimension specified in any invocation of the
# kernel is required to be equal to that specified in this directive.  Specifying a different
# CTA dimension at launch will result in a runtime error or kernel launch failure."  It stands
# between the .entry's parameter list and its body, with one to three extents (the others are 1).
_ENTRY_HEAD_RE = re.compile(r"\.entry\s+([A-Za-z_$%][\w$%]*)\s*(?:\([^)]*\))?([^{]*)\{", re.S)
_REQNTID_RE = re.compile(r"\.reqntid\s+(\d+)\s*(?:,\s*(\d+)\s*)?(?:,\s*(\d+))?")


def ptx_required_blocks(text) -> Dict[str, Tuple[int, int, int]]:
    """{entry name: the block shape its ``.reqntid`` requires} for the entries of PTX ``text``
    that declare one (``__launch_bounds__`` gives ``.maxntid``, a limit the runtime reports;
    ``.reqntid`` is a shape it does not)."""
    out: Dict[str, Tuple[int, int, int]] = {}
    for m in _ENTRY_HEAD_RE.finditer(_ptx_text(text)):
        r = _REQNTID_RE.search(m.group(2))
        if r is not None:
            out[m.group(1)] = tuple(int(d) if d else 1 for d in r.groups())
    return out


def msl_entries(text) -> List[str]:
    """Kernel names of MSL source: ``kernel void NAME(``."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    return _MSL_RE.findall(_COMMENT_RE.sub(" ", text))


SPIRV_MAGIC = 0x07230203
_OP_ENTRY_POINT = 15
_EXECUTION_MODEL_KERNEL = 6


def spirv_entries(data: bytes) -> List[str]:
    """Kernel names of a SPIR-V module: the ``OpEntryPoint Kernel`` instructions (SPIR-V
    specification, 2.3 "Physical Layout" and 3.52.5 OpEntryPoint: word 0 is the word count
    << 16 | opcode, then the execution model, the function id and a NUL-terminated name).
    ValueError when ``data`` is not SPIR-V."""
    return [name for _id, name in _spirv_kernels(_spirv_words(data))]


def _spirv_words(data: bytes) -> Tuple[int, ...]:
    """The 32-bit words of SPIR-V ``data`` in its byte order; ValueError when it is not SPIR-V."""
    data = bytes(data)
    if len(data) < 20 or len(data) % 4:
        raise ValueError(f"not a SPIR-V module: {len(data)} bytes (a module is a header of 5 words "
                         "and whole 32-bit words)")
    for order in "<>":
        if struct.unpack_from(order + "I", data, 0)[0] == SPIRV_MAGIC:
            break
    else:
        raise ValueError(f"not a SPIR-V module: magic {data[:4].hex()} (expected 0x07230203)")
    return struct.unpack(f"{order}{len(data) // 4}I", data)


def _spirv_instructions(words: Tuple[int, ...]):
    """(opcode, operand words) of each instruction after the 5-word header (SPIR-V 2.3: word 0 of
    an instruction is its word count << 16 | opcode); ValueError for a count of 0 or one that
    runs past the module's end."""
    pos = 5
    while pos < len(words):
        count, op = words[pos] >> 16, words[pos] & 0xFFFF
        if count == 0 or pos + count > len(words):
            raise ValueError(f"not a SPIR-V module: the instruction at word {pos} has {count} words, "
                             f"{len(words) - pos} left in the module")
        yield op, words[pos + 1:pos + count]
        pos += count


def _spirv_kernels(words) -> List[Tuple[int, str]]:
    """(function id, name) of each ``OpEntryPoint Kernel`` (3.52.5: the execution model, the
    function id, then a NUL-terminated name)."""
    out = []
    for op, operands in _spirv_instructions(words):
        if op == _OP_ENTRY_POINT and operands and operands[0] == _EXECUTION_MODEL_KERNEL:
            if len(operands) < 3:
                raise ValueError(f"not a SPIR-V module: an OpEntryPoint of {len(operands) + 1} words "
                                 "(at least 4: the execution model, the function and a name)")
            raw = struct.pack(f"<{len(operands) - 2}I", *operands[2:])
            out.append((operands[1], raw.split(b"\0", 1)[0].decode("utf-8", "replace")))
    return out


_OP_EXECUTION_MODE = 16
_EXECUTION_MODE_LOCAL_SIZE = 17


def spirv_required_blocks(data: bytes) -> Dict[str, Tuple[int, int, int]]:
    """{kernel name: the work-group size it requires} for the kernels of SPIR-V ``data`` with an
    ``OpExecutionMode LocalSize x y z`` (OpenCL C's reqd_work_group_size; Level Zero reports it as
    ze_kernel_properties_t.requiredGroupSize, and a launch with another size fails)."""
    words = _spirv_words(data)
    names = dict(_spirv_kernels(words))
    out: Dict[str, Tuple[int, int, int]] = {}
    for op, operands in _spirv_instructions(words):
        if op == _OP_EXECUTION_MODE and len(operands) >= 5 and operands[1] == _EXECUTION_MODE_LOCAL_SIZE:
            name = names.get(operands[0])
            if name is not None:
                out[name] = (operands[2], operands[3], operands[4])
    return out


def parse_signature(signature, what: str = "signature") -> Tuple[str, ...]:
    """A kernel signature as a tuple of accel argument types, from ``"ptr, u64, f32"`` or a
    sequence of those names.  ValueError naming the bad entry."""
    if isinstance(signature, str):
        parts = [p.strip() for p in signature.split(",")]
        if parts == [""]:
            parts = []
    else:
        try:
            parts = list(signature)
        except TypeError:
            raise TypeError(f"{what} must be a string like 'ptr, u64, f32' or a sequence of type "
                            f"names, got {type(signature).__name__}") from None
    for i, p in enumerate(parts):
        if p not in ARG_SIZES:
            raise ValueError(f"{what}: argument {i} has type {p!r}; expected one of "
                             f"{', '.join(ARG_SIZES)} (e.g. 'ptr, u64, f32')")
    return tuple(parts)


def compatible(a: str, b: str) -> bool:
    """True when arguments of types ``a`` and ``b`` have the same size and class (pointer and
    64-bit integers are interchangeable, as are signed and unsigned integers of one size)."""
    if a == b:
        return True
    ints = {"ptr", "u64", "i64"}, {"u32", "i32"}
    return any(a in s and b in s for s in ints)
