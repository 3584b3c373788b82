"""``Generator``: the Philox state of one device, as torch's ``CUDAGeneratorImpl``.

State is ``(seed, offset)``: a 64-bit seed and an offset counted in 32-bit
Philox words (always a multiple of 4).  A fill reserves its words with
:meth:`Generator.philox_args`, which returns the current offset and advances it
by the words rounded up to a multiple of 4, so every fill draws fresh numbers.

The serialized state (:meth:`get_state`) is 16 bytes: seed (uint64) then offset
(int64), little-endian, the layout of torch's CUDA generator state.

Graph-safe mode (``CUDAGeneratorImpl`` register_graph / capture_prologue /
capture_epilogue / replay_prologue): while a graph is captured, fills do not
bake the seed and offset into the captured kernels.  They pass pointers to a
16-byte device buffer holding ``seed`` (at +0) and ``offset`` (at +8), and an
*intragraph* offset that starts at 0 for the capture; the kernel uses
``*seed_ptr`` and ``*offset_ptr + intragraph``.  Each replay first writes the
generator's current seed and offset into that buffer (:meth:`replay_prologue`)
and advances the offset by the whole graph's increment, so replays draw fresh
numbers and the offsets advance exactly as if the work had run eagerly.

The state lives in a :class:`_State` the generator points to (torch's
``CUDAGeneratorState``): :meth:`Generator.graphsafe_get_state` returns a generator
sharing it, :meth:`Generator.graphsafe_set_state` points a generator at another's,
:meth:`Generator.clone_state` copies seed and offset into a new state with no
holders, and ``Graph.register_generator_state`` registers a state with a graph
(its token in :mod:`accel.random` holds the graph's states; a capture registers
the default generator's current state too).  Each (state, graph) pair has holders
of its own, as torch 2.13's ``CUDAGeneratorCaptureState`` per capture: two graphs
drawing from one state and replayed at the same time on two streams each read the
offset their own replay wrote.  A graph unregistered (reset or collected) frees its
pair's holders.

No method needs the runtime except :meth:`register_graph` (allocates the
buffer) and :meth:`replay_prologue` (writes it).  Generators are plain Python
objects: seeding or querying them never initializes a device.
"""

from __future__ import annotations

import operator
import secrets
import struct
import threading
from typing import Callable, NamedTuple, Optional

from .. import _finalize as _fin
from .. import _locks

__all__ = ["Generator", "PhiloxArgs", "DEFAULT_SEED", "check_seed"]

#: torch's default_rng_seed_val: what initial_seed() reports before any seeding.
DEFAULT_SEED = 67280421310721
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class PhiloxArgs(NamedTuple):
    """What a fill passes its kernel (torch's ``PhiloxCudaState``).

    Eager: ``seed``/``offset`` are the values, the pointers 0.  Under capture:
    ``seed_ptr``/``offset_ptr`` are device addresses the kernel reads, and
    ``offset`` is the intragraph offset added to ``*offset_ptr``.
    """

    seed: int
    offset: int
    seed_ptr: int = 0
    offset_ptr: int = 0

    @property
    def captured(self) -> bool:
        """Whether these arguments were taken during a graph capture: a kernel reads the seed
        and offset from device memory (``seed_ptr``, ``offset_ptr``) that each replay writes."""
        return self.seed_ptr != 0


class _NotALong(TypeError, RuntimeError):
    """A seed or offset that is not an integer.  torch.Generator's manual_seed and set_offset
    raise RuntimeError ("manual_seed expected a long, but got float": torch/csrc/Generator.cpp);
    accel raised TypeError: this class is both."""


def check_seed(seed) -> int:
    """A seed as torch takes it: an integer in [-2**63, 2**64), negative values mod 2**64."""
    if isinstance(seed, bool):
        raise _NotALong("manual_seed expected a long, but got bool: seed must be an integer")
    try:
        value = operator.index(seed)
    except TypeError:
        raise _NotALong(f"manual_seed expected a long, but got {type(seed).__name__}: seed must be an integer "
                        f"in [-2**63, 2**64), got {seed!r}") from None
    if not -(1 << 63) <= value < _U64:
        raise ValueError(f"seed {value} does not fit in 64 bits: expected an integer in "
                         f"[-2**63, 2**64) (negative seeds are taken modulo 2**64)")
    return value % _U64


