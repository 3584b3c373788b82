"""CUDA backend over libcudart (runtime API) and libnvidia-ml (counting).

:class:`CudaBackend` is the Backend protocol for the CUDA runtime, composed of one mixin per
concern, each in its own module with its part of the design:

* :mod:`.discovery`: counting devices with NVML without starting CUDA (fork-safe), the
  libcudart choice and ``report()``; :mod:`.libs`: every installed libcudart candidate, its
  CUDA version and the driver's, and the choice between them (pure logic and probes);
* :mod:`.runtime`: opening libcudart through the bindings of its major, ``_check`` and
  ``_check_driver`` (return codes to exceptions), handle casts;
* :mod:`.devices`: init, device properties, the current device (deferred restores, primary
  contexts), device synchronize and ``mem_info``;
* :mod:`.memory`: device and pinned allocations (relaxed around a capture), copies and fills;
* :mod:`.streams`: streams (the legacy default stream as handle 0, foreign handles) and events;
* :mod:`.graphs`: stream capture (the count, owners and gate behind the capture refusals) and
  graphs;
* :mod:`.kernels`: modules, functions, launches, limits and occupancy;
* :mod:`.driver`: driver functions reached through ``cudaGetDriverEntryPoint`` (no libcuda
  binding), and the kernel path of runtimes before 12.8;
* :mod:`.vmm`: virtual memory (cuMem* through the driver entry points) for the allocator's
  expandable segments;
* :mod:`.mempool`: stream-ordered allocation (cudaMallocAsync and each device's default pool);
* :mod:`.nvml`: the ``smi_*`` readings over NVML, and peer access;
* :mod:`.nvrtc`: libnvrtc for ``accel.compile`` (not a mixin: CUDA C++ to PTX/cubin, no device).

The runtime is touched only by :meth:`CudaBackend.init` and what follows it.  With
``ACCEL_SIM=cuda`` both libraries come from ``accel.sim`` instead; everything below the library
calls is the same code.

Why mixins rather than collaborator objects: every concern works on the same state (the
runtime's ``ffi``/``lib``, the handle cache, the capture count, owners and gate, the releases
deferred until the captures end), and the calls between concerns go both ways (an allocation
relaxes the capture mode graphs.py counts; an event record asks whether its stream captures;
unloads and graph destroys wait for the captures to end; vmm and mempool check through
runtime.py and take the capture gate).  Collaborators would each need the backend back, and
every call would pass through it; mixins keep each call site as it was and the state in one
place, :meth:`CudaBackend.__init__`, which lists it all.  Each mixin's docstring says what it
covers.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import List, Optional

from ... import _locks
from ..base import Backend
from .devices import CudaDevicesMixin, _DeferredDevice
from .discovery import CudaDiscoveryMixin
from .graphs import CudaGraphsMixin
from .kernels import CudaKernelsMixin, _ArgPools
from .memory import CudaMemoryMixin
from .mempool import CudaMemPoolMixin
from .nvml import CudaNvmlMixin
from .runtime import CudaRuntimeMixin
from .streams import CudaStreamsMixin
from .vmm import CudaVmmMixin

__all__ = ["CudaBackend", "create"]


class CudaBackend(CudaRuntimeMixin, CudaDevicesMixin, CudaMemoryMixin, CudaStreamsMixin, CudaGraphsMixin,
                  CudaKernelsMixin, CudaDiscoveryMixin, CudaVmmMixin, CudaMemPoolMixin, CudaNvmlMixin,
                  Backend):
    """The CUDA runtime (libcudart) as a :class:`Backend` (see the module docstring for the design)."""

    name = "cuda"
    kernel_language = "ptx"
    supports_graphs = True
    supports_external_events = True   # cudaEventRecordWithFlags / cudaStreamWaitEvent flags (CUDA >= 11.1)
    shared_default_stream = True  # handle 0, the legacy stream of the *current* device
    supports_vmm = True           # cuMem* through cudaGetDriverEntryPoint (vmm); vmm_supported per device
    _vmm_fns = None               # vmm.DriverVmm, or why there is none (str), resolved at first use

    def __init__(self, simulated: bool):
        self.simulated = simulated
        self._lock = threading.Lock()
        # accel._locks.Lock: a __del__ run by a collection inside the first count that counts
        # devices (device_count, manual_seed) is refused instead of waiting on its own thread (r70m)
        self._count_lock = _locks.Lock("counting CUDA devices")
        self._rt = None          # (ffi, lib, path) of libcudart, opened on first use
        self._rt_error = None    # why libcudart could not be opened
        self._nvml = None        # (ffi, lib, path) of NVML, opened on first count
        self._nvml_error = None
        self._nvml_missing = False   # the library does not load (a failed nvmlInit_v2 is tried again)
        self._nvml_lock = _locks.Lock("initializing NVML")
        self._count = None
        self._count_env = None    # CUDA_VISIBLE_DEVICES the count was computed for
        self._smi_by_uuid: dict = {}   # CUDA index -> NVML index, matched by UUID (nvml)
        self._uuids: Optional[List[str]] = None   # each device's "GPU-..." UUID, read at init
        self._count_final = False  # the runtime counted: it read the variable once, at cuInit
        self._count_path = ""
        self._count_reason = ""
        self._handles = {}       # int handle -> cdata, so hot calls skip ffi.cast
        self._arg_pools = _ArgPools()  # this thread's argument cells free for a launch
        self._live_modules = {}  # library handle -> PTX buffer kept alive for the runtime
        self._after_capture = deque()  # (fn, args): releases drivers refuse while a capture is underway
        self._driver_cuda = None  # cudaDriverGetVersion, read at first need
        self._kpath = None       # kernel path: "library", a driver.DriverKernels, or why none
        self._captures = 0       # stream captures underway in this process
        # Backend.capture_gate: held from a "no capture underway" check through the potentially
        # unsafe calls it allows (cudaMalloc outside relaxed mode and vmm's cuMem* calls; the
        # allocators' event and stream queries, synchronizes and frees), and by capture_begin from
        # its count through cudaStreamBeginCapture (r63: a CI flake; r64: the queries)
        self.capture_gate = threading.RLock()
        self._capture_owners = {}  # capturing stream handle -> thread that began a non-relaxed capture
        self._capture_devices = {}  # capturing stream handle -> its device (host_wait_refused)
        self._out = threading.local()  # per-thread out-pointers for hot getters (no ffi.new per call)
        self._deferred = _DeferredDevice()  # per thread: a restore waiting for a primary context
        # threads that may have one (a hint, so the hot get_device skips the thread-local lookup)
        self._deferring = [0]
        self._deferring_lock = threading.Lock()
        self._ctx_fns = None     # has_primary_context's driver functions, or why there are none (str)
        self._rt_module = None   # accel._ffi.cudart_module of the opened runtime's major (checked)
        self._capture_info = (None, ())  # cudaStreamGetCaptureInfo[_v2] and its NULL outputs
        self._choice = None      # libs.Choice: which libcudart, and every candidate's verdict
        self._choice_lock = _locks.Lock("choosing the CUDA runtime")
        self._rt_refused = None  # (ffi, lib, path) of an ACCEL_CUDART_PATH runtime the driver cannot run

    def fresh_locks_in_child(self) -> None:
        # _lock: opening libcudart and the kernel path; the others: counting, the runtime choice
        self._lock = threading.Lock()
        self._count_lock = _locks.Lock("counting CUDA devices")
        self._choice_lock = _locks.Lock("choosing the CUDA runtime")
        self._nvml_lock = _locks.Lock("initializing NVML")


def create() -> CudaBackend:
    return CudaBackend(simulated=os.environ.get("ACCEL_SIM", "").strip().lower() == "cuda")
