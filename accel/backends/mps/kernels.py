"""Kernels: Metal Shading Language compiled at run time, compute pipelines, launches.

MSL source is compiled with ``newLibraryWithSource:options:error:`` (fast math off), one
compute pipeline per function.  CUDA's grid of blocks maps to
``dispatchThreadgroups:threadsPerThreadgroup:``; argument ``i`` binds to ``[[buffer(i)]]``:
pointers with ``setBuffer:offset:atIndex:``, scalars with ``setBytes:length:atIndex:``.
"""

from __future__ import annotations

from typing import Tuple

from ..._errors import AcceleratorError, CompileError
from .._signals import deferred
from ..base import KernelArgs
from ._library import _LIBRARY, M_COMPUTE_ENCODER, M_DISPATCH, M_MAX_THREADS, M_NEW_FUNCTION, M_NEW_LIBRARY, \
    M_NEW_OPTIONS, M_NEW_PIPELINE, M_SET_BUFFER, M_SET_BYTES, M_SET_FAST_MATH, M_SET_PIPELINE, \
    M_SET_THREADGROUP_MEMORY, M_STATIC_THREADGROUP_MEMORY, _InvalidHandle

_MAX_BUFFER_INDEX = 31  # [[buffer(0..30)]]
_MAX_GRID = 2 ** 32 - 1            # threadgroups per grid dimension (a uint position in MSL)
_MAX_THREADGROUP_MEMORY = 32 * 1024  # maxThreadgroupMemoryLength on Apple GPU families

# Kernel scalar argument kinds (base.KERNEL_ARG_TYPES) -> C type for setBytes.
_SCALAR_CTYPES = {"u32": "uint32_t", "i32": "int32_t", "u64": "uint64_t", "i64": "int64_t",
                  "f32": "float"}


