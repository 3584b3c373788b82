"""accel.Module (a loaded kernel image) and accel.Kernel (one of its kernels)."""

from __future__ import annotations

import os
import struct as _struct
import operator
import sys
import threading
import weakref
from typing import Dict, Optional, Tuple

from .. import _cuda_containers, _finalize as _fin, _lazy, _ptx
from .. import _copying
from .._copying import refuse_copies as _refuse_copies
from .._device import DeviceLike
from .._errors import AcceleratorError, KernelImageError
from ..backends._signals import deferred as _signals_deferred

_FATBIN_MAGIC = b"\x50\xed\x55\xba"
_CUDA_KINDS = frozenset(("ptx", "cubin", "fatbin"))     # what _image_kind calls CUDA's images


def _read_image(image) -> Tuple[bytes, Optional[str]]:
    """(bytes, path or None) of a Module argument: bytes-like, a path, or source text."""
    if isinstance(image, os.PathLike) or (isinstance(image, str) and "\n" not in image and "\0" not in image
                                          and len(image) < 4096):
        path = os.fspath(image)
        try:
            with open(path, "rb") as f:
                return f.read(), path
        except OSError as exc:
            raise ValueError(f"Module(image): cannot read {path!r} ({exc.strerror}); pass the image as "
                             f"bytes, a path to a file, or source text (str with newlines)") from None
    if isinstance(image, str):
        return image.encode(), None
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image), None
    raise TypeError(f"Module(image) takes bytes (PTX, cubin, fatbin, MSL or SPIR-V), a path, or source "
                    f"text, got {type(image).__name__}")


def _check_image_size(data: bytes, kind: str, header: int, sizes) -> None:
    """cuModuleLoadData and cudaLibraryLoadData take no length: the driver sizes a fatbin (header
    size + fat size, at bytes 6-15) or a cubin (its section header table, the end of an ELF64)
    by its header and reads that many bytes.  accel knows the length: an image shorter than its
    header says is refused before the driver reads past it."""
    if len(data) < header:
        raise ValueError(f"Module(image): the {kind} image has {len(data)} bytes, fewer than its {header}-byte "
                         f"header; the image is truncated or not a {kind}")
    need = sum(sizes())
    if need > len(data):
        raise ValueError(f"Module(image): the {kind} image's header says it spans {need} bytes but it has "
                         f"{len(data)}; the image is truncated or corrupt (pass the whole file)")


def _image_kind(data: bytes, language: str) -> str:
    if language == "ptx":
        if data[:4] == _FATBIN_MAGIC:
            _check_image_size(data, "fatbin", 16, lambda: _struct.unpack_from("<HQ", data, 6))
            return "fatbin"
        if data[:4] == b"\x7fELF":
            # ELF64 (cubins are): e_shoff at 0x28, e_shentsize and e_shnum at 0x3A
            _check_image_size(data, "cubin", 64, lambda: (_struct.unpack_from("<Q", data, 0x28)[0]
                                                          + _struct.unpack_from("<H", data, 0x3A)[0]
                                                          * _struct.unpack_from("<H", data, 0x3C)[0],))
            return "cubin"
        if b".entry" not in data:
            raise ValueError("Module(image): CUDA takes PTX text (with a .entry), a cubin or a fatbin; "
                             f"this image is none of them (starts {data[:16]!r})")
        return "ptx"
    if language == "spirv":
        try:
            _ptx.spirv_entries(data)
        except ValueError as exc:
            raise ValueError(f"Module(image): Level Zero takes SPIR-V; {exc}") from None
        return "spirv"
    if language == "msl":
        if b"\0" in data:
            raise ValueError("Module(image): Metal takes MSL source text (no NUL bytes)")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"Module(image): Metal takes MSL source text in UTF-8; byte 0x{data[exc.start]:02x} "
                             f"at offset {exc.start} is not UTF-8") from None
        if not _ptx.msl_entries(data):
            # Metal compiles a library of helper functions alone, but nothing in it can be launched
            # (as PTX without .entry and SPIR-V without OpEntryPoint Kernel, refused at load).
            raise ValueError("Module(image): the MSL source defines no kernel function ('kernel void NAME(...)'); "
                             "accel launches kernel functions only")
        return "msl"
    return language


