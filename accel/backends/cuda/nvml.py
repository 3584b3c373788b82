"""The CUDA backend's management-library readings (the Backend ``smi_*`` capability) and peer access.

torch.cuda reads utilization, memory_usage, temperature, power_draw, clock_rate,
device_memory_used and list_gpu_processes through pynvml, never through the CUDA runtime, so
they work before ``cuInit`` and leave ``fork`` safe.  Here the same NVML calls go through the
NVML this backend already opened to count devices (``discovery``).  Visible index ``i`` is
turned into NVML's index as torch's ``_get_nvml_device_index`` does: through
CUDA_VISIBLE_DEVICES (ordinals or GPU- UUID prefixes), as it was when the devices were counted
(after init: as the driver read it).  ``can_device_access_peer`` is the runtime's question
(``cudaDeviceCanAccessPeer``), as in torch.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..._errors import AcceleratorError
from .. import _visible

_NVML_SUCCESS = 0
_NVML_ERROR_INSUFFICIENT_SIZE = 7
_NVML_TEMPERATURE_GPU = 0      # nvmlTemperatureSensors_t: the GPU die (torch passes 0)
_NVML_CLOCK_SM = 1             # nvmlClockType_t: the SM clock (torch passes 1)
_NOT_AVAILABLE_ULL = (1 << 64) - 1   # NVML_VALUE_NOT_AVAILABLE in an unsigned long long field
_PROCESS_LIST_ATTEMPTS = 8           # asks with more room before a growing process list is an error
_PROCESS_LIST_MAX = 1 << 16          # a count above any real process table (pid_max is 4M; a GPU's far less)


class CudaNvmlMixin:
    """``smi_*`` over NVML and ``can_access_peer`` over libcudart; state lives in ``CudaBackend``."""

    supports_smi = True

    def _smi_lib(self):
        self.count()        # opens NVML and fixes the CUDA_VISIBLE_DEVICES the count used
        nvml = self._nvml_lib()
        if nvml is None:
            raise AcceleratorError(
                f"NVML (libnvidia-ml) is not available, and utilization, temperature, power, clocks "
                f"and processes are read from it: {self._nvml_error}. Install the NVIDIA driver or "
                f"set ACCEL_NVML_PATH to libnvidia-ml.so.1", library="libnvidia-ml")
        return nvml[0], nvml[1]

    def _nvml_fail(self, ffi, lib, call: str, rc: int):
        name = self._nvml_error_name(ffi, lib, rc)
        return AcceleratorError.from_call("libnvidia-ml", call, rc, _nvml_code_name(ffi, rc), name)

    def smi_index(self, index: int) -> int:
        ffi, lib = self._smi_lib()
        n = ffi.new("unsigned int *")
        rc = lib.nvmlDeviceGetCount_v2(n)
        if rc != _NVML_SUCCESS:
            raise self._nvml_fail(ffi, lib, "nvmlDeviceGetCount_v2", rc)
        env = self._count_env
        ordinals = _visible.visible_ordinals(env, n[0], lambda: self._nvml_uuids(n[0]))
        if ordinals is None:
            raise AcceleratorError(f"NVML cannot name the devices CUDA_VISIBLE_DEVICES={env!r} selects "
                                   f"(MIG UUIDs): list GPU ordinals or GPU- UUIDs instead")
        if not 0 <= index < len(ordinals):
            raise ValueError(f"device {index} is not visible (CUDA_VISIBLE_DEVICES={env!r} selects "
                             f"NVML devices {ordinals}); valid indices 0..{len(ordinals) - 1}")
        if self._uuids is not None:
            found = self._nvml_index_of(index, n[0])
            if found is not None:
                return found
        return ordinals[index]

    def _nvml_index_of(self, index: int, raw_count: int) -> Optional[int]:
        """NVML's index of CUDA device ``index``, matched by the UUID read at init.  NVML
        enumerates by PCI bus id and CUDA, by default, fastest first (nvml.h: "The NVML index
        may not correlate with other APIs, such as the CUDA device index"; CUDA Programming
        Guide, CUDA_DEVICE_ORDER), so position alone may name another GPU (r71g; torch's
        ``_get_nvml_device_index`` does).  Before init only the position is known: exact under
        CUDA_DEVICE_ORDER=PCI_BUS_ID and with identical GPUs.  A GPU NVML cannot read (lost)
        is passed over; None when no NVML device has the UUID (a MIG instance)."""
        cache = self._smi_by_uuid
        if index not in cache:
            uuids = self._uuids
            if uuids is None or index >= len(uuids):
                return None
            ffi, lib = self._smi_lib()
            handle = ffi.new("nvmlDevice_t *")
            buf = ffi.new("char[]", 96)         # NVML_DEVICE_UUID_V2_BUFFER_SIZE
            found, unread = None, []
            for i in range(raw_count):
                rc = lib.nvmlDeviceGetHandleByIndex_v2(i, handle)
                if rc == _NVML_SUCCESS:
                    rc = lib.nvmlDeviceGetUUID(handle[0], buf, 96)
                if rc != _NVML_SUCCESS:
                    unread.append((i, rc))
                elif ffi.string(buf).decode(errors="replace") == uuids[index]:
                    found = i
                    break
            if found is None and unread and not uuids[index].startswith("MIG-"):
                # r72d: the GPU is most likely the one NVML could not read; its position would
                # name another GPU, whose readings would pass for this one's.  Not cached: a
                # GPU that recovers (or a transient failure) is matched next time.
                i, rc = unread[0]
                raise AcceleratorError(
                    f"NVML cannot read CUDA device {index} ({uuids[index]}): no readable NVML device has its "
                    f"UUID, and NVML device {i} did not answer ({_nvml_code_name(ffi, rc)}); "
                    f"the GPU may be lost or in reset (nvidia-smi -q shows its state)")
            cache[index] = found
        return cache[index]

    def _smi_handle(self, index: int):
        ffi, lib = self._smi_lib()
        nvml_index = self.smi_index(index)
        handle = ffi.new("nvmlDevice_t *")
        rc = lib.nvmlDeviceGetHandleByIndex_v2(nvml_index, handle)
        if rc != _NVML_SUCCESS:
            raise self._nvml_fail(ffi, lib, "nvmlDeviceGetHandleByIndex_v2", rc)
        return ffi, lib, handle[0]

    def _smi_uint(self, index: int, call: str, *args) -> int:
        ffi, lib, h = self._smi_handle(index)
        out = ffi.new("unsigned int *")
        rc = getattr(lib, call)(h, *args, out)
        if rc != _NVML_SUCCESS:
            raise self._nvml_fail(ffi, lib, call, rc)
        return int(out[0])

    def smi_utilization(self, index: int) -> Tuple[int, int]:
        ffi, lib, h = self._smi_handle(index)
        u = ffi.new("nvmlUtilization_t *")
        rc = lib.nvmlDeviceGetUtilizationRates(h, u)
        if rc != _NVML_SUCCESS:
            raise self._nvml_fail(ffi, lib, "nvmlDeviceGetUtilizationRates", rc)
        return int(u.gpu), int(u.memory)

    def smi_temperature(self, index: int) -> int:
        return self._smi_uint(index, "nvmlDeviceGetTemperature", _NVML_TEMPERATURE_GPU)

    def smi_power_draw(self, index: int) -> int:
        return self._smi_uint(index, "nvmlDeviceGetPowerUsage")

    def smi_clock_rate(self, index: int) -> int:
        return self._smi_uint(index, "nvmlDeviceGetClockInfo", _NVML_CLOCK_SM)

    def smi_memory_used(self, index: int) -> int:
        ffi, lib, h = self._smi_handle(index)
        m = ffi.new("nvmlMemory_t *")
        rc = lib.nvmlDeviceGetMemoryInfo(h, m)
        if rc != _NVML_SUCCESS:
            raise self._nvml_fail(ffi, lib, "nvmlDeviceGetMemoryInfo", rc)
        return int(m.used)

    def smi_processes(self, index: int) -> List[Tuple[int, Optional[int]]]:
        ffi, lib, h = self._smi_handle(index)
        call = "nvmlDeviceGetComputeRunningProcesses_v3"
        count = ffi.new("unsigned int *", 0)
        rc = lib.nvmlDeviceGetComputeRunningProcesses_v3(h, count, ffi.NULL)
        # nvml.h: *infoCount 0 asks for the count; the list may grow between the two calls, so
        # ask again with more room (as pynvml does), a few times: a list that never fits is an
        # error, not a buffer doubled until MemoryError
        for _attempt in range(_PROCESS_LIST_ATTEMPTS):
            if rc != _NVML_ERROR_INSUFFICIENT_SIZE:
                break
            room = min(count[0], _PROCESS_LIST_MAX) * 2 + 5
            infos = ffi.new("nvmlProcessInfo_t[]", room)
            count[0] = room
            rc = lib.nvmlDeviceGetComputeRunningProcesses_v3(h, count, infos)
            if rc == _NVML_SUCCESS:
                return [(int(infos[k].pid),
                         None if infos[k].usedGpuMemory == _NOT_AVAILABLE_ULL else int(infos[k].usedGpuMemory))
                        for k in range(count[0])]
        if rc == _NVML_ERROR_INSUFFICIENT_SIZE:
            raise AcceleratorError.from_call(
                "libnvidia-ml", call, rc, _nvml_code_name(ffi, rc),
                f"the process list kept growing past the room given, {_PROCESS_LIST_ATTEMPTS} times; read again")
        if rc != _NVML_SUCCESS:
            raise self._nvml_fail(ffi, lib, call, rc)
        return []

    def can_access_peer(self, index: int, peer: int) -> bool:
        out = self.ffi.new("int *")
        self._check(self.lib.cudaDeviceCanAccessPeer(out, index, peer), "cudaDeviceCanAccessPeer")
        return bool(out[0])


def _nvml_code_name(ffi, rc: int) -> str:
    """NVML_ERROR_* for ``rc`` (the enum's name in the generated declarations)."""
    try:
        return ffi.string(ffi.cast("nvmlReturn_t", rc))
    except Exception:      # an unknown value: cffi gives back the number
        return f"NVML error {rc}"
