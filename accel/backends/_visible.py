"""``CUDA_VISIBLE_DEVICES`` parsing, exactly as the CUDA runtime reads it.

Ported from ``torch/cuda/__init__.py`` (``_parse_visible_devices``,
``_transform_uuid_to_ordinals``, ``_device_count_nvml``) so the count obtained
from NVML, without initializing the runtime, equals what the runtime would
report after ``cuInit``.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

ALL = object()  # variable unset: every device is visible


def _strtoul(text: str) -> int:
    """C ``strtoul`` on a leading run of digits: "1gpu2" reads 1; nothing or a sign only → -1.
    Only the ASCII digits are digits to C ("1²" reads 1; str.isdigit took "²" and "١")."""
    end = 0
    for i, ch in enumerate(text):
        if ch in "0123456789" or (i == 0 and ch in "+-"):
            end = i + 1
        else:
            break
    try:
        return int(text[:end]) if end else -1
    except ValueError:  # a lone "+" or "-"
        return -1


def parse(value: Optional[str]) -> Union[object, List[int], List[str]]:
    """The visible-device list: ALL, a list of ordinals, or a list of GPU-/MIG- UUID prefixes.

    Ordinals stop at the first negative or unparsable entry; UUID lists stop at
    the first entry without the prefix; any duplicate makes the list empty.
    """
    if value is None:
        return ALL
    for prefix in ("GPU-", "MIG-"):
        if value.startswith(prefix):
            uuids: List[str] = []
            for elem in value.split(","):
                if elem in uuids:
                    return []
                if not elem.startswith(prefix):
                    break
                uuids.append(elem)
            return uuids
    ordinals: List[int] = []
    for elem in value.split(","):
        x = _strtoul(elem.strip())
        if x in ordinals:
            return []
        if x < 0:
            break
        ordinals.append(x)
    return ordinals


def uuids_to_ordinals(candidates: Sequence[str], uuids: Sequence[str]) -> List[int]:
    """Match UUID prefixes against the devices' UUIDs; an ambiguous or unknown
    prefix ends the list, a device named twice empties it."""
    result: List[int] = []
    for candidate in candidates:
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(candidate)]
        if len(matches) != 1:
            break
        if matches[0] in result:
            return []
        result.append(matches[0])
    return result


def visible_ordinals(value: Optional[str], raw_count: int,
                     uuids: Callable[[], Sequence[str]]) -> Optional[List[int]]:
    """Physical ordinals the runtime would expose, in order; None when only the
    runtime itself can tell (MIG UUIDs)."""
    parsed = parse(value)
    if parsed is ALL:
        return list(range(raw_count))
    if not parsed:
        return []
    if isinstance(parsed[0], str):
        if parsed[0].startswith("MIG-"):
            return None
        return uuids_to_ordinals(parsed, uuids())
    result: List[int] = []
    for ordinal in parsed:
        if ordinal >= raw_count:
            break
        result.append(ordinal)
    return result
