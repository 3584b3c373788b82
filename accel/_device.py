"""The ``accel.device`` value and device-argument parsing shared by the public API.

Parsing follows ``torch/accelerator/_utils.py::_get_device_index``: an int is
an index, a string or :class:`device` must name the current accelerator, and a
device without an index means the current device only where that is allowed.
On top of torch, wrong types raise ``TypeError`` and indices are checked
against the device count with a message naming the valid range.  A string or
index that names no device raises :class:`accel.InvalidDeviceError`, which is a
``RuntimeError`` (as torch's) and a ``ValueError`` (as accel's before).
"""

from __future__ import annotations

import builtins
import operator
from typing import Optional, Union

from . import _lazy, backends
from ._errors import InvalidDeviceError

_KNOWN_TYPES = ("cuda", "xpu", "mps", "cpu")
# c10::DeviceType numbers (c10/core/DeviceType.h): torch.device's hash uses them
_TORCH_TYPE_NUMBERS = {"cpu": 0, "cuda": 1, "xpu": 12, "mps": 13}


class device:
    """An accelerator device: a type (``"cuda"``, ``"xpu"``, ``"mps"``) and an optional index.

    ``device("cuda:1")``, ``device("cuda", 1)`` and ``device("cuda")`` as torch.device; as
    torch 2.13's, ``device(1)`` is the current accelerator's device 1.
    Immutable and hashable; compares equal to another device with the same type and index.
    """

    __slots__ = ("_type", "_index")

    def __init__(self, type: Union[str, "device", int], index: Optional[int] = None):
        if not isinstance(type, (str, bool, device)) and hasattr(builtins.type(type), "__index__"):
            # torch.device(1): the current accelerator's device 1
            if index is not None:
                raise TypeError(f"device({type!r}, index={index!r}): an int is the index already")
            index = operator.index(type)
            if index < 0:
                raise InvalidDeviceError(f"Device index must not be negative, got {index}")
            type = accelerator_type()
            if type is None:
                raise RuntimeError(_lazy._NO_DEVICE)
        if isinstance(type, device) or is_torch_device(type):
            if index is not None:
                raise TypeError("device(device, index): give the index in the string or the device, not both")
            type, index = type.type, type.index
        if not isinstance(type, str):
            raise TypeError(f"device type must be a str such as 'cuda' or 'cuda:0', got {type!r}")
        text = type        # as torch.device: no spaces around, no leading zero ("cuda:01")
        kind, sep, rest = text.partition(":")
        if sep:
            if index is not None:
                raise InvalidDeviceError(f"device string {text!r} already has an index; do not also pass index={index}")
            if not (rest.isascii() and rest.isdigit()) or (rest[0] == "0" and rest != "0"):   # isdigit takes "²"
                raise InvalidDeviceError(f"Invalid device string: {text!r}; expected 'type' or 'type:index' "
                                 f"with a non-negative integer index, e.g. 'cuda:0'")
            index = int(rest)
        if kind not in _KNOWN_TYPES:
            raise InvalidDeviceError(f"Invalid device string: {text!r}; expected a device type in "
                             f"{', '.join(_KNOWN_TYPES)}, optionally followed by ':index'")
        if index is not None:
            index = _as_index(index, "device index")
            if index < 0:
                raise InvalidDeviceError(f"Device index must not be negative, got {index}")
        object.__setattr__(self, "_type", kind)
        object.__setattr__(self, "_index", index)

    def __setattr__(self, name, value):
        raise AttributeError("accel.device is immutable")

    @property
    def type(self) -> str:
        """The device type: ``"cuda"``, ``"xpu"`` or ``"mps"``."""
        return self._type

    @property
    def index(self) -> Optional[int]:
        """The device index, or None for a device string without one (``"cuda"``)."""
        return self._index

    def __eq__(self, other):
        if isinstance(other, device):
            return self._type == other._type and self._index == other._index
        if is_torch_device(other):
            # (r70f) equal to the torch.device it names, as accel takes one wherever it takes a device
            return self._type == other.type and self._index == other.index
        return NotImplemented

    def __hash__(self):
        # torch.device's hash (c10::Device: the DeviceType number << 16 | the index as a uint8,
        # None as -1), so that an accel.device finds a torch.device's dict entry and back
        number = _TORCH_TYPE_NUMBERS.get(self._type)
        if number is None:
            return hash((self._type, self._index))
        return (number << 16) | ((-1 if self._index is None else self._index) & 0xFF)

    def __str__(self):
        return self._type if self._index is None else f"{self._type}:{self._index}"

    def __repr__(self):
        if self._index is None:
            return f"device(type={self._type!r})"
        return f"device(type={self._type!r}, index={self._index})"

    def __reduce__(self):
        return (device, (self._type, self._index))


