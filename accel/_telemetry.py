"""torch.cuda's management-library queries, for every backend that has such a library.

``utilization``, ``memory_usage``, ``temperature``, ``power_draw``, ``clock_rate``,
``device_memory_used`` and ``list_gpu_processes`` have torch 2.13's names, units and output
(``torch/cuda/__init__.py``, ``torch/cuda/memory.py``).  torch reads them with pynvml; accel
asks the backend's management library (CUDA: NVML, Level Zero: Sysman) through the Backend
``smi_*`` capability.  Like torch they never start the runtime: with an explicit device, and,
before the runtime is initialized, with ``device=None`` too (the current device is then device
0).  A backend without a management library (Metal) raises :class:`accel.AcceleratorError`
saying so; ``list_gpu_processes`` returns that sentence instead, as torch returns "pynvml module
not found, ..." without pynvml.

``can_device_access_peer`` is the runtime's ``cudaDeviceCanAccessPeer`` (Level Zero:
``zeDeviceCanAccessPeer``; Metal has one device, which is no peer of itself), with torch's errors.
"""

from __future__ import annotations

from typing import Tuple

from . import _lazy
from ._device import DeviceLike, check_range, device_index
from ._errors import AcceleratorError

__all__ = ["can_device_access_peer", "clock_rate", "device_memory_used", "list_gpu_processes",
           "memory_usage", "power_draw", "temperature", "utilization"]


def _resolve(device: DeviceLike):
    """(uninitialized backend, visible index) for ``device``, starting no runtime for None
    before init (the current device of every thread is then 0)."""
    backend = _lazy.backend()
    if device is None and not _lazy.is_initialized():
        index = 0
    else:
        index = device_index(device, optional=True)
    check_range(index)
    return backend, index


def _smi_backend(device: DeviceLike):
    backend, index = _resolve(device)
    if not backend.supports_smi:
        raise AcceleratorError(backend.no_smi_reason)
    return backend, index


def utilization(device: DeviceLike = None) -> int:
    """Percent of time over the past sample period during which one or more kernels was
    executing on ``device`` (the current device for None), as ``nvidia-smi`` reports it.

    The sample period is between 1/6 s and 1 s depending on the product (Level Zero: the time
    since the previous reading, at least 50 ms, from Sysman's activity counters; the first call
    waits that long).  Reads the management library (NVML / Sysman) only: starts no runtime.
    """
    backend, index = _smi_backend(device)
    return backend.smi_gpu_utilization(index)


def memory_usage(device: DeviceLike = None) -> int:
    """Percent of time over the past sample period during which global (device) memory was being
    read or written, as ``nvidia-smi`` reports it (not the bytes in use: see
    :func:`device_memory_used`)."""
    backend, index = _smi_backend(device)
    return backend.smi_memory_usage(index)


def temperature(device: DeviceLike = None) -> int:
    """Average temperature of the GPU die sensor in degrees C over the past sample period."""
    backend, index = _smi_backend(device)
    return backend.smi_temperature(index)


def power_draw(device: DeviceLike = None) -> int:
    """Average power draw of ``device`` in mW (milliwatts) over the past sample period."""
    backend, index = _smi_backend(device)
    return backend.smi_power_draw(index)


def clock_rate(device: DeviceLike = None) -> int:
    """Clock speed of the SM (compute) clock of ``device`` in MHz over the past sample period."""
    backend, index = _smi_backend(device)
    return backend.smi_clock_rate(index)


def device_memory_used(device: DeviceLike = None) -> int:
    """Device memory in use in bytes as ``nvidia-smi`` reports it: every process's, including
    the contexts' own, not only this process's allocator (see ``memory.memory_reserved``)."""
    backend, index = _smi_backend(device)
    return backend.smi_memory_used(index)


def list_gpu_processes(device: DeviceLike = None) -> str:
    """A printout of the processes running on ``device`` and the device memory each uses.

    torch's format: ``GPU:<management-library index>``, then ``no processes are running`` or one
    ``process <pid:>10> uses <MB:>12.3f> MB GPU memory`` line per process (``N/A`` where the
    library cannot tell, as under Windows WDDM).  Without a management library it returns a
    sentence saying so instead of raising, as torch does without pynvml.
    """
    backend, index = _resolve(device)
    if not backend.supports_smi:
        return backend.no_smi_reason
    try:
        smi_index = backend.smi_index(index)
        procs = backend.smi_processes(index)
    except AcceleratorError as exc:
        if exc.call is None:          # the library itself is missing, not a failed call
            return str(exc)
        raise
    lines = [f"GPU:{smi_index}"]
    if not procs:
        lines.append("no processes are running")
    for pid, used in procs:
        shown = f"{used / (1024 * 1024):>12.3f}" if used is not None else f"{'N/A':>12}"
        lines.append(f"process {pid:>10d} uses {shown} MB GPU memory")
    return "\n".join(lines)


def can_device_access_peer(device: DeviceLike, peer_device: DeviceLike) -> bool:
    """Whether ``device`` (None: the current device) can access ``peer_device``'s memory
    directly.  Initializes the runtime, as torch.  For a device and itself the runtime answers
    (CUDA: False; Level Zero: True, as zeDeviceCanAccessPeer documents; Metal: False).

    Raises AssertionError "Invalid device id" / "Invalid peer device id" for an index outside
    0..device_count()-1, as torch (followed by the index).
    """
    backend = _lazy.lazy_init()
    index = device_index(device, optional=True)
    peer = device_index(peer_device)
    count = backend.count()
    if index < 0 or index >= count:
        raise AssertionError(f"Invalid device id: {index} ({count} {backend.name} device(s): valid 0..{count - 1})")
    if peer < 0 or peer >= count:
        raise AssertionError(f"Invalid peer device id: {peer} ({count} {backend.name} device(s): valid "
                             f"0..{count - 1})")
    # a device and itself: each runtime's own answer (cudaDeviceCanAccessPeer: 0; Level Zero's
    # zeDeviceCanAccessPeer: true; Metal's one device: False)
    return bool(backend.can_access_peer(index, peer))


def _utilization_pair(device: DeviceLike = None) -> Tuple[int, int]:
    """(utilization, memory_usage) from one reading (for ``python -m accel``)."""
    backend, index = _smi_backend(device)
    return backend.smi_utilization(index)
