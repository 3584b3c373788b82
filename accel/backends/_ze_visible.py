"""Which Level Zero devices a process sees: ``ZE_FLAT_DEVICE_HIERARCHY`` and ``ZE_AFFINITY_MASK``.

Sysman (``zesDeviceGet``) always lists whole cards ("root devices") and
ignores both variables, while the core API (``zeDeviceGet``) applies them.
To count without initializing the core runtime, the XPU backend takes the
cards and their tile counts from Sysman and applies the variables here the
way Intel's driver does (compute-runtime ``ExecutionEnvironment::
parseAffinityMask`` and ``setDeviceHierarchyMode``):

* Hierarchy: ``COMPOSITE`` exposes cards (tiles are sub-devices); ``FLAT`` and
  ``COMBINED`` expose every tile as a device (a single-tile card is one
  device).  Any other value, or none, means the driver default, ``FLAT``.
  The value is compared exactly (upper case), as the driver does.
* Mask: a comma list.  In FLAT/COMBINED mode each entry ``N`` names the N-th
  flattened device; ``X.Y`` entries are ignored.  In COMPOSITE mode ``X``
  selects card X with all its tiles and ``X.Y`` tile Y of card X.  Entries out
  of range or not a number are ignored; duplicates count once; the devices
  keep their physical order, not the order of the mask.  An empty mask or
  ``default`` selects everything.
* Numbers: the driver reads each mask index with ``std::stoul(s, nullptr, 0)``
  (:func:`strtoul`) and ``ZES_ENABLE_SYSMAN`` with ``atoll`` (:func:`sysman_env_on`);
  the simulator (``accel.sim.ze``) reads them with the same two functions.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

FLAT, COMPOSITE, COMBINED = "FLAT", "COMPOSITE", "COMBINED"

#: One visible device: (card index, tile index or None for the whole card).
Visible = Tuple[int, Optional[int]]


def hierarchy(value: Optional[str]) -> str:
    """The effective device hierarchy mode for a ``ZE_FLAT_DEVICE_HIERARCHY`` value."""
    if value in (COMPOSITE, COMBINED, FLAT):
        return value
    return FLAT


_SPACE = " \t\n\v\f\r"     # C isspace()
_DIGITS = {8: "01234567", 10: "0123456789", 16: "0123456789abcdefABCDEF"}


def _digits(text: str, base: int) -> str:
    """The longest prefix of ``text`` made of ``base``'s digits."""
    n = 0
    while n < len(text) and text[n] in _DIGITS[base]:
        n += 1
    return text[:n]


def strtoul(text: str) -> Optional[int]:
    """A ZE_AFFINITY_MASK index as Intel's driver reads it: compute-runtime's
    ``StringHelpers::toUint32t`` is ``static_cast<uint32_t>(std::stoul(s, nullptr, 0))``
    (shared/source/helpers/string_helpers.h), i.e. C ``strtoul(s, NULL, 0)``: leading white space
    and a sign, then ``0x`` hexadecimal, ``0`` octal or decimal, up to the first character that is
    no digit ("1abc" is 1); "-n" wraps modulo 2**64; the result is cut to 32 bits.  None where
    stoul throws (no digit: invalid_argument; past 64 bits: out_of_range): accel and its simulator
    ignore the entry (neither the spec nor the driver's docs say what happens then)."""
    s = text.lstrip(_SPACE)
    negative = s[:1] == "-"
    if s[:1] in ("+", "-"):
        s = s[1:]
    if s[:2] in ("0x", "0X") and _digits(s[2:3], 16):
        base, s = 16, s[2:]
    else:
        base = 8 if s[:1] == "0" else 10     # ("0x" with no hex digit after it is 0)
    digits = _digits(s, base)
    if not digits:
        return None
    value = int(digits, base)
    if value >> 64:
        return None
    if negative:
        value = -value % (1 << 64)
    return value & 0xFFFFFFFF


def split(text: str, delimiter: str) -> List[str]:
    """``text`` split as compute-runtime's ``StringHelpers::split`` does (string_helpers.h): a
    part is added only while the position is inside the string, so a trailing delimiter adds no
    empty part ("1." is ["1"], "" is []), unlike ``str.split`` (r84a)."""
    parts, pos = [], 0
    while pos < len(text):
        end = text.find(delimiter, pos)
        if end < 0:
            end = len(text)
        parts.append(text[pos:end])
        pos = end + 1
    return parts


def sysman_env_on(value: Optional[str]) -> bool:
    """Whether a ``ZES_ENABLE_SYSMAN`` value turns legacy Sysman on: compute-runtime reads it with
    ``EnvironmentVariableReader::getSetting(name, false)``, ``atoll(value) != 0``
    (shared/source/os_interface/debug_env_reader.cpp), so "2", " 1" and "01" are on as "1" is,
    and "0", "" and "true" are off."""
    if value is None:
        return False
    s = value.lstrip(_SPACE)
    if s[:1] in ("+", "-"):
        s = s[1:]
    return _digits(s, 10).strip("0") != ""


def visible_devices(tiles: Sequence[int], mask: Optional[str] = None,
                    mode: Optional[str] = None) -> List[Visible]:
    """The devices ``zeDeviceGet`` would return, as (card, tile) pairs in order.

    ``tiles[i]`` is card i's number of sub-devices as Sysman reports it
    (``zes_device_properties_t.numSubdevices``; 0 or 1 means one tile).
    ``mask`` and ``mode`` are the raw environment values.  The tile is None
    when the device is a whole card.
    """
    mode = hierarchy(mode)
    flat: List[Visible] = []
    for card, n in enumerate(tiles):
        if mode != COMPOSITE and n > 1:
            flat.extend((card, t) for t in range(n))
        else:
            flat.append((card, None))
    # parseAffinityMask returns early on exactly "default" or "" (no trimming: " " selects nothing)
    if mask is None or mask in ("", "default"):
        return flat
    # (an empty entry has no parts: the driver reads subEntries[0] of an empty vector; ignored here)
    entries = [parts for parts in (split(e, ".") for e in split(mask, ",")) if parts]
    if mode != COMPOSITE:
        chosen = set()
        for parts in entries:
            if len(parts) != 1:
                continue  # X.Y has no meaning when tiles are devices
            i = strtoul(parts[0])
            if i is not None and i < len(flat):
                chosen.add(i)
        return [flat[i] for i in sorted(chosen)]
    selected = {}  # card -> set of selected tiles (None: all)
    for parts in entries:
        card = strtoul(parts[0])
        if card is None or card >= len(tiles):
            continue
        if len(parts) == 1:
            selected[card] = None
        elif len(parts) == 2:
            tile = strtoul(parts[1])
            count = max(tiles[card], 1)
            if tile is None or tile >= count:
                continue
            if card not in selected:
                selected[card] = set()
            if selected[card] is not None:
                selected[card].add(tile)
    out: List[Visible] = []
    for card in sorted(selected):
        chosen_tiles = selected[card]
        # A card reduced to one of several tiles behaves as that tile.
        if chosen_tiles is not None and len(chosen_tiles) == 1 and tiles[card] > 1:
            out.append((card, next(iter(chosen_tiles))))
        else:
            out.append((card, None))
    return out