DeviceLike = Union[int, str, device, None]     # a torch.device is taken as the accel.device it names


def _as_index(value, what: str) -> int:
    """An ``__index__`` integer (int, numpy integer) as an int; TypeError for bool and the rest."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")


def accelerator_type() -> Optional[str]:
    """Name of the accelerator type (as current_accelerator()), or None; never initializes a runtime."""
    chosen = backends.fallback()
    return chosen.name if chosen is not None else None


def parse_index(dev: DeviceLike) -> Optional[int]:
    """The index ``dev`` names, or None for None and an index-less device, with torch's type
    checks (a device of another type: ValueError; a bad string: InvalidDeviceError).  Never
    initializes the runtime."""
    if isinstance(dev, bool):
        raise TypeError(f"device must be an int, a string such as 'cuda:0', or accel.device; got {dev!r}")
    if isinstance(dev, int):
        return dev
    if hasattr(type(dev), "__index__") and not isinstance(dev, (str, device)):
        return operator.index(dev)          # numpy integers
    if isinstance(dev, str) or is_torch_device(dev):
        dev = device(dev)
    if isinstance(dev, device):
        acc = accelerator_type()
        if acc is None:
            raise RuntimeError(_lazy._NO_DEVICE)
        if acc != dev.type:
            raise ValueError(f"{dev.type} doesn't match the current accelerator {acc}.")
        return dev.index
    if dev is not None:
        raise TypeError(f"device must be an int, a string such as 'cuda:0', or accel.device; "
                        f"got {type(dev).__name__} {dev!r}")
    return None


def is_torch_device(dev) -> bool:
    """Whether ``dev`` is a torch.device, which accel takes as the accel.device of the same type
    and index (torch.accelerator takes it everywhere; recognised by its class, without importing
    torch)."""
    kind = type(dev)
    return kind.__name__ == "device" and kind.__module__ == "torch"


def device_index(dev: DeviceLike, optional: bool = False) -> int:
    """Turn a device argument into an index, with torch's rules and wording.

    ``optional=True`` lets None or an index-less device mean the current
    device (which initializes the runtime, as torch does).
    """
    index = parse_index(dev)
    if index is None:
        if not optional:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{dev}")
        return _lazy.lazy_init().get_device()
    return index


def checked_index(dev: DeviceLike, optional: bool = True) -> int:
    """Like :func:`device_index`, and the index must name an existing device."""
    index = device_index(dev, optional)
    check_range(index)
    return index


def check_range(index: int, backend=None, what: str = "") -> None:
    """:class:`InvalidDeviceError` (a ValueError and, as torch's, a RuntimeError) naming the
    valid range when ``index`` is not a visible device of ``backend`` (default: the chosen
    one); ``what`` prefixes the message (the call that refused it)."""
    chosen = backend if backend is not None else _lazy.backend()
    count = chosen.count()
    if not 0 <= index < count:
        if count == 0:
            raise InvalidDeviceError(f"{what}device index {index} is invalid: no {chosen.name} device is "
                                     f"available{_why_none(chosen)}")
        raise InvalidDeviceError(f"{what}device index {index} is out of range: {count} {chosen.name} "
                                 f"device{'s' if count != 1 else ''} visible (valid indices 0..{count - 1})")


def _why_none(backend) -> str:
    """Why ``backend`` counts no device (the vendor error and its fix, when counting failed), as
    ": <reason>", or ""."""
    reason = getattr(backend, "_count_reason", "")
    return f": {reason}" if reason else ""


def check_stream_range(index: int) -> None:
    """:func:`check_range` for the device of a stream lookup or creation, in torch's words
    (c10/cuda/CUDAStream.cpp check_gpu: "Device index value N is out of index range [0, count)"),
    which code written for ``torch.accelerator.current_stream`` matches."""
    chosen = _lazy.backend()
    count = chosen.count()
    if not 0 <= index < count:
        valid = f"valid indices 0..{count - 1}" if count else f"no {chosen.name} device is available{_why_none(chosen)}"
        raise InvalidDeviceError(f"Device index value {index} is out of index range [0, {count}): {count} "
                                 f"{chosen.name} device{'s' if count != 1 else ''} visible ({valid})")
