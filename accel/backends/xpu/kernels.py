"""User kernels on Level Zero: SPIR-V modules (zeModuleCreate), kernels (zeKernelCreate) and
launches (zeKernelSetGroupSize + zeKernelSetArgumentValue + zeCommandListAppendLaunchKernel).

A module is built for the current device in that device's context; a build failure raises with
the driver's build log (zeModuleBuildLogGetString).  Kernel arguments are state of the kernel
object until the append (ze_api.h, zeKernelSetArgumentValue: "The argument values are ...
copied at the time of the append"), so setting them and appending happen under one lock.
"""

from __future__ import annotations

import threading
from typing import Tuple

from ..._errors import AcceleratorError, CompileError
from ._library import LIBRARY

_SCALAR_CTYPES = {"u32": "uint32_t", "i32": "int32_t", "u64": "uint64_t", "i64": "int64_t",
                  "f32": "float", "f64": "double", "ptr": "void *"}


class KernelsMixin:
    """Modules and kernels (``_modules``, ``_kernels``) and kernel launches."""

    def _kernel_state(self):
        st = getattr(self, "_kstate", None)
        if st is None:
            with self._lock:
                st = getattr(self, "_kstate", None)
                if st is None:
                    # module handle -> (device, [kernel handles]); kernel handle -> (cdata, module, device,
                    # {stream: number of its latest launch there}).  The tables change only under the
                    # lock: the driver gives a destroyed handle's value to the next module or kernel.
                    st = self._kstate = ({}, {}, threading.Lock())
        return st

    def module_load(self, source: bytes) -> int:
        ffi, lib, _ = self._lib
        data = bytes(source)
        dev = self._current()
        image = ffi.new("uint8_t[]", data)
        desc = ffi.new("ze_module_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_MODULE_DESC
        desc.format = lib.ZE_MODULE_FORMAT_IL_SPIRV
        desc.inputSize = len(data)
        desc.pInputModule = image
        # a struct field does not keep a cdata alive (cffi: "the owning cdata ... must be kept
        # alive"): the flags are held here until zeModuleCreate returned (r68g)
        flags = ffi.new("char[]", b"")
        desc.pBuildFlags = flags
        mod = ffi.new("ze_module_handle_t *")
        log = ffi.new("ze_module_build_log_handle_t *")
        rc = lib.zeModuleCreate(dev.ctx, dev.handle, desc, mod, log)
        text = self._build_log(log[0]) if log[0] != ffi.NULL else ""
        if rc:
            err = self._error("zeModuleCreate", rc, f"build log: {text.strip() or '(empty)'}")
            if err.code_name == "ZE_RESULT_ERROR_MODULE_BUILD_FAILURE":    # the SPIR-V did not build
                err = CompileError(str(err), log=text, library=err.library, call=err.call, code=err.code,
                                   code_name=err.code_name)
            raise err
        handle = int(ffi.cast("uintptr_t", mod[0]))
        modules, _kernels, klock = self._kernel_state()
        with klock:
            modules[handle] = (dev, [])
        return handle

    def _build_log(self, log) -> str:
        ffi, lib, _ = self._lib
        try:
            size = ffi.new("size_t *")
            if lib.zeModuleBuildLogGetString(log, size, ffi.NULL) or size[0] == 0:
                return ""
            buf = ffi.new("char[]", size[0])
            if lib.zeModuleBuildLogGetString(log, size, buf):
                return ""
            return ffi.string(buf).decode("utf-8", "replace")
        finally:
            if lib.zeModuleBuildLogDestroy(log):
                with self._lock:        # kept for the next sweep to retry, not leaked
                    self._orphans.append(("zeModuleBuildLogDestroy", log))

    def module_unload(self, module: int) -> None:
        """Destroy the module's kernels, then the module.  ze_api.h, zeKernelDestroy: "The
        application is responsible for making sure the device is not currently referencing the
        kernel before it is deleted", so the streams that launched them and the device's graph
        replays are waited for first.  A failed destroy raises and leaves the module (and the
        kernels not yet destroyed) loaded and known, so unloading it again retries."""
        ffi, lib, _ = self._lib
        modules, kernels, klock = self._kernel_state()
        with klock:
            entry = modules.get(module)
            uses = [] if entry is None else [(s, seq) for k in entry[1] for s, seq in kernels[k][3].items()]
        if entry is None:
            raise ValueError(f"xpu: {module:#x} is not a loaded module of this backend")
        for s, seq in uses:
            if s.done < seq:
                self._sync_stream(s)
        for g in list(entry[0].graphs):     # replays of graphs that may launch them
            with g.lock:
                self._sync_graph(g)
        with klock:
            if modules.get(module) is not entry:
                raise ValueError(f"xpu: {module:#x} was unloaded by another thread meanwhile")
            ks = entry[1]
            destroyed = []
            try:
                while ks:
                    self._check_rc("zeKernelDestroy", lib.zeKernelDestroy(kernels[ks[-1]][0]))
                    destroyed.append(ks[-1])
                    del kernels[ks.pop()]
                self._check_rc("zeModuleDestroy", lib.zeModuleDestroy(ffi.cast("ze_module_handle_t", module)))
            except BaseException:
                if destroyed:
                    self._break_graphs(destroyed, module)
                raise
            del modules[module]

    def _break_graphs(self, destroyed, module: int) -> None:
        """A failed unload destroyed ``destroyed`` kernels of a module that stays loaded: the
        graphs whose lists launch any of them can never be executed again (ze_api.h,
        zeKernelDestroy: the device must not reference a destroyed kernel; their lists do, and
        the driver may give the handles to new kernels).  Their replays are refused (r67a: the
        driver was handed the destroyed kernels)."""
        gone = set(destroyed)
        why = (f"its list launches kernels that a failed unload of module {module:#x} destroyed "
               f"(zeModuleDestroy failed after zeKernelDestroy)")
        with self._lock:
            # (captures underway too: a graph they end with holds the destroyed kernels, r67f)
            graphs = set(self._graphs.values()) | set(self._execs.values()) | set(self._captures.values())
        for g in graphs:
            if g.broken is None and not gone.isdisjoint(g.kernels):
                g.broken = why

    def _kernels_close(self) -> None:
        """Destroy every kernel and module (backend close: the device is idle)."""
        if self._kstate is None:
            return
        for module in list(self._kstate[0]):
            self.module_unload(module)

    def function_live(self, module: int, function: int) -> bool:
        _modules, kernels, klock = self._kernel_state()
        with klock:
            entry = kernels.get(function)
            return entry is not None and entry[1] == module

    def module_function(self, module: int, name: str) -> int:
        ffi, lib, _ = self._lib
        modules, kernels, klock = self._kernel_state()
        entry = modules.get(module)
        if entry is None:
            raise ValueError(f"xpu: {module:#x} is not a loaded module of this backend")
        if not isinstance(name, str):
            raise TypeError(f"xpu: a kernel name is a str, got {type(name).__name__} {name!r}")
        desc = ffi.new("ze_kernel_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_KERNEL_DESC
        cname = ffi.new("char[]", name.encode())
        desc.pKernelName = cname
        k = ffi.new("ze_kernel_handle_t *")
        self._check_rc("zeKernelCreate", lib.zeKernelCreate(ffi.cast("ze_module_handle_t", module), desc, k))
        handle = int(ffi.cast("uintptr_t", k[0]))
        with klock:
            if modules.get(module) is entry:
                kernels[handle] = (k[0], module, entry[0], {})
                entry[1].append(handle)
                return handle
        self._discard("zeKernelDestroy", k[0])
        raise ValueError(f"xpu: {module:#x} was unloaded by another thread meanwhile")

    def launch_limits(self, index: int) -> dict:
        ffi, lib, _ = self._lib
        dev = self._device(index)
        cp = ffi.new("ze_device_compute_properties_t *")
        cp.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES
        self._check_rc("zeDeviceGetComputeProperties", lib.zeDeviceGetComputeProperties(dev.handle, cp))
        # Level Zero has no opt-in for shared local memory: maxSharedLocalMemory is the limit.
        return {"max_grid": (cp.maxGroupCountX, cp.maxGroupCountY, cp.maxGroupCountZ),
                "max_block": (cp.maxGroupSizeX, cp.maxGroupSizeY, cp.maxGroupSizeZ),
                "max_threads_per_block": cp.maxTotalGroupSize,
                "max_shared_per_block": cp.maxSharedLocalMemory,
                "max_shared_per_block_optin": cp.maxSharedLocalMemory}

    def launch(self, function: int, grid: Tuple[int, int, int], block: Tuple[int, int, int],
               args, shared_mem: int, stream: int) -> None:
        ffi, lib, _ = self._lib
        _modules, kernels, klock = self._kernel_state()
        entry = kernels.get(function)
        if entry is None:
            raise ValueError(f"xpu: {function:#x} is not a kernel of this backend (module_function)")
        k, _module, dev, uses = entry
        s = self._stream(stream)
        if s.device is not dev:
            raise AcceleratorError(f"xpu: the kernel's module was built for device {dev.index}, the stream is "
                                   f"of another device", library=LIBRARY, call="zeCommandListAppendLaunchKernel")
        if shared_mem:
            raise ValueError("xpu: dynamic shared local memory is a kernel argument on Level Zero "
                             "(a local pointer); shared_mem must be 0")
        values = []
        for i, (kind, value) in enumerate(args):
            ctype = _SCALAR_CTYPES.get(kind)
            if ctype is None:
                raise ValueError(f"kernel argument {i}: unknown type {kind!r}")
            values.append((ffi.sizeof(ctype), ffi.new(ctype + " *", ffi.cast(ctype, value) if kind == "ptr"
                                                     else value)))
        count = ffi.new("ze_group_count_t *", tuple(grid))
        with klock:     # arguments are kernel state until the append copies them
            if kernels.get(function) is not entry:
                # Its module was unloaded by another thread since the lookup: the handle is
                # destroyed (and its value may be another kernel's now).
                raise ValueError(f"xpu: {function:#x} is not a kernel of this backend (its module was unloaded "
                                 f"by another thread meanwhile)")
            self._check_rc("zeKernelSetGroupSize", lib.zeKernelSetGroupSize(k, *block))
            for i, (size, p) in enumerate(values):
                self._check_rc("zeKernelSetArgumentValue", lib.zeKernelSetArgumentValue(k, i, size, p))
            seq = self._enqueue(s, f"kernel grid{tuple(grid)} block{tuple(block)}", "zeCommandListAppendLaunchKernel",
                                lib.zeCommandListAppendLaunchKernel, k, count, ffi.NULL, 0, ffi.NULL,
                                kernel=function)
            if seq is not None:         # (captured: the graph's replays are waited for at unload)
                uses[s] = seq
                if len(uses) > 16:      # bounded by the streams it may still run on
                    for old in [st for st, n in uses.items() if st.done >= n]:
                        del uses[old]