class KernelsMixin:
    """Modules (``_modules``) and kernels (``_functions``): compile, look up, launch."""

    @deferred
    def module_load(self, source: bytes) -> int:
        rt = self._runtime()
        if isinstance(source, str):
            source = source.encode()
        if not isinstance(source, (bytes, bytearray)) or b"\0" in source:
            raise TypeError("module_load takes MSL source text (bytes without NUL)")
        try:
            text = bytes(source).decode()
        except UnicodeDecodeError as exc:
            raise ValueError(f"mps: MSL source must be UTF-8 text (Metal takes an NSString): {exc}") from None
        with self._lock, rt.pool():
            self._runtime()     # (as StreamsMixin.stream_create: the device is messaged below)
            options = self._new(rt.cls("MTLCompileOptions"), M_NEW_OPTIONS, "[MTLCompileOptions new]")
            try:
                # IEEE float semantics: the RNG transforms must match the host bit for bit.
                rt.send(options, M_SET_FAST_MATH, 0)
                err = rt.ffi.new("void **")
                lib = rt.send(self._device, M_NEW_LIBRARY, rt.ns_string(text),
                              options, err)
            finally:
                rt.release(options)
            if lib == rt.nil:
                code, text = rt.error_text(err[0])
                exc = CompileError.from_call(_LIBRARY, M_NEW_LIBRARY.selector, code,
                                             "MTLLibraryErrorCompileFailure", text)
                exc.log = text
                raise exc
            h = self._handle()
            self._modules[h] = (lib, [])
        return h

    @deferred
    def module_unload(self, module: int) -> None:
        rt = self._runtime()
        with self._lock:
            entry = self._modules.pop(module, None)
            if entry is None:
                raise self._missing("module", module, "use a handle from module_load that was not unloaded")
            lib, functions = entry
            for fn in functions:
                pipeline, function, _, _ = self._functions.pop(fn)
                rt.release(pipeline)
                rt.release(function)
            rt.release(lib)

    @deferred
    def module_function(self, module: int, name: str) -> int:
        rt = self._runtime()
        if not isinstance(name, str):
            raise TypeError(f"mps: the kernel name must be a str, got {type(name).__name__} {name!r}")
        if "\0" in name:
            # (stringWithUTF8String: stops at the NUL: "k\0junk" found kernel "k", r70i)
            raise ValueError(f"mps: the kernel name must not contain a NUL character, got {name!r}")
        with self._lock, rt.pool():
            entry = self._modules.get(module)
            if entry is None:
                raise self._missing("module", module, "use a handle from module_load that was not unloaded")
            lib, functions = entry
            function = rt.send(lib, M_NEW_FUNCTION, rt.ns_string(name))
            if function == rt.nil:
                raise _InvalidHandle(f"mps: the Metal library has no kernel named {name!r}")
            err = rt.ffi.new("void **")
            pipeline = rt.send(self._device, M_NEW_PIPELINE, function, err)
            if pipeline == rt.nil:
                code, text = rt.error_text(err[0])
                rt.release(function)
                raise AcceleratorError.from_call(_LIBRARY, M_NEW_PIPELINE.selector, code,
                                                 "MTLComputePipelineError", text)
            h = self._handle()
            self._functions[h] = (pipeline, function, module,
                                  int(rt.send(pipeline, M_MAX_THREADS)))
            functions.append(h)
        return h

    @deferred
    def launch(self, function: int, grid: Tuple[int, int, int], block: Tuple[int, int, int],
               args: KernelArgs, shared_mem: int, stream: int) -> None:
        rt = self._runtime()
        grid, block = tuple(grid), tuple(block)
        if (len(grid) != 3 or len(block) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in grid + block)):
            raise TypeError(f"mps: grid and block must be 3 ints each, got {grid!r}, {block!r}")
        if min(grid + block) < 1:
            raise ValueError(f"grid and block must be 3 positive ints, got {grid}, {block}")
        if max(grid) > _MAX_GRID:
            # Apple, "Metal Shading Language Specification" (kernel function input attributes):
            # threadgroup_position_in_grid is a uint/uint2/uint3, 32 bits per dimension, so a larger
            # grid cannot be addressed by the kernel (the API docs give no larger limit).
            raise ValueError(f"mps: grid {grid} has a dimension above {_MAX_GRID} threadgroups, the most a "
                             f"32-bit threadgroup_position_in_grid addresses; split the launch")
        if not isinstance(shared_mem, int) or isinstance(shared_mem, bool):
            raise TypeError(f"mps: shared_mem must be an int number of bytes, got {type(shared_mem).__name__}")
        if not 0 <= shared_mem <= _MAX_THREADGROUP_MEMORY:
            # Apple, "Metal Feature Set Tables": 32 KB of threadgroup memory per threadgroup
            # (MTLDevice.maxThreadgroupMemoryLength) on every Apple GPU family.
            raise ValueError(f"mps: shared_mem {shared_mem} is outside [0, {_MAX_THREADGROUP_MEMORY}] bytes "
                             f"(Metal's maxThreadgroupMemoryLength)")
        if len(args) > _MAX_BUFFER_INDEX:
            raise ValueError(f"Metal binds at most {_MAX_BUFFER_INDEX} kernel arguments, got {len(args)}")
        ffi = rt.ffi
        with self._lock, rt.pool():
            entry = self._functions.get(function)
            if entry is None:
                raise self._missing("kernel", function, "use a handle from module_function")
            pipeline, _, _, max_threads = entry
            threads = block[0] * block[1] * block[2]
            if threads > max_threads:
                raise ValueError(f"block {block} has {threads} threads; this Metal pipeline allows "
                                 f"{max_threads} per threadgroup")
            static = int(rt.send(pipeline, M_STATIC_THREADGROUP_MEMORY))
            if static + shared_mem > _MAX_THREADGROUP_MEMORY:
                # Apple, setThreadgroupMemoryLength(_:index:): "The sum of all threadgroup memory
                # allocations (whether made using this method or directly in the shader) can't exceed
                # the device limits for threadgroup memory" (the kernel's own threadgroup variables:
                # the pipeline's staticThreadgroupMemoryLength).
                raise ValueError(f"mps: shared_mem {shared_mem} and the kernel's {static} bytes of threadgroup "
                                 f"variables pass Metal's maxThreadgroupMemoryLength of {_MAX_THREADGROUP_MEMORY} "
                                 f"bytes; at most {max(0, _MAX_THREADGROUP_MEMORY - static)} bytes fit")
            st = self._stream(stream)
            bindings = []
            for i, (kind, value) in enumerate(args):
                if kind == "ptr":
                    if value == 0:
                        bindings.append((M_SET_BUFFER, rt.nil, 0, i))
                        continue
                    r = self._resolve(value, 0)
                    if r is None:
                        raise self._missing("pointer", value,
                                   f"kernel argument {i} must point into mem_alloc/host_alloc memory")
                    bindings.append((M_SET_BUFFER, r[0].obj, r[1], i))
                elif kind in _SCALAR_CTYPES:
                    ctype = _SCALAR_CTYPES[kind]
                    try:
                        cell = ffi.new(ctype + " *", value)
                    except (TypeError, OverflowError) as exc:
                        kind_of = TypeError if isinstance(exc, TypeError) else ValueError
                        raise kind_of(f"kernel argument {i}: {value!r} is not a {kind} ({ctype}): "
                                      f"{exc}") from None
                    bindings.append((M_SET_BYTES, cell, ffi.sizeof(ctype), i))
                elif kind == "f64":
                    raise ValueError(f"kernel argument {i}: Metal has no 64-bit float; pass f32")
                else:
                    raise ValueError(f"kernel argument {i}: unknown type {kind!r}")
            sizes = ffi.new("MTLSize *", grid)[0], ffi.new("MTLSize *", block)[0]
            with self._encoding(self._open_cb(st), M_COMPUTE_ENCODER) as enc:
                rt.send(enc, M_SET_PIPELINE, pipeline)
                for msg, a, b, i in bindings:
                    rt.send(enc, msg, a, b, i)
                if shared_mem:
                    rt.send(enc, M_SET_THREADGROUP_MEMORY, (shared_mem + 15) // 16 * 16, 0)
                rt.send(enc, M_DISPATCH, *sizes)
            self._encoded(st)

    def function_attributes(self, function: int) -> dict:
        """The kernel's ``max_threads_per_block``: its pipeline's maxTotalThreadsPerThreadgroup
        (read at module_function; the kernel's [[max_total_threads_per_threadgroup]] lowers it),
        and ``shared_size_bytes``: its staticThreadgroupMemoryLength (its threadgroup variables,
        which count against the 32 KiB with the launch's shared_mem).  Metal reports no registers
        per thread, and no occupancy: the keys are absent."""
        rt = self._runtime()
        with self._lock:
            entry = self._functions.get(function)
            if entry is None:
                raise self._missing("kernel", function, "use a handle from module_function")
            return {"max_threads_per_block": entry[3],
                    "shared_size_bytes": int(rt.send(entry[0], M_STATIC_THREADGROUP_MEMORY))}

    def launch_limits(self, index: int) -> dict:
        # Apple, "Metal Feature Set Tables" (Apple GPU families): 1024 threads per threadgroup
        # (maxThreadsPerThreadgroup is 1024 in each dimension) and 32 KB of threadgroup memory,
        # with no opt-in beyond it; a grid position (threadgroup_position_in_grid) is a 32-bit uint.
        return {"max_grid": (2 ** 32 - 1,) * 3, "max_block": (1024, 1024, 1024),
                "max_threads_per_block": 1024, "max_shared_per_block": 32 * 1024,
                "max_shared_per_block_optin": 32 * 1024}