def _check_device_index(device_index) -> int:
    """A generator's device index: an ``__index__`` integer (not bool), or, as torch.Generator's
    ``device``, a string or device of the current accelerator (``"cuda:1"``; without an index
    the current device); and, where the selected backend has devices, one of them (torch's
    createCUDAGenerator: "The device_index is invalid.").  Without a device any index >= 0 is
    taken: generators are then plain host objects."""
    from .. import backends
    from .._device import check_range, device, device_index as index_of, is_torch_device
    from .._errors import InvalidDeviceError
    if isinstance(device_index, (str, device)) or is_torch_device(device_index):
        device_index = index_of(device_index, optional=True)    # a type that is not the accelerator's: an error
    if isinstance(device_index, bool) or not hasattr(type(device_index), "__index__"):
        raise TypeError(f"device_index must be an int, a device string such as 'cuda:0' or an accel.device, "
                        f"got {type(device_index).__name__} {device_index!r}")
    index = operator.index(device_index)     # numpy integers too
    chosen = backends.select()              # counts devices; initializes nothing
    if chosen is not None and chosen.count() > 0:
        check_range(index, chosen, "Generator: ")
    elif index < 0:
        raise InvalidDeviceError(f"Generator: device index {index} is invalid: it must be >= 0")
    return index


def _rebuild_generator(device_index: int, seed: int, offset: int) -> "Generator":
    gen = Generator(device_index, seed)
    gen.set_offset(offset)
    return gen


def _state_bytes(new_state) -> bytes:
    """The bytes of a state array, or TypeError naming what is accepted."""
    if isinstance(new_state, (bytes, bytearray)):
        return bytes(new_state)
    import numpy as np
    if isinstance(new_state, memoryview):
        new_state = np.asarray(new_state)
    if not isinstance(new_state, np.ndarray):
        if not hasattr(new_state, "__array__") and not hasattr(new_state, "__array_interface__"):
            raise TypeError(f"RNG state must be a 1-D uint8 array (as returned by get_rng_state()), "
                            f"got {type(new_state).__name__}")
        new_state = np.asarray(new_state)
    if new_state.dtype != np.uint8:
        raise TypeError(f"RNG state must be a 1-D uint8 array (as returned by get_rng_state()), "
                        f"got dtype {new_state.dtype}")
    if new_state.ndim != 1:
        raise TypeError(f"RNG state must be a 1-D uint8 array (as returned by get_rng_state()), "
                        f"got {new_state.ndim}-D with shape {new_state.shape}")
    return new_state.tobytes()


