"""The CUDA kernel image containers: a cubin (ELF) and a fatbin.

No dependencies, so both :mod:`accel.kernels` (kernel names of an image it loads) and the CUDA
simulator (:mod:`accel.sim._cuda_images`, which loads them as the driver does) use it.  The
fatbin container (nvcc -fatbin, fatbinary --create) is undocumented; the layout read here is the
one fatbinary 13.0 writes, checked against its output (tests/test_kernel_paths.py): a 16-byte
header (magic 0xBA55ED50, version, header size, size of the entries) and entries of (kind 1 =
PTX / 2 = ELF, header size, payload size, flags, sm) followed by the payload.

Compressed entries: nvcc 13's ``-fatbin`` compresses the PTX by default (``-Xfatbin -compress-all``
the SASS too): entry flag 0x8000, the payload a zstd frame, its inflated size at byte 56 of the
entry header (read from fatbinary 13.0's output, tests/test_user_kernels_r83c.py); older
fatbinary ``--compress`` set 0x2000 with another format.  Python 3.11 has no zstd in its
standard library: a zstd payload is inflated only where a ``compression.zstd`` (Python 3.14) or
``zstandard`` module happens to be importable (accel depends on neither); otherwise the entry is
left out of :func:`fatbin_entries` (the driver still reads it) and reported in ``skipped``.
"""

from __future__ import annotations

import struct
from typing import Dict, List, Optional, Tuple

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
_FLAG_COMPRESSED = 0x2000     # older fatbinary --compress: a compressed payload (not zstd)
_FLAG_ZSTD = 0x8000           # fatbinary 13 (nvcc -fatbin's default for PTX): a zstd frame


class ContainerError(ValueError):
    """The bytes are not a well-formed container of that kind (the message says what is wrong)."""


def elf_entries(elf: bytes) -> List[str]:
    """Kernel names in a cubin: global FUNC symbols marked STO_CUDA_ENTRY (st_other 0x10)."""
    if elf[:4] != b"\x7fELF" or len(elf) < 64:
        raise ContainerError("not an ELF image")
    e_shoff, = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", elf, 0x3A)
    if e_shnum and e_shentsize != 64:
        # (r71b: any size was taken; 0 read the first header e_shnum times)
        raise ContainerError(f"ELF section headers of {e_shentsize} bytes (an Elf64_Shdr is 64)")
    try:
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, e_shoff + i * e_shentsize) for i in range(e_shnum)]
        names = []
        for sec in sections:
            if sec[1] != 2:          # SHT_SYMTAB
                continue
            off, size, link, entsize = sec[4], sec[5], sec[6], sec[9]
            if entsize < 24:        # (Elf64_Sym is 24 bytes; 0 divided below, r70g)
                raise ContainerError(f"ELF symbol table with entries of {entsize} bytes")
            stroff = sections[link][4]
            for i in range(size // entsize):
                st_name, st_info, st_other, _shndx, _value, _size = struct.unpack_from("<IBBHQQ", elf, off + i * entsize)
                if st_info & 0xF == 2 and st_info >> 4 == 1 and st_other & 0x10:
                    names.append(elf[stroff + st_name:elf.index(b"\0", stroff + st_name)].decode())
        return names
    except (struct.error, ValueError, IndexError):
        raise ContainerError("truncated ELF image") from None


def elf_sections(elf: bytes) -> Dict[str, Tuple[int, int, int]]:
    """{section name: (sh_type, offset, size)} of an ELF image."""
    if elf[:4] != b"\x7fELF" or len(elf) < 64:
        raise ContainerError("not an ELF image")
    e_shoff, = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    if e_shnum and e_shentsize != 64:
        raise ContainerError(f"ELF section headers of {e_shentsize} bytes (an Elf64_Shdr is 64)")
    try:
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, e_shoff + i * 64) for i in range(e_shnum)]
        names = sections[e_shstrndx][4] if sections else 0
        out = {}
        for sec in sections:
            name = elf[names + sec[0]:elf.index(b"\0", names + sec[0])].decode()
            out[name] = (sec[1], sec[4], sec[5])
        return out
    except (struct.error, ValueError, IndexError):
        raise ContainerError("truncated ELF image") from None


def fatbin_entries(data: bytes, skipped: Optional[list] = None) -> List[Tuple[int, int, bytes]]:
    """[(kind, sm, payload)] of a fatbin's entries accel can read.  A compressed entry is inflated
    where a zstd module is importable, else left out (never returned compressed): ``skipped``,
    when a list, receives its (kind, sm)."""
    try:
        magic, _version, hsize, fat_size = struct.unpack_from("<IHHQ", data, 0)
    except struct.error:
        raise ContainerError("truncated fatbin header") from None
    if magic != FATBIN_MAGIC:
        raise ContainerError("not a fatbin")
    out, pos, end = [], hsize, hsize + fat_size
    if end > len(data):
        raise ContainerError("truncated fatbin")
    while pos < end:
        try:
            kind, _v, ehsize, payload = struct.unpack_from("<HHIQ", data, pos)
            sm, = struct.unpack_from("<I", data, pos + 28)
            flags, = struct.unpack_from("<Q", data, pos + 40)
        except struct.error:
            raise ContainerError("truncated fatbin entry") from None
        if ehsize < 48:
            raise ContainerError(f"truncated fatbin entry at offset {pos}: a header of {ehsize} bytes (at least 48)")
        if pos + ehsize + payload > end:
            # (r71b: it was read from the bytes after the container)
            raise ContainerError(f"truncated fatbin entry at offset {pos}: it ends at byte {pos + ehsize + payload}, "
                                 f"past the container's end at byte {end}")
        body = data[pos + ehsize:pos + ehsize + payload]
        if flags & (_FLAG_COMPRESSED | _FLAG_ZSTD):
            # (r83c: a 0x8000 entry's zstd frame was returned as the PTX text)
            body = _inflate(body, data, pos, ehsize) if flags & _FLAG_ZSTD and not flags & _FLAG_COMPRESSED else None
            if body is None:
                if skipped is not None:
                    skipped.append((kind, sm))
                pos += ehsize + payload
                continue
        out.append((kind, sm, body))
        pos += ehsize + payload
    return out


def _inflate(body: bytes, data: bytes, pos: int, ehsize: int) -> Optional[bytes]:
    """The inflated payload of a zstd entry, or None where no zstd module is importable."""
    try:
        from compression import zstd    # Python 3.14+
        unpack = zstd.ZstdDecompressor()
        error: type = zstd.ZstdError
    except ImportError:
        try:
            import zstandard
        except ImportError:
            return None
        unpack, error = zstandard.ZstdDecompressor().decompressobj(), zstandard.ZstdError
    try:
        out = unpack.decompress(body)     # one frame; the payload's padding after it is left
    except error as exc:
        raise ContainerError(f"fatbin entry at offset {pos}: its zstd payload does not inflate ({exc})") from None
    size, = struct.unpack_from("<Q", data, pos + 56) if ehsize >= 64 else (len(out),)
    if len(out) != size:
        raise ContainerError(f"fatbin entry at offset {pos}: its zstd payload inflates to {len(out)} bytes, "
                             f"not the {size} its header gives")
    return out