def _untyped_param_sizes(data: bytes, kind: str, entries) -> Dict[str, Tuple[Optional[int], ...]]:
    """{kernel name: its parameters' sizes} for the PTX entries whose types accel cannot name
    (None in ``entries``), from the PTX of a ``ptx`` or ``fatbin`` image; {} for the rest."""
    if kind not in ("ptx", "fatbin") or None not in entries.values():
        return {}
    if kind == "ptx":
        sizes = _ptx.ptx_param_sizes(data)
    else:
        sizes = {}
        try:
            for k, _sm, body in _cuda_containers.fatbin_entries(data):
                if k == _cuda_containers.KIND_PTX:
                    sizes.update(_ptx.ptx_param_sizes(body))
        except _cuda_containers.ContainerError:
            return {}
    return {name: sizes[name] for name, params in entries.items() if params is None and name in sizes}


def _image_info(data: bytes, kind: str, skipped: Optional[list] = None):
    """``(entries, required)`` of an image, one walk over it: ``entries`` is {kernel name:
    parameter types, or None when the image does not declare them}, ``required`` {kernel name:
    required block shape} from PTX ``.reqntid`` or SPIR-V ``OpExecutionMode LocalSize``.  A
    fatbin's compressed entries accel cannot read go to ``skipped`` as (kind, sm)."""
    if kind == "ptx":
        return _ptx.ptx_entries(data), _ptx.ptx_required_blocks(data)
    if kind == "msl":
        return dict.fromkeys(_ptx.msl_entries(data)), {}
    if kind == "spirv":
        return dict.fromkeys(_ptx.spirv_entries(data)), _ptx.spirv_required_blocks(data)
    entries: Dict[str, Optional[Tuple[str, ...]]] = {}
    required: Dict[str, Tuple[int, int, int]] = {}
    try:
        if kind == "cubin":
            return dict.fromkeys(_cuda_containers.elf_entries(data)), {}
        for k, _sm, body in _cuda_containers.fatbin_entries(data, skipped):
            if k == _cuda_containers.KIND_PTX:
                entries.update(_ptx.ptx_entries(body))
                required.update(_ptx.ptx_required_blocks(body))
            else:
                for name in _cuda_containers.elf_entries(body):
                    entries.setdefault(name, None)
        return entries, required
    except _cuda_containers.ContainerError:
        return {}, {}   # the driver says what is wrong at load


