"""Capture error modes and what a capture_begin refuses before anything is begun.

The modes are CUDA's and torch's (``default`` is ``global``).  A capture needs a backend with
stream capture, a stream other than the legacy default stream, and a device on which no other
accel capture is underway (the device's default generator follows one capture at a time).  A
capture that ended but whose bookkeeping a KeyboardInterrupt cut short (``Graph._finish_end``)
is in ``_unfinished`` and is finished before the device is checked.
"""

from __future__ import annotations

from .. import _lazy
from ..streams import Stream

#: Graphs whose ended capture still owes bookkeeping (Graph._finish_end), bounded by them (a
#: dict: adding is a plain store, with no signal check, beside the others that end a capture).
_unfinished: dict = {}

_MODES = ("default", "global", "thread_local", "relaxed")


class _UnknownCaptureMode(ValueError, RuntimeError):
    """A capture_error_mode that is none of _MODES.  torch raises it from a TORCH_CHECK in
    capture_begin (RuntimeError); accel raised ValueError: this class is both."""


def _check_mode(mode: str) -> str:
    if mode not in _MODES:
        raise _UnknownCaptureMode("Unknown capture error mode. Expected `default`, `global`, `thread_local`, "
                                  f"or `relaxed`, got {mode}")
    return mode


def _graph_backend():
    """The initialized backend; NotImplementedError saying why where it has no stream capture."""
    backend = _lazy.lazy_init()
    if not backend.supports_graphs:
        raise NotImplementedError(backend.no_capture_reason)
    return backend


def _refuse_default_stream(backend, stream: Stream) -> None:
    if stream._handle == backend.default_stream(stream.device_index):
        raise RuntimeError(
            f"{backend.name.upper()} graphs must be captured on a non-default stream. (However, after "
            "capture, it's ok to replay them on the default stream.) Use `with accel.Stream(), graph:` "
            "or `with accel.graph(graph):`.")


def _finish_owed_ends(index: int) -> None:
    """Finish the bookkeeping of the ended captures of device ``index`` that a KeyboardInterrupt
    cut short (Graph._finish_end: takes the allocator's lock, so never under the capture gate)."""
    for g in [g for g in _unfinished if g._index == index]:
        g._finish_end()


def _check_device_free(index: int, why: str = "", finish: bool = True) -> None:
    """RuntimeError when an accel capture is underway on device ``index`` (one that ended but
    whose bookkeeping a KeyboardInterrupt cut short is finished here first, unless ``finish`` is
    False: the caller holds the capture gate and finished them before taking it)."""
    from .. import random
    if finish:
        _finish_owed_ends(index)
    if random._device_capturing(index):
        raise RuntimeError(f"another graph is being captured on device {index}{why}: accel captures "
                           f"one graph per device at a time (the device's default generator follows one "
                           f"capture); end that capture first, or capture on another device")