class _State:
    """One Philox state (torch's ``CUDAGeneratorState``): seed, offset and the graph-safe fields
    (capturing flag, intragraph offset, and the device holders of each graph registered with
    it, which its captured kernels read).  Generators point to one; several may share it
    (:meth:`Generator.graphsafe_get_state`, :meth:`Generator.graphsafe_set_state`).  It holds
    no reference to a graph: a graph's token holds its states, so a state lives as long as a
    generator or a graph uses it."""

    __slots__ = ("device_index", "_lock", "_seed", "_offset", "_capturing", "_intragraph",
                 "_graph_ptrs", "_holders", "__weakref__")

    def _fresh(self) -> None:
        # A thread of the parent may have held the lock as another forked (a default generator
        # being made, a graph replay's prologue writing the offset): only this thread exists in
        # the child, where seeding or reading the state then waited for good (r68i).
        self._lock = threading.RLock()

    def __init__(self, device_index: int, seed: int, offset: int = 0):
        self.device_index = device_index
        self._lock = threading.RLock()
        _locks.renew_in_child(self)
        self._seed = seed
        self._offset = offset
        # graph-safe state
        self._capturing = False
        self._intragraph = 0
        self._graph_ptrs = (0, 0)          # (seed_ptr, offset_ptr) the captured kernels read
        # registered graph -> (seed_ptr, offset_ptr, free): holders of its own for each graph, as
        # torch 2.13's CUDAGeneratorCaptureState per (generator, capture).  Shared holders let
        # two graphs replayed at once on two streams race: one's kernels read the offset the
        # other's replay wrote (r64f, torch's test_graph_rng_concurrent_replay_on_different_streams).
        self._holders: dict = {}

    def __repr__(self):
        return (f"<accel.random generator state device={self.device_index} seed={self._seed} "
                f"offset={self._offset}>")

    @property
    def capturing(self) -> bool:
        return self._capturing

    @property
    def _graphs(self) -> int:
        """How many graphs are registered (each holds its own holders)."""
        return len(self._holders)

    def _not_capturing(self, what: str) -> None:
        if self._capturing:
            raise RuntimeError(f"Cannot call {what} on the generator of device {self.device_index} "
                               f"while a graph is being captured")

    # -- drawing -------------------------------------------------------------------
    def philox_args(self, increment: int, graph: Optional[bool] = None) -> PhiloxArgs:
        """See :meth:`Generator.philox_args`."""
        if increment.__class__ is not int:      # (numpy integers too; a bool or float: TypeError)
            from .._device import _as_index
            increment = _as_index(increment, "increment (a number of 32-bit words)")
        if increment < 0:
            raise ValueError(f"increment must be >= 0, got {increment}")
        step = (increment + 3) // 4 * 4
        with self._lock:
            if graph is None:
                graph = self._capturing
            if graph:
                if not self._capturing:
                    # (torch: "Attempt to increase offset for a CUDA generator not in capture mode.")
                    raise RuntimeError(
                        f"{self!r} is not in graph-safe mode (no graph being captured has it registered), "
                        "so a captured fill would replay the same numbers every time: register it with the "
                        "graph before capture_begin (graph.register_generator_state(generator)), or draw "
                        "from the device's default generator while capturing")
                offset = self._intragraph
                self._intragraph += step
                return PhiloxArgs(0, offset, *self._graph_ptrs)
            offset = self._offset
            if offset + step > _I64_MAX:
                raise RuntimeError(f"generator offset would pass 2**63 (offset {offset}, +{step}); "
                                   "reseed the generator")
            self._offset = offset + step
            return PhiloxArgs(self._seed, offset)

    # -- graph-safe mode (torch CUDAGeneratorState) ----------------------------------
    def register_graph(self, graph=None, *, alloc: Optional[Callable[[int], int]] = None,
                       free: Optional[Callable[[int], None]] = None) -> None:
        """``graph`` (any hashable key; None is one too) will capture fills from this generator:
        make the one-word seed and offset holders of this (generator, graph) pair on the device
        (torch 2.13's CUDAGeneratorCaptureState seed_extragraph_/offset_extragraph_, two small
        blocks of the caching allocator on the device's current stream, which at capture_begin
        is the stream about to capture).  Each graph has its own, so graphs replayed at the same
        time on different streams do not overwrite each other's offset.  Registering a graph
        twice is a no-op.  Call before capture begins (the allocation is not allowed during
        capture).  ``alloc(nbytes) -> ptr`` and ``free(ptr)`` replace the caching allocator
        (tests)."""
        with self._lock, _fin.no_drain:     # no deferred release runs in here (issue r18)
            if graph in self._holders:
                return
            if alloc is None:
                alloc, free = self._cache_alloc, self._cache_free
            elif not callable(alloc) or (free is not None and not callable(free)):
                raise TypeError(f"register_graph: alloc and free must be callables (nbytes -> pointer, "
                                f"pointer -> None), got alloc={alloc!r}, free={free!r}")
            seed_ptr = alloc(8)
            try:
                offset_ptr = alloc(8)
            except BaseException:
                if free is not None:
                    free(seed_ptr)
                raise
            self._holders[graph] = (seed_ptr, offset_ptr, free)

    def unregister_graph(self, graph=None) -> None:
        """``graph`` is gone: its holders are freed.  While its own capture is underway (the
        captured kernels read them) this does nothing: unregister it again after the capture.
        (accel.graphs never does that: Graph.reset() is refused during its capture.)"""
        with self._lock:
            held = self._holders.get(graph)
            if held is None or (self._capturing and self._graph_ptrs == held[:2]):
                return
            del self._holders[graph]
            seed_ptr, offset_ptr, free = held
            if free is not None:
                try:
                    free(seed_ptr)
                finally:
                    free(offset_ptr)

    def _cache_alloc(self, nbytes: int) -> int:
        from .. import memory
        from ..streams import current_stream
        stream = current_stream(self.device_index).handle
        return memory.device_allocator(self.device_index).malloc(nbytes, stream)

    def _cache_free(self, ptr: int) -> None:
        from .. import memory
        memory.device_allocator(self.device_index).free(ptr)

    def capture_prologue(self, seed_ptr: Optional[int] = None, offset_ptr: Optional[int] = None,
                         graph=None) -> None:
        """Enter graph-safe mode: fills read ``*seed_ptr`` and ``*offset_ptr`` (8-byte device
        words; default: the holders :meth:`register_graph` made for ``graph``) and count an
        intragraph offset from 0."""
        with self._lock:
            if self._capturing:
                raise RuntimeError(f"the generator of device {self.device_index} is already capturing")
            if seed_ptr is None or offset_ptr is None:
                held = self._holders.get(graph)
                if held is None:
                    raise RuntimeError("capture_prologue() without pointers needs register_graph() of the "
                                       "graph first")
                seed_ptr, offset_ptr = held[0], held[1]
            if not seed_ptr or not offset_ptr:
                raise ValueError("seed_ptr and offset_ptr must be non-null device addresses")
            self._graph_ptrs = (int(seed_ptr), int(offset_ptr))
            self._intragraph = 0
            self._capturing = True

    def capture_epilogue(self) -> int:
        """Leave graph-safe mode; return the words the captured work consumes per replay."""
        with self._lock:
            if not self._capturing:
                raise RuntimeError("capture_epilogue() without capture_prologue()")
            self._capturing = False
            return self._intragraph

    def replay_prologue(self, wholegraph_increment: int, stream: int = 0,
                        write: Optional[Callable[[int, int, int, int, int, int], None]] = None,
                        seed_ptr: Optional[int] = None, offset_ptr: Optional[int] = None,
                        graph=None) -> None:
        """Before a replay of ``graph`` on ``stream``: write the current seed and offset to the
        device words the graph reads (its holders; without them, those of the last capture),
        then advance the offset by ``wholegraph_increment``.

        ``write(device_index, seed_ptr, offset_ptr, seed, offset, stream)`` queues
        the write on ``stream``; the default uses the store-state kernel where the
        backend has one, else a copy from pinned memory.
        """
        if seed_ptr is None or offset_ptr is None:
            held = self._holders.get(graph)
            seed_ptr, offset_ptr = held[:2] if held is not None else self._graph_ptrs
        if not seed_ptr:
            raise RuntimeError("replay_prologue() before any capture_prologue()")
        if write is None:
            from . import _device
            write = _device.write_state
        with self._lock, _fin.no_drain:     # pinned staging: no deferred release runs in here
            self._not_capturing("replay_prologue")
            seed, offset = self._seed, self._offset
            step = (int(wholegraph_increment) + 3) // 4 * 4
            if offset + step > _I64_MAX:
                raise RuntimeError(f"generator offset would pass 2**63 (offset {offset}, +{step}); "
                                   "reseed the generator")
            write(self.device_index, seed_ptr, offset_ptr, seed, offset, stream)
            self._offset = offset + step
            self._used_on(seed_ptr, offset_ptr, stream)

    def _used_on(self, seed_ptr: int, offset_ptr: int, stream: int) -> None:
        """The replay's work on ``stream`` writes and reads the holders: the caching allocator
        notes the use (record_stream), so their free (the last registered graph's reset) does not
        hand them to the next allocation on their allocation stream (the capture's) before that
        work ran (r61e: a replay queued on another stream wrote the seed into a buffer allocated
        after the reset).  Holders of a caller's ``alloc`` or pointers it passed: its own affair."""
        if not any(held[2] == self._cache_free and held[:2] == (seed_ptr, offset_ptr)
                   for held in self._holders.values()):
            return
        from .. import memory
        alloc = memory.device_allocator(self.device_index)
        alloc.record_stream(seed_ptr, stream, self.device_index)
        alloc.record_stream(offset_ptr, stream, self.device_index)