class UnknownKernelError(KeyError):
    """No kernel of that name in the module (a KeyError whose message reads as a sentence)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


def _unload(backend, index: int, handle: int, key: int = 0) -> None:
    """Unload module ``handle``, registered under ``key`` (accel._finalize.own; 0: the registry's
    own call): nothing when another path took it."""
    from ..streams import on_device
    if key and key not in _fin.owned:
        return
    with on_device(backend, index):
        _fin.destroy_owned(key, backend.module_unload, handle)


def _unload_after_calls(backend, index: int, handle: int, key: int, lock) -> None:
    """A finalizer's close() (see Module.close): once the calls holding the module's ``lock``
    ended (a safe point holds none), unload."""
    with lock:
        pass
    _unload(backend, index, handle, key)


@_refuse_copies("share the Module object itself, or load the image again with accel.Module(image)")
class Module:
    """``Module(image, device=None)``: a kernel image loaded on one device.

    ``image`` is bytes, a path (str or ``os.PathLike``), or source text (a str with newlines):

    * CUDA: PTX text, a cubin or a fatbin (``nvcc -ptx/-cubin/-fatbin``, or
      ``accel.compile(...).ptx``), loaded with ``cudaLibraryLoadData`` (runtime 12.8+) or the
      driver's ``cuModuleLoadData``; the driver JITs PTX for the device.
    * Metal: MSL source, compiled by ``newLibraryWithSource:options:error:`` (the compiler's
      log is in the error).
    * Level Zero: SPIR-V, built by ``zeModuleCreate`` (the build log is in the error).

    The module belongs to ``device`` (default: the current device) and its kernels launch only
    on that device's streams.  :meth:`close` unloads it (so does collection of the module and
    of every :class:`Kernel` taken from it).  ``entries`` lists its kernel names.
    """

    def __init__(self, image, device: DeviceLike = None):
        from .._device import checked_index
        data, self.path = _read_image(image)
        backend = _lazy.lazy_init()
        language = backend.kernel_language
        if language is None:
            raise AcceleratorError(f"{backend.name} has no kernel path: accel cannot load kernels there",
                                   library=backend.name)
        index = checked_index(device)
        self.kind = _image_kind(data, language)
        skipped: list = []
        self._entries, self._required_blocks = _image_info(data, self.kind, skipped)
        #: a fatbin whose PTX accel could not read (zstd-compressed: nvcc 13's default)
        self._compressed_ptx = any(k == _cuda_containers.KIND_PTX for k, _sm in skipped)
        # parameter sizes of the PTX entries accel cannot type, which a signature must match
        self._untyped_sizes = _untyped_param_sizes(data, self.kind, self._entries)
        self._backend, self._index, self._lock = backend, index, threading.Lock()
        self._kernels = weakref.WeakValueDictionary()   # (name, params) -> Kernel: no cycle with them
        self._smem_optin = {}       # function handle -> the dynamic shared memory it is opted in to (CUDA)
        self._functions = {}        # kernel name -> its function handle, looked up once (bounded by the image's kernels)
        self._handle = None
        self._own = None
        self._pid = _fin.pid
        self._load(backend, index, data)
        self.language = language

    @_signals_deferred
    def _load(self, backend, index: int, data: bytes) -> None:
        """Load the image and register the unload (for an interrupted ``__del__``,
        accel._finalize, r53) with signals deferred (r55): from the moment the runtime's load
        returns until the registration is stored, a Ctrl-C would leave a module nobody unloads.

        CUDA loads lazily by default (CUDA_MODULE_LOADING=LAZY, CUDA 12.2+): cudaLibraryLoadData
        accepts any bytes and the image's errors come from the first cudaLibraryGetKernel
        (measured on an H100, tests/conformance/cuda_h100_2026-12-05.json, scenario
        library_bad_images), and the driver loads a kernel at cuModuleGetFunction.  So the first
        kernel the image declares is looked up here: an image the device cannot run raises
        KernelImageError from Module(...) in both modes, with the module unloaded again."""
        from ..streams import on_device
        with on_device(backend, index):
            handle = backend.module_load(data)
            if self.kind in _CUDA_KINDS and self._entries:
                name = next(iter(self._entries))
                try:
                    backend.module_function(handle, name)
                except BaseException as exc:
                    # the lookup's error is the one raised: an unload that fails too is tried once
                    # more at the next safe point, as a finalizer's (r67d: its error replaced the
                    # lookup's, and the module leaked)
                    _fin.finalize(_unload, backend, index, handle)     # (on its device, also when retried)
                    if isinstance(exc, AcceleratorError):
                        exc.add_note(f"Module(image): looking up kernel {name!r} of the {self.kind} image failed "
                                     f"(CUDA reports an image's errors there when it loads lazily, the "
                                     f"default); the module was unloaded")
                    raise
            self._handle = handle
            self._own = _fin.own(_unload, backend, index, handle)

    @property
    def device(self):
        """The device the module is loaded on."""
        from .._device import device
        return device(self._backend.name, self._index)

    @property
    def device_index(self) -> int:
        """The index of the device the module is loaded on."""
        return self._index

    @property
    def entries(self) -> Tuple[str, ...]:
        """The kernel names the image defines (as read from it)."""
        return tuple(self._entries)

    @property
    def closed(self) -> bool:
        """Whether the module was unloaded (:meth:`close`); its kernels then refuse to launch."""
        return self._handle is None

    _closed = closed    # what accel.Graph.replay checks of the objects a capture keeps

    def _live(self) -> int:
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        h = self._handle
        if h is None:
            raise ValueError(f"{self!r} is closed; load the image again")
        return h

    def function(self, name: str, signature=None) -> "Kernel":
        """The :class:`Kernel` called ``name``.  Its parameter list comes from the PTX ``.entry``
        declaration when the image has PTX (see :mod:`accel._ptx` for the type mapping), else
        from ``signature`` (``"ptr, u64, f32"`` or a sequence of those names: ``ptr``, ``u32``,
        ``i32``, ``u64``, ``i64``, ``f32``, ``f64``).  A signature given with PTX must agree
        with it (it may say ``ptr`` where PTX says ``.u64``).  Unknown names raise KeyError
        listing the module's kernels."""
        if not isinstance(name, str):
            raise TypeError(f"Module.function(name): name must be a str, got {type(name).__name__}")
        self._live()
        if self._entries and name not in self._entries:
            raise UnknownKernelError(f"the module has no kernel named {name!r}; its kernels: "
                           f"{', '.join(self._entries) or 'none'} (a C++ kernel's name is mangled unless "
                           f"it is declared extern \"C\")")
        declared = self._entries.get(name)
        params = _resolve_params(name, declared, signature, self.kind, self._entries,
                                 self._untyped_sizes.get(name), self._compressed_ptx)
        if self.kind == "msl" and "f64" in params:
            # Metal Shading Language Specification, 2.1: no double, so no kernel parameter of it.
            raise ValueError(f"Module.function({name!r}): parameter {params.index('f64')} is f64, and Metal has no "
                             f"64-bit float (MSL has no double); declare it float and pass f32")
        key = (name, params)
        with self._lock:
            k = self._kernels.get(key)
            if k is not None:
                return k
        from ..streams import on_device
        # Under the lock, as a launch: a close() in another thread cannot unload the module
        # between the check and the lookup (a lookup in an unloaded library is undefined).
        with on_device(self._backend, self._index), self._lock:
            try:
                if self._handle is None:
                    self._live()        # raises: closed (in another thread since the check above)
                fn = self._function_of(name)
            except AcceleratorError as exc:
                if self._entries or isinstance(exc, KernelImageError):
                    raise       # a kernel the image defines, or an image the device cannot run
                raise UnknownKernelError(f"the module has no kernel named {name!r} ({exc})") from None
        k = Kernel(self, name, fn, params)
        with self._lock:
            return self._kernels.setdefault(key, k)

    def _function_of(self, name: str) -> int:
        """The function of kernel ``name`` (the lock held, the module loaded, its device
        current): one handle per name for the module's life (Level Zero's zeKernelCreate and
        Metal's pipeline compile make a new object per lookup, which the backends keep until the
        module unloads, so a lookup per Kernel made would grow with the calls), looked up again
        once a failed unload destroyed it (_forget_destroyed)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._backend.module_function(self._handle, name)
        return fn

    def close(self) -> None:
        """Unload the module now; its kernels cannot be launched afterwards, nor can an
        :class:`accel.Graph` that captured launches of them be replayed (a graph keeps the
        module it launches loaded until it goes, but not against close()).  Work already
        queued is not waited for by accel (the runtime keeps what it needs).  While a stream
        capture is underway the CUDA backend unloads it when the last capture ends (drivers
        refuse an unload during a capture, and invalidate the capture)."""
        if self._pid != _fin.pid:
            self._handle = None
            return
        if _fin.collecting():
            # A finalizer (a user's __del__) in a collection: it must not wait for the lock, which
            # this very thread may hold below it (a launch, a lookup or a query of this module).
            # Closed now (one store: every call checks the handle under the lock), the unload
            # waits for the next safe point and takes the lock first, so that no call in flight
            # still passes the runtime the library or one of its kernels.
            h, self._handle = self._handle, None
            if h is not None:
                _fin.pending.append((_fin.finalize, (_unload_after_calls, self._backend, self._index, h,
                                                     _fin.key_of(self._own), self._lock)))
            return
        with self._lock:
            h, self._handle = self._handle, None
        if h is not None:
            own = self._own
            try:
                _fin.release(_unload, self._backend, self._index, h, _fin.key_of(own))
            except BaseException:
                if _fin.registered(own):
                    # the unload never reached the runtime, or failed there: still loaded, as
                    # before; close() may be tried again (after an interrupt as it returned, the
                    # handle may be another module's already: closed it stays)
                    with self._lock:
                        self._handle = h
                        self._forget_destroyed(h)
                raise

    def _forget_destroyed(self, handle: int) -> None:
        """After a failed unload (under the lock): the backend may have destroyed some of the
        module's functions before the unload failed (Level Zero: zeKernelDestroy, then
        zeModuleDestroy), and the driver may give their handle values to new kernels.  Those
        leave ``_functions``; every Kernel (a copy too) reads its function from there at each
        use (:meth:`Kernel._function`), so the next use looks a destroyed one up again, and a
        function still live is kept (r67a: a new one per Kernel per failed unload grew the
        driver's kernels; a Kernel whose new lookup failed kept a destroyed handle and launched
        whichever kernel the driver gave that value to next)."""
        live = self._backend.function_live
        old = dict(self._functions)
        self._functions.clear()
        self._smem_optin.clear()
        for name, fn in old.items():
            if live(handle, fn):
                self._functions[name] = fn

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            h = getattr(self, "_handle", None)
            if h is None or getattr(self, "_pid", None) != _fin.pid:
                return
            # (a Ctrl-C as this __del__ starts leaves the unload to the registry: accel._finalize)
            self._handle = None
            own = self._own
            _fin.finalize(_unload, self._backend, self._index, h, _fin.key_of(own))
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)

    def __enter__(self) -> "Module":
        self._live()        # (as a closed Stream refuses: r67i)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self):
        state = " closed" if self._handle is None else ""
        return (f"<accel.Module {self.kind} on {self._backend.name}:{self._index} "
                f"entries={list(self._entries)}{state}>")


def _resolve_params(name, declared, signature, kind, entries, sizes=None,
                    compressed_ptx: bool = False) -> Tuple[str, ...]:
    """The kernel's parameter types: ``declared`` (from PTX) or the ``signature`` given, which
    must agree with them, or where PTX declares a type accel cannot name (a struct by value),
    with each parameter's size in bytes (``sizes``): the driver copies as many bytes as the
    kernel declares from each argument (cudaLaunchKernel's kernelParams), so a smaller argument
    would be read past its end."""
    if signature is not None:
        given = _ptx.parse_signature(signature, f"Module.function({name!r}, signature=...)")
        if declared is not None:
            if len(given) != len(declared) or not all(_ptx.compatible(a, b) for a, b in zip(given, declared)):
                raise ValueError(f"Module.function({name!r}): signature {', '.join(given) or '(none)'} does not "
                                 f"match the PTX .entry parameters {', '.join(declared) or '(none)'}")
        elif sizes is not None:
            if len(given) != len(sizes):
                raise ValueError(f"Module.function({name!r}): signature {', '.join(given) or '(none)'} has "
                                 f"{len(given)} parameter(s), but the PTX .entry declares {len(sizes)}")
            for i, (g, n) in enumerate(zip(given, sizes)):
                if n != _ptx.ARG_SIZES[g]:
                    what = "an unsized array" if n is None else f"{n} bytes"
                    raise ValueError(f"Module.function({name!r}): parameter {i} is {what} in the PTX .entry, but "
                                     f"the signature gives {g} ({_ptx.ARG_SIZES[g]} bytes); accel passes each "
                                     f"argument as one scalar or pointer, so declare the kernel's parameters "
                                     f"that way (a struct by value cannot be passed)")
        return given
    if declared is not None:
        return declared
    if kind == "ptx" and name in entries:
        why = "a parameter type accel cannot pass (see accel._ptx)"
    elif compressed_ptx:
        why = ("the fatbin's PTX is zstd-compressed (nvcc 13's default), which accel cannot read without a "
               "zstd module, and its SASS does not declare parameter types (build with -Xfatbin "
               "-compress-mode=none to keep the PTX readable)")
    else:
        why = f"a {kind} image does not declare its parameter types"
    raise ValueError(f"Module.function({name!r}): {why}; pass signature='ptr, u64, f32' (the kernel's "
                     f"parameter types in order: ptr, u32, i32, u64, i64, f32, f64)")


class Kernel:
    """One kernel of a :class:`Module` (from :meth:`Module.function`); launch it with
    :func:`accel.launch`.  ``params`` is its parameter list (accel argument types).

    Occupancy (CUDA): :attr:`max_threads_per_block`, :attr:`num_regs`,
    :attr:`shared_size_bytes` and :meth:`max_potential_block_size`, read on the module's device;
    Metal reports :attr:`max_threads_per_block` and :attr:`shared_size_bytes` (the kernel's
    threadgroup variables) only (the others raise NotImplementedError).
    """

    __slots__ = ("module", "name", "handle", "params", "_backend", "_index", "_packers", "_bounds", "_required",
                 "_sim_ref", "__weakref__")

    def __init__(self, module: Module, name: str, handle: int, params: Tuple[str, ...]):
        self.module, self.name, self.handle, self.params = module, name, handle, params
        self._backend, self._index = module._backend, module._index
        self._packers = None        # built on the first launch (accel.kernels._launch)
        self._bounds = None         # (most threads per block, static shared bytes), read at the first launch
        self._required = module._required_blocks.get(name)     # the block shape PTX .reqntid requires
        self._sim_ref = None        # the simulator's reference a launch last found matching

    @property
    def device(self):
        """The device of the kernel's module."""
        return self.module.device

    # -- copies (accel/_copying.py): a copy shares the module; a deep copy or a pickle would
    # have to copy the loaded module, which refuses (r62b: the refusal named the Module)
    def __copy__(self) -> "Kernel":
        new = Kernel.__new__(type(self))
        for name in Kernel.__slots__[:-1]:         # not __weakref__
            setattr(new, name, getattr(self, name))
        return new

    def __deepcopy__(self, memo):
        raise _copying.refuse(self, "deepcopy", "share the Kernel (copy.copy gives one of the same module), or "
                                                "load the image again with accel.Module(image) and call "
                                                ".function(name) on it")

    def __reduce_ex__(self, protocol):
        raise _copying.refuse(self, "pickle", "send the module's image and the kernel's name, and load them "
                                              "with accel.Module(image).function(name) on the other side")

    @property
    def device_index(self) -> int:
        """The index of :attr:`device`."""
        return self._index

    def _function(self) -> int:
        """This kernel's function now (the module's lock held, the module loaded): the module's
        ``_functions`` entry, looked up again when a failed unload destroyed it (see
        Module._forget_destroyed); ``handle`` follows it."""
        from ..streams import on_device
        with on_device(self._backend, self._index):
            fn = self.module._function_of(self.name)
        if fn != self.handle:
            self.handle = fn
        return fn

    def _attributes(self) -> dict:
        from ..streams import on_device
        module = self.module
        module._live()      # a forked child's or a closed module's refusal, before on_device's runtime calls
        with on_device(self._backend, self._index), module._lock:    # not unloaded meanwhile (see launch)
            module._live()
            return self._backend.function_attributes(self._function())

    def _attribute(self, key: str, what: str):
        value = self._attributes().get(key)
        if value is None:
            raise NotImplementedError(f"{self._backend.name} does not report a kernel's {what}")
        return value

    @property
    def max_threads_per_block(self) -> int:
        """The most threads a block of this kernel may have on its device (cudaFuncGetAttributes;
        Metal: the pipeline's maxTotalThreadsPerThreadgroup)."""
        return self._attribute("max_threads_per_block", "thread limit")

    @property
    def num_regs(self) -> int:
        """Registers each thread uses (CUDA; NotImplementedError where the backend does not say)."""
        return self._attribute("num_regs", "registers per thread")

    @property
    def shared_size_bytes(self) -> int:
        """Static shared memory per block, in bytes (CUDA; NotImplementedError where the backend
        does not say)."""
        return self._attribute("shared_size_bytes", "static shared memory")

    def max_potential_block_size(self, dynamic_smem: int = 0, block_size_limit: int = 0) -> Tuple[int, int]:
        """(min_grid_size, block_size) reaching the best occupancy, as the CUDA header template
        ``cudaOccupancyMaxPotentialBlockSize`` computes it (cuda_runtime.h; it is not an
        exported function): every block size from the limit down in steps of the warp size,
        through cudaOccupancyMaxActiveBlocksPerMultiprocessor, keeping the first that runs the
        most threads per multiprocessor; min_grid_size fills every multiprocessor.  Above 48 KiB of
        ``dynamic_smem`` the function is opted in first, as accel.launch does for that size."""
        checked = []
        for what, v in (("dynamic_smem", dynamic_smem), ("block_size_limit", block_size_limit)):
            if isinstance(v, bool) or not hasattr(type(v), "__index__"):    # (numpy integers too)
                raise TypeError(f"max_potential_block_size: {what} must be an int >= 0, got "
                                f"{type(v).__name__} {v!r}")
            if v < 0:
                raise ValueError(f"max_potential_block_size: {what} must be an int >= 0, got {v!r}")
            checked.append(operator.index(v))
        dynamic_smem, block_size_limit = checked
        from ..streams import on_device
        module = self.module
        module._live()
        props = self._backend.properties(self._index)
        limits = self._backend.launch_limits(self._index)
        with on_device(self._backend, self._index), module._lock:    # not unloaded meanwhile (see launch)
            module._live()
            fn = self._function()
            attrs = self._backend.function_attributes(fn)
            func_max, static = attrs["max_threads_per_block"], attrs.get("shared_size_bytes", 0)
            most = limits["max_shared_per_block_optin"]
            if static + dynamic_smem > most:
                raise ValueError(f"max_potential_block_size: dynamic_smem={dynamic_smem} bytes and the kernel's "
                                 f"{static} bytes of static shared memory pass the device's limit of {most} bytes "
                                 f"per block; at most {most - static} bytes of dynamic shared memory fit")
            from ._launch import _opt_in_shared
            _opt_in_shared(self._backend, self, dynamic_smem, static, limits)     # as a launch would
            limit = block_size_limit or limits["max_threads_per_block"]
            limit = min(limit, limits["max_threads_per_block"], func_max)
            warp, per_sm = props.warp_size or 32, props.max_threads_per_multi_processor
            best = (0, 0, 0)    # (threads, block size, blocks)
            aligned = -(-limit // warp) * warp
            for tried in range(aligned, 0, -warp):
                size = min(tried, limit)
                blocks = self._backend.occupancy_max_active_blocks(fn, size, dynamic_smem)
                if size * blocks > best[0]:
                    best = (size * blocks, size, blocks)
                if best[0] == per_sm:
                    break
        return best[2] * props.multi_processor_count, best[1]

    def __repr__(self):
        return f"<accel.Kernel {self.name}({', '.join(self.params)}) on {self._backend.name}:{self._index}>"
