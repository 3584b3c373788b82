"""Counting CUDA devices and choosing the runtime, without starting CUDA (a mixin of
:class:`accel.backends.cuda.CudaBackend`).

Counting uses NVML, which does not initialize the CUDA driver, so it is safe before
``fork``; only the fallback (no NVML, or MIG UUIDs in CUDA_VISIBLE_DEVICES) asks the runtime,
which starts the driver as torch's fallback does.  Which libcudart serves the process is
decided here too (``libs``): NVML's driver CUDA version against every installed
runtime's version.  After init the runtime's count wins (``_reconcile_count``).
"""

from __future__ import annotations

import os
import warnings

from ..._errors import AcceleratorError
from .. import _visible
from .nvml import _NVML_SUCCESS

_NVML_UUID_BUFFER = 96   # NVML_DEVICE_UUID_V2_BUFFER_SIZE
_ERR_NO_DEVICE = 100     # cudaErrorNoDevice
_ERR_INSUFFICIENT_DRIVER = 35   # cudaErrorInsufficientDriver: no driver, or one too old for the runtime


class CudaDiscoveryMixin:
    """NVML counting, the libcudart choice and ``report()``; state lives in
    ``CudaBackend.__init__``."""

    def cudart_choice(self):
        """Which libcudart this backend uses and why (``libs.Choice``): every candidate
        with its CUDA version and verdict, and the driver's CUDA version read from NVML, or
        where NVML is unavailable from a candidate's ``cudaDriverGetVersion`` (no CUDA started
        either way).  Made once; the simulator offers its installed runtimes."""
        choice = self._choice
        if choice is not None:
            return choice
        with self._choice_lock:
            if self._choice is None:
                from . import libs
                nvml = self._nvml_lib()
                if nvml is not None:
                    driver, note = libs.driver_version_from_nvml(nvml[0], nvml[1])
                else:
                    # (r69g: "NVML missing" was written also when NVML loaded and its init failed)
                    why = self._nvml_error or "not loaded"
                    why = why.split(";")[0] if "\n" in why else why    # (a load's list of tries: its head)
                    driver, note = None, f"NVML unavailable: {why}"
                if self.simulated:
                    self._choice = self._sim_choice(driver, note)
                else:
                    self._choice = libs.choose_real(driver, note)
            return self._choice

    def _sim_choice(self, driver, note):
        from ... import sim
        from ..._ffi import CUDART_MAJORS
        from . import libs
        cfg = sim.config()
        if driver is None and cfg.runtimes and cfg.cudart:
            # the simulated libcudart's cudaDriverGetVersion, as libs.driver_version_from_runtime
            driver, note = libs.driver_version_note(cfg.driver_version if cfg.driver else 0,
                                                    "accel.sim", note)
        cands = []
        for v in reversed(cfg.runtimes):   # newest first, as the sonames are searched
            c = libs.Candidate(f"accel.sim (libcudart {libs.vtext(v)})", "ACCEL_SIM_CUDA_RUNTIME")
            if cfg.cudart:
                c.resolved, c.version, c.version_from = c.path, v, "simulator"
            else:
                c.reason = "not found (configure(cudart=False))"
            cands.append(c)
        return libs.choose(cands, driver, note, CUDART_MAJORS)

    _nvml_pid = None     # the process that initialized NVML

    def _nvml_lib(self):
        if self._nvml is not None and self._nvml_pid not in (None, os.getpid()):
            # a forked child: initialize NVML again, as torch's readings do (pynvml's nvmlInit on
            # every call); the parent's initialization answers NVML_ERROR_UNINITIALIZED here
            self._nvml = None
        if self._nvml is None and not self._nvml_missing:
            # One lock over open + init (r70k: a first count and a first init in two threads each
            # called nvmlInit_v2, and one initialization was never matched).  A library that does
            # not load is remembered; a failed nvmlInit_v2 is tried again at the next use, as
            # torch's readings call nvmlInit each time (r70k: one failure disabled NVML for good).
            with self._nvml_lock:
                if self._nvml is None and not self._nvml_missing:
                    try:
                        ffi, lib, path = self._open("nvml")
                    except OSError as exc:
                        self._nvml_error, self._nvml_missing = str(exc), True
                        return None
                    rc = lib.nvmlInit_v2()
                    if rc != _NVML_SUCCESS:
                        self._nvml_error = f"nvmlInit_v2 returned {rc} ({self._nvml_error_name(ffi, lib, rc)})"
                        return None
                    self._nvml, self._nvml_pid, self._nvml_error = (ffi, lib, path), os.getpid(), None
        return self._nvml

    @staticmethod
    def _nvml_error_name(ffi, lib, rc) -> str:
        try:
            return ffi.string(lib.nvmlErrorString(rc)).decode()
        except Exception:
            return "unknown NVML error"

    def count(self) -> int:
        # Before init the NVML count follows CUDA_VISIBLE_DEVICES as it is now, as torch's
        # device_count() (which caches only once CUDA is initialized).  A count from the
        # runtime is final: the driver read the variable once, at cuInit.
        count = self._count
        if count is not None and (self._count_final or self._count_env == os.environ.get("CUDA_VISIBLE_DEVICES")):
            return count
        with self._count_lock:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            if self._count is None or not (self._count_final or self._count_env == env):
                self._count_env = env
                self._count = self._discover()
            return self._count

    def _discover(self) -> int:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if _visible.parse(visible) == []:
            # nothing selected ("", "-1", a duplicate, garbage): 0 from the variable alone, as
            # torch's _device_count_nvml, starting nothing, so a later change of the variable is
            # read again and a forked child can still use CUDA (r69j: without NVML it asked
            # cudaGetDeviceCount, which starts the driver)
            self._count_path = "CUDA_VISIBLE_DEVICES"
            self._count_reason = f"CUDA_VISIBLE_DEVICES={visible!r} selects no device"
            return 0
        nvml = self._nvml_lib()
        if nvml is not None:
            ffi, lib, _ = nvml
            n = ffi.new("unsigned int *")
            rc = lib.nvmlDeviceGetCount_v2(n)
            if rc == _NVML_SUCCESS:
                try:
                    ordinals = _visible.visible_ordinals(visible, n[0], lambda: self._nvml_uuids(n[0]))
                except AcceleratorError as exc:
                    # a UUID NVML cannot read: only the runtime can match the GPU- prefixes (torch's
                    # _device_count_nvml returns -1, "ask the runtime", for it too)
                    ordinals, why = None, f"cudart (NVML could not match CUDA_VISIBLE_DEVICES: {exc})"
                else:
                    why = "cudart (MIG UUIDs in CUDA_VISIBLE_DEVICES need the runtime)"
                if ordinals is not None:
                    self._count_path = "nvml"
                    if not ordinals:
                        self._count_reason = ("no device visible: NVML sees "
                                              f"{n[0]} but CUDA_VISIBLE_DEVICES={visible!r} selects none"
                                              if n[0] else "NVML reports no NVIDIA device")
                    elif not self.cudart_choice().usable:
                        # NVML sees GPUs but no installed libcudart can run on this driver
                        # (loading candidates starts nothing): not available, and say why
                        self._count_reason = (f"NVML sees {len(ordinals)} device(s) but "
                                              f"{self.cudart_choice().error}")
                        return 0
                    return len(ordinals)
                self._count_path = why
            else:
                self._count_path = f"cudart (nvmlDeviceGetCount_v2 failed: {rc})"
        else:
            self._count_path = "cudart (NVML unavailable: see nvml_error)"
        # Fallback: only the runtime can count.  This initializes the driver (cuInit),
        # as torch's fallback does, so it is used only without NVML (or for MIG UUIDs);
        # a child forked after it cannot use CUDA (REFERENCE.md "Hardware rules").
        try:
            ffi, lib, _ = self._runtime()
        except AcceleratorError as exc:
            self._count_reason = str(exc)
            return 0
        n = ffi.new("int *")
        rc = lib.cudaGetDeviceCount(n)
        if rc in (0, _ERR_NO_DEVICE):  # the driver started (and found no device, for 100)
            self.driver_started = True
            self._count_final = True
        if rc != 0:
            lib.cudaGetLastError()     # handled here: leave no stale last error behind
            name = ffi.string(lib.cudaGetErrorName(rc)).decode()
            self._count_reason = f"cudaGetDeviceCount returned {name} ({rc})"
            if rc == _ERR_INSUFFICIENT_DRIVER:
                self._count_reason += ": " + self._insufficient_driver(ffi, lib)
            return 0
        if n[0] == 0:
            self._count_reason = "cudaGetDeviceCount reports no device"
        return n[0]

    @staticmethod
    def _insufficient_driver(ffi, lib) -> str:
        """Why the runtime answers cudaErrorInsufficientDriver: no driver, or which one (neither
        version query starts anything)."""
        from .libs import insufficient_driver_message
        rt, drv = ffi.new("int *"), ffi.new("int *")
        if lib.cudaRuntimeGetVersion(rt) != 0 or lib.cudaDriverGetVersion(drv) != 0:
            lib.cudaGetLastError()
            return "no NVIDIA driver is installed, or one older than the runtime"
        return insufficient_driver_message(rt[0], drv[0])

    def _nvml_uuids(self, raw_count: int):
        """Every NVML device's UUID; AcceleratorError naming the call and the device when one
        cannot be read (taking it as "" made a GPU- prefix naming that device select nothing)."""
        from .nvml import _nvml_code_name
        ffi, lib, _ = self._nvml
        uuids = []
        handle = ffi.new("nvmlDevice_t *")
        buf = ffi.new("char[]", _NVML_UUID_BUFFER)
        for i in range(raw_count):
            rc = lib.nvmlDeviceGetHandleByIndex_v2(i, handle)
            call = "nvmlDeviceGetHandleByIndex_v2"
            if rc == _NVML_SUCCESS:
                rc = lib.nvmlDeviceGetUUID(handle[0], buf, _NVML_UUID_BUFFER)
                call = "nvmlDeviceGetUUID"
            if rc != _NVML_SUCCESS:
                raise AcceleratorError.from_call("libnvidia-ml", call, rc, _nvml_code_name(ffi, rc),
                                                 f"{self._nvml_error_name(ffi, lib, rc)} (NVML device {i})")
            uuids.append(ffi.string(buf).decode())
        return uuids

    def report(self) -> dict:
        info = {"backend": self.name, "simulated": self.simulated}
        try:
            count = self.count()
        except Exception as exc:  # report() never raises
            count, self._count_reason = 0, f"counting failed: {exc}"
        info["count"] = count
        info["count_path"] = self._count_path
        if self._nvml_lib() is not None:
            ffi, lib, path = self._nvml
            info["nvml_library"] = path
            buf = ffi.new("char[]", 96)
            if lib.nvmlSystemGetDriverVersion(buf, 96) == _NVML_SUCCESS:
                info["driver_version"] = ffi.string(buf).decode()
        else:
            info["nvml_library"] = None
            info["nvml_error"] = self._nvml_error
        try:
            info["cudart_choice"] = self.cudart_choice().as_dict()
        except Exception as exc:  # report() never raises
            info["cudart_choice"] = {"error": f"choosing libcudart failed: {exc!r}"}
        try:
            ffi, lib, path = self._runtime()
            info["library"] = path
            v = ffi.new("int *")
            if lib.cudaRuntimeGetVersion(v) == 0:
                info["runtime_version"] = f"{v[0] // 1000}.{v[0] % 1000 // 10}"
            if lib.cudaDriverGetVersion(v) == 0:  # does not initialize; 0 without a driver
                info["driver_cuda_version"] = f"{v[0] // 1000}.{v[0] % 1000 // 10}" if v[0] else None
            info.update(self.kernel_path())   # from the exported symbols; starts nothing
        except AcceleratorError as exc:
            info["library"] = self._rt_refused[2] if self._rt_refused is not None else None
            info["library_error"] = str(exc)
            if self._rt_refused is not None:
                ffi, lib, _ = self._rt_refused
                v = ffi.new("int *")
                if lib.cudaRuntimeGetVersion(v) == 0:   # starts nothing
                    info["runtime_version"] = f"{v[0] // 1000}.{v[0] % 1000 // 10}"
        info["env"] = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
        if count == 0:
            info["reason"] = self._count_reason or "no device"
        return info

    def _reconcile_count(self, runtime_count: int) -> None:
        """From init on, the count is the runtime's.  NVML can disagree (MIG-enabled GPUs,
        CUDA_VISIBLE_DEVICES changed between counting and init, a device the driver
        refuses); say so once rather than let indices past the runtime's fail later."""
        with self._count_lock:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            if self._count is not None and not self._count_final and self._count_env != env:
                self._count_env, self._count = env, self._discover()
            before = self._count
            if before is not None and before != runtime_count:
                warnings.warn(f"accel: {self._count_path or 'counting'} found {before} visible CUDA "
                              f"device(s) but the initialized runtime (cudaGetDeviceCount) reports "
                              f"{runtime_count}; using {runtime_count} (MIG, or a device the driver "
                              f"does not expose)", RuntimeWarning, stacklevel=2)
                self._count_path = f"cudart after init (the fork-safe count said {before})"
            # the variable as the driver read it at cuInit: the NVML readings map indices through it
            # (with ACCEL_BACKEND or ACCEL_SIM set nothing counted before, and it was still None)
            self._count, self._count_final, self._count_env = runtime_count, True, env
