"""The CUDA kernel image containers: a cubin (ELF) and a fatbin.

No dependencies, so both :mod:`accel.kernels` (kernel names of an image it loads) and the CUDA
simulator (:mod:`accel.sim._cuda_images`, which loads them as the driver does) use it.  The
fatbin container (nvcc -fatbin, fatbinary --create) is undocumented; the layout read here is the
one fatbinary 13.0 writes, checked against its output (tests/test_kernel_paths.py): a 16-byte
header (magic 0xBA55ED50, version, header size, size of the entries) and entries of (kind 1 =
PTX / 2 = ELF, header size, payload size, flags, sm) followed by the payload.
"""

from __future__ import annotations

import struct
from typing import List, Tuple

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
_FLAG_COMPRESSED = 0x2000     # fatbinary --compress: the payload is compressed


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


def fatbin_entries(data: bytes) -> List[Tuple[int, int, bytes]]:
    """[(kind, sm, payload)] of a fatbin."""
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
        if flags & _FLAG_COMPRESSED:
            # The real driver inflates these; the compression is not modelled here.
            raise ContainerError("compressed fatbin entries are not read here "
                                 "(build with fatbinary --compress=false)")
        out.append((kind, sm, body))
        pos += ehsize + payload
    return out