class Generator:
    """Philox4x32-10 state ``(seed, offset)`` for one device.

    ``Generator(device_index=0, seed=None)``, or ``Generator(device="cuda:1")`` as
    ``torch.Generator(device=...)`` (an index, a device string or a torch.device either way);
    the default generators of the devices come from :func:`accel.random.default_generator`.
    Thread-safe.

    The state is an object the generator points to (torch's ``CUDAGeneratorState``):
    :meth:`graphsafe_get_state` returns a generator sharing it, :meth:`graphsafe_set_state`
    points this generator at another's, :meth:`clone_state` makes an independent copy, and
    ``Graph.register_generator_state`` registers it with a graph (see
    :mod:`accel.random.generator`).
    """

    def __init__(self, device_index: int = 0, seed: Optional[int] = None, *, device=None):
        if device is not None:
            if device_index is not None and not (type(device_index) is int and device_index == 0):
                raise TypeError(f"Generator() got both device_index={device_index!r} and device={device!r}; "
                                f"give one")
            device_index = device
        self.device_index = _check_device_index(device_index)
        self._state = _State(self.device_index, DEFAULT_SEED if seed is None else check_seed(seed))

    @classmethod
    def _with_state(cls, state: _State) -> "Generator":
        gen = cls.__new__(cls)
        gen.device_index = state.device_index
        gen._state = state
        return gen

    def __repr__(self):
        st = self._state
        return f"<accel.random.Generator device={self.device_index} seed={st._seed} offset={st._offset}>"

    def __reduce__(self):
        """pickle, copy.copy and copy.deepcopy give an independent generator with this one's
        device, seed and offset, as torch.Generator's do: its own lock, outside graph-safe
        mode and with no share of this one's graph holders (a shallow copy shared them, and
        pickling failed with "cannot pickle '_thread.RLock' object")."""
        st = self._state
        with st._lock:
            return (_rebuild_generator, (self.device_index, st._seed, st._offset))

    @property
    def device(self):
        """The generator's device (torch's ``Generator.device``): ``accel.device`` of the
        accelerator's type and this generator's index, e.g. ``device('mps', 0)``.  Never
        initializes the runtime (the type is the runtime accel selects, as
        :func:`accel.current_accelerator`); RuntimeError when no accelerator runtime exists."""
        from .. import current_accelerator
        from .._device import device
        accelerator = current_accelerator()
        if accelerator is None:
            raise RuntimeError(f"Generator.device: no accelerator runtime is available, so device "
                               f"{self.device_index} has no type (the generator is a host object)")
        return device(accelerator.type, self.device_index)

    # the current state's fields (read-only views, for tests and tools)
    @property
    def _lock(self):
        return self._state._lock

    @property
    def _holders(self):
        return self._state._holders

    @property
    def _graphs(self) -> int:
        return self._state._graphs

    # -- graph-safe states (torch.Generator.graphsafe_get_state & co) --------------
    def graphsafe_get_state(self) -> "Generator":
        """A generator pointing to this generator's current state (shared, not copied): draws
        from either advance both, and registering it with a graph registers this state."""
        return Generator._with_state(self._state)

    def graphsafe_set_state(self, state: "Generator") -> "Generator":
        """Make this generator use ``state``'s state object (a generator of the same device,
        typically from :meth:`graphsafe_get_state` or :meth:`clone_state`).  Allowed during a
        capture, as torch's: draws then come from that state, which must be registered with
        the graph being captured.  Returns this generator, as torch's."""
        if not isinstance(state, Generator):
            raise TypeError(f"graphsafe_set_state expects an accel.random.Generator (from graphsafe_get_state() "
                            f"or clone_state()), got {type(state).__name__} {state!r}")
        if state.device_index != self.device_index:
            raise ValueError(f"graphsafe_set_state: the state is of device {state.device_index} but this "
                             f"generator is of device {self.device_index}; use a state of device "
                             f"{self.device_index}")
        self._state = state._state
        return self

    def clone_state(self) -> "Generator":
        """A generator with a new, independent state: this one's seed and offset, outside
        graph-safe mode, registered with no graph (its holders are made when it is registered)."""
        st = self._state
        with st._lock:
            if st._capturing:
                # torch: assertNotCapturing("Cannot call CUDAGeneratorImpl::clone_impl")
                raise RuntimeError(f"Cannot call clone_state on the generator of device {self.device_index} "
                                   f"while a graph is being captured: clone it before capture_begin")
            return Generator._with_state(_State(self.device_index, st._seed, st._offset))

    # -- seeding -------------------------------------------------------------------
    def _not_capturing(self, what: str) -> None:
        self._state._not_capturing(what)

    def manual_seed(self, seed) -> "Generator":
        """Set the seed (an integer in [-2**63, 2**64); negatives mod 2**64) and reset the offset to 0.
        During a capture only the seed in use may be set again (a no-op), as torch's."""
        value = check_seed(seed)
        st = self._state
        with st._lock:
            if st._capturing:
                if value != st._seed:
                    raise RuntimeError(f"{self._impl_name()}::set_current_seed can be called during stream capture "
                                       "only if new seed is the same as the original seed.")
                return self
            st._seed, st._offset = value, 0
        return self

    @staticmethod
    def _impl_name() -> str:
        from .. import _lazy
        name = _lazy.lazy_init().name if _lazy.is_initialized() else "cuda"
        return {"cuda": "CUDAGeneratorImpl", "xpu": "XPUGeneratorImpl", "mps": "MPSGeneratorImpl"}.get(
            name, "GeneratorImpl")

    def seed(self) -> int:
        """Seed from a non-deterministic source (53 bits, as torch's CUDA generators); returns it."""
        value = secrets.randbits(53)
        st = self._state
        with st._lock:
            st._not_capturing("seed")
            st._seed, st._offset = value, 0
        return value

    def initial_seed(self) -> int:
        """The seed in use (the last one set), as an int in [0, 2**64)."""
        return self._state._seed

    @property
    def offset(self) -> int:
        """Words consumed so far (a multiple of 4)."""
        return self._state._offset

    def get_offset(self) -> int:
        """The offset (torch.Generator.get_offset): words consumed so far, a multiple of 4."""
        return self._state._offset

    def set_offset(self, offset: int) -> "Generator":
        """Set the offset (a non-negative multiple of 4 below 2**63).  Returns this generator,
        as torch's (torch/csrc/Generator.cpp THPGenerator_setOffset returns self)."""
        if isinstance(offset, bool) or not hasattr(type(offset), "__index__"):
            raise _NotALong(f"manual_offset expected a long, but got {type(offset).__name__}: offset must be an "
                            f"int (a multiple of 4 in [0, 2**63)), got {offset!r}")
        offset = operator.index(offset)
        if offset % 4:
            raise RuntimeError(f"offset must be a multiple of 4, got {offset}")
        if not 0 <= offset <= _I64_MAX:
            raise RuntimeError(f"offset must be in [0, 2**63), got {offset}")
        st = self._state
        with st._lock:
            st._not_capturing("set_offset")
            st._offset = offset
        return self

    # -- state ---------------------------------------------------------------------
    def get_state(self):
        """16 bytes (numpy uint8): seed uint64, then offset int64, little-endian."""
        import numpy as np
        st = self._state
        with st._lock:
            raw = struct.pack("<Qq", st._seed, st._offset)
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def set_state(self, new_state) -> "Generator":
        """Restore a state from :meth:`get_state` (16 bytes), or 8 bytes (seed; offset 0).

        TypeError for anything but a 1-D uint8 array (or bytes); RuntimeError
        "RNG state is wrong size" for other lengths and "offset must be a
        multiple of 4" for a bad offset.  The state is unchanged on error.  Returns this
        generator, as torch's.
        """
        seed, offset = self.parse_state(new_state)
        st = self._state
        with st._lock:
            st._not_capturing("set_state")
            st._seed, st._offset = seed, offset
        return self

    @staticmethod
    def parse_state(new_state):
        """``(seed, offset)`` from a state array, with set_state's checks; changes nothing."""
        raw = _state_bytes(new_state)
        if len(raw) == 16:
            seed, offset = struct.unpack("<Qq", raw)
        elif len(raw) == 8:
            (seed,), offset = struct.unpack("<Q", raw), 0
        else:
            raise RuntimeError(f"RNG state is wrong size: expected 16 bytes (seed and offset) or 8 "
                               f"(seed only), got {len(raw)}")
        if offset % 4:
            raise RuntimeError(f"offset must be a multiple of 4, got {offset}")
        if offset < 0:
            raise RuntimeError(f"offset must be non-negative, got {offset}")
        return seed, offset

    # -- drawing -------------------------------------------------------------------
    def reserve(self, increment: int) -> int:
        """Reserve ``increment`` words eagerly: return the offset to use and advance
        it by ``increment`` rounded up to a multiple of 4."""
        return self.philox_args(increment, graph=False).offset

    def philox_args(self, increment: int, graph: Optional[bool] = None) -> PhiloxArgs:
        """Reserve ``increment`` words of the current state; the seed/offset (or device
        pointers) a fill uses.

        ``graph``: whether the fill is being captured (its stream is capturing).
        True takes the words from the intragraph offset (the state must be in
        graph-safe mode: registered with the graph being captured); False draws
        eagerly even while a capture is in progress elsewhere; None follows the
        state's mode.
        """
        return self._state.philox_args(increment, graph)

    # -- graph-safe mode of the current state (torch CUDAGeneratorImpl API) ---------
    @property
    def capturing(self) -> bool:
        """Whether the current state is in graph-safe mode (a capture drawing from it is underway)."""
        return self._state._capturing

    def register_graph(self, graph=None, *, alloc: Optional[Callable[[int], int]] = None,
                       free: Optional[Callable[[int], None]] = None) -> None:
        """See :meth:`_State.register_graph` (the current state)."""
        self._state.register_graph(graph, alloc=alloc, free=free)

    def unregister_graph(self, graph=None) -> None:
        """See :meth:`_State.unregister_graph` (the current state)."""
        self._state.unregister_graph(graph)

    def capture_prologue(self, seed_ptr: Optional[int] = None, offset_ptr: Optional[int] = None,
                         graph=None) -> None:
        """See :meth:`_State.capture_prologue` (the current state)."""
        self._state.capture_prologue(seed_ptr, offset_ptr, graph)

    def capture_epilogue(self) -> int:
        """See :meth:`_State.capture_epilogue` (the current state)."""
        return self._state.capture_epilogue()

    def replay_prologue(self, wholegraph_increment: int, stream: int = 0,
                        write: Optional[Callable[[int, int, int, int, int, int], None]] = None,
                        seed_ptr: Optional[int] = None, offset_ptr: Optional[int] = None,
                        graph=None) -> None:
        """See :meth:`_State.replay_prologue` (the current state)."""
        self._state.replay_prologue(wholegraph_increment, stream, write, seed_ptr, offset_ptr, graph)
