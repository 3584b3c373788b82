"""``accel.random``: Philox4x32-10 generators per device and random fills of device buffers.

Semantics of ``torch.accelerator``/``torch.cuda`` random functions: every device
has a default :class:`Generator` with state ``(seed, offset)``;
``get_rng_state`` returns it as 16 bytes (uint8: seed uint64, offset int64,
little-endian, as torch's CUDA generator); ``manual_seed`` seeds the current
device, ``manual_seed_all`` every device, and both reset the offset to 0.

Generators are plain Python objects, so seeding and state queries never
initialize a runtime (``fork`` stays safe).  Seeding before initialization is
applied at once, to device 0's generator for the current-device calls (the
device CUDA makes current at initialization), which is where torch's queued
``_lazy_call`` seeding lands; queries then see it without initializing.  As torch
runs that queue, the latest ``manual_seed`` and ``manual_seed_all`` land after the
other seeding calls made before initialization (``set_rng_state``, ``seed``).
Without any device the seeding calls do nothing, as ``torch.cuda.manual_seed``; in a
child forked after initialization they check their arguments and do nothing, as torch's
(queued there for an initialization that never comes).

Fills (``uniform_``, ``normal_``, ``randint_``, ``random_raw_``) write a whole
:class:`accel.Buffer` on the current stream.  Number layout: element ``i``
comes from the words of ``curand_init(seed, 0, offset)`` in cuRAND order,
by the per-distribution rules in :mod:`accel.random._transforms`; host and
device give bit-identical results; each fill advances the offset by its words
rounded up to a multiple of 4.  While a graph is captured the default
generator runs in graph-safe mode (see :mod:`accel.random.generator`).
"""

from __future__ import annotations

import operator
import secrets
import weakref
from typing import Dict, List

from .. import _lazy, _locks
from ..backends._signals import deferred as _signals_deferred
from .generator import DEFAULT_SEED, Generator, PhiloxArgs, check_seed

__all__ = [
    "Generator", "PhiloxArgs", "DEFAULT_SEED", "default_generator", "initial_seed", "get_rng_state",
    "set_rng_state", "get_rng_state_all", "set_rng_state_all", "manual_seed", "manual_seed_all",
    "seed", "seed_all", "uniform_", "normal_", "randint_", "random_raw_", "register_kernel_source",
]

# accel._locks.Lock: making a default generator allocates (a collection may run a user's __del__
# that seeds) (r68i); a forked child finds it free (accel._locks renews every Lock there)
_lock = _locks.Lock("making a default generator")
_generators: Dict[int, Generator] = {}


def _reset() -> None:
    with _lock:
        _generators.clear()
        _capturing.clear()
        _seeds_before_init.clear()
        _queried_once.clear()


# torch.cuda queues the seeding done before initialization and runs it in _lazy_init: the plain
# calls (set_rng_state, seed, seed_all) in call order, then the latest manual_seed and the latest
# manual_seed_all, the later of those two last (torch/_utils.py _LazySeedTracker, torch/cuda/
# __init__.py _lazy_call/_lazy_init).  accel applies each call at once (a query sees it without
# initializing) and, after a plain call, applies the two latest seed calls again in their order,
# so the states end as torch's (r70b: manual_seed_all(7) then set_rng_state(S, 1) left device 1 at
# S where torch seeds it 7).  torch's queries initialize (get_rng_state, initial_seed call
# _lazy_init), so a query, like initialization, ends the tracking.
# kind ("one" | "all") -> seed, in the order of the latest calls
_seeds_before_init: Dict[str, int] = {}
# True once a query was made: torch would be initialized from then on, and run seeding at once
_queried_once: List[bool] = []
# Over a seeding call and its tracking, so that two threads seeding before initialization end as
# torch's queue does in either order (r70g); accel._locks.Lock: a __del__ seeding inside is refused
_seeding = _locks.Lock("seeding a device's generator")


def _torch_would_run_at_once() -> bool:
    # (a child forked after initialization counts as initialized: torch's queue ran in the parent)
    return bool(_queried_once) or _lazy.is_initialized() or _lazy.is_in_bad_fork()


def _track_seed(kind: str, value: int) -> None:
    if _torch_would_run_at_once():
        _seeds_before_init.clear()
        return
    _seeds_before_init.pop(kind, None)
    _seeds_before_init[kind] = value


def _seeds_again() -> None:
    """After a plain call made before initialization: the latest seed calls again (see above)."""
    if not _seeds_before_init:
        return
    if _torch_would_run_at_once():
        _seeds_before_init.clear()
        return
    for kind, value in list(_seeds_before_init.items()):
        if kind == "one":
            _default_generator(0).manual_seed(value)      # (device 0: current at initialization)
        else:
            for i in range(_device_count()):
                _default_generator(i).manual_seed(value)


def _queued_for_good() -> bool:
    """Whether this is a child forked after initialization, where torch's seeding calls never
    reach the default generators: ``is_initialized()`` is False there, so ``_lazy_call`` queues
    each one, and the queue never runs (``_lazy_init`` raises the fork error).  accel checks the
    arguments as usual, then drops the call (a queue nobody runs would only grow)."""
    return _lazy.is_in_bad_fork()


def _refuse_in_bad_fork() -> None:
    # torch's queries call _lazy_init() first, which raises in a child forked after
    # initialization (r71e: accel answered the parent's state there)
    if _lazy.is_in_bad_fork():
        _lazy.lazy_init()


def _queried() -> None:
    # (torch initializes here: its queued seeding runs now, on every device counted now, and
    # later seeding runs at once)
    if not _queried_once:
        _seeds_again()
        _queried_once.append(True)
    _seeds_before_init.clear()


def _queue_for_init() -> None:
    # after _seeding is released: initialization takes _seeding under accel._lazy's lock
    if _seeds_before_init:
        _lazy.lazy_call(_seeds_at_init, seed_all=True)


def _seeds_at_init() -> None:
    # queued (accel._lazy.lazy_call) by a seed call made before initialization: torch runs its
    # queued seeding on every device counted at initialization, so a device made visible since
    # (CUDA_VISIBLE_DEVICES widened) is seeded too (r71b)
    with _seeding:
        _seeds_again()


_lazy.register_reset_hook(_reset)


# -- devices, without initializing ----------------------------------------------------
def _current_index() -> int:
    # Before initialization every thread's current device is 0 (changing it initializes).
    return _lazy.lazy_init().get_device() if _lazy.is_initialized() else 0


def _device_count() -> int:
    from .. import backends
    chosen = backends.select()
    return chosen.count() if chosen is not None else 0


def _resolve(device) -> int:
    """Index for a ``device`` argument (None: current device); never initializes."""
    from .. import _device as D
    if device is None:
        index = _current_index()
    else:
        if isinstance(device, str) or D.is_torch_device(device):
            device = D.device(device)
        if isinstance(device, D.device) and device.index is None:
            D.device_index(D.device(device.type, 0))   # checks the type against the accelerator
            index = _current_index()
        else:
            index = D.device_index(device)
    D.check_range(index)
    return index


def default_generator(device_index: int) -> Generator:
    """The default generator of device ``device_index`` (created on first use; no runtime init).
    Ends the tracking of seeding before initialization (torch's default generators exist only
    once the runtime is initialized: a call on one is made after torch's queued seeding ran)."""
    gen = _default_generator(device_index)      # (a refused index ends nothing: r71b)
    if not _queried_once:
        with _seeding:      # (not inside another thread's seeding and its re-application, r70m)
            _queried()
    return gen


def _default_generator(device_index: int) -> Generator:
    if type(device_index) is not int:       # the fast path: an int, already a key
        if isinstance(device_index, bool) or not hasattr(type(device_index), "__index__"):
            # (True would find device 1's generator: True == 1 as a key)
            raise TypeError(f"default_generator() takes an int device index, got {device_index!r}")
        device_index = operator.index(device_index)   # numpy integers
    gen = _generators.get(device_index)
    if gen is not None:
        return gen
    from .._device import check_range
    check_range(device_index)
    with _lock:
        gen = _generators.get(device_index)
        if gen is None:
            gen = _generators[device_index] = Generator(device_index)
    return gen


# -- torch.accelerator / torch.cuda random API -------------------------------------------
def initial_seed(device=None, /) -> int:
    """The seed of ``device``'s default generator (current device when None)."""
    _refuse_in_bad_fork()
    gen = _default_generator(_resolve(device))
    with _seeding:      # (no state another thread's seeding leaves half re-applied, r70m)
        value = gen.initial_seed()
        _queried()
    return value


def get_rng_state(device=None):
    """``device``'s generator state: numpy uint8 array of 16 bytes (seed, offset; little-endian)."""
    _refuse_in_bad_fork()
    gen = _default_generator(_resolve(device))
    with _seeding:
        state = gen.get_state()
        _queried()
    return state


def set_rng_state(new_state, device=None) -> None:
    """Restore ``device``'s generator from :func:`get_rng_state` output (16 bytes) or an
    8-byte seed (offset 0).  Errors leave the state unchanged.  Before initialization, a
    ``manual_seed``/``manual_seed_all`` made earlier still lands last, as in torch."""
    gen = _default_generator(_resolve(device))
    if _queued_for_good():
        Generator.parse_state(new_state)
        return
    with _seeding:
        gen.set_state(new_state)
        _seeds_again()


def get_rng_state_all() -> List:
    """States of all devices' generators, in device order."""
    _refuse_in_bad_fork()
    gens = [_default_generator(i) for i in range(_device_count())]
    with _seeding:
        states = [gen.get_state() for gen in gens]
        _queried()
    return states


def set_rng_state_all(new_states) -> None:
    """Restore every device's generator from :func:`get_rng_state_all` output.  All
    states are checked first: on any error no generator changes."""
    try:
        if isinstance(new_states, (dict, set, frozenset)):     # iterating would yield keys
            raise TypeError
        states = list(new_states)
    except TypeError:
        raise TypeError(f"set_rng_state_all takes a list of states (one per device, as get_rng_state_all() "
                        f"returns), got {type(new_states).__name__} {new_states!r}") from None
    count = _device_count()
    if len(states) > count:
        raise ValueError(f"set_rng_state_all got {len(states)} states but only {count} device(s) exist")
    parsed = [Generator.parse_state(s) for s in states]
    if _queued_for_good():
        return
    gens = [_default_generator(i) for i in range(len(parsed))]
    for gen in gens:            # a capture refuses set_state: refuse before any generator changed
        gen._not_capturing("set_state")
    with _seeding:
        for gen, (seed_value, offset) in zip(gens, parsed):
            gen.set_state(_state_of(seed_value, offset))
        _seeds_again()


def _state_of(seed_value: int, offset: int) -> bytes:
    import struct
    return struct.pack("<Qq", seed_value, offset)


def manual_seed(seed) -> None:
    """Seed the current device's generator (offset reset to 0).  ``seed`` is an integer in
    [-2**63, 2**64); negatives are taken mod 2**64.  No-op without a device; never initializes."""
    value = check_seed(seed)
    if _device_count() == 0 or _queued_for_good():
        return
    gen = _default_generator(_current_index())
    with _seeding:
        gen.manual_seed(value)
        _track_seed("one", value)
    _queue_for_init()


def manual_seed_all(seed) -> None:
    """Seed every device's generator (offset reset to 0).  Never initializes the runtime.
    A generator whose device is capturing takes only its own seed again (torch's rule): then
    RuntimeError, and no generator changed."""
    value = check_seed(seed)
    if _queued_for_good():
        return
    with _seeding:
        if _seed_every_device(value):
            _track_seed("all", value)
    _queue_for_init()


def _seed_every_device(value: int) -> bool:
    """Seed every device's generator with ``value`` (offset 0), each capturing device checked
    before any is seeded; False when there is no device."""
    gens = [_default_generator(i) for i in range(_device_count())]
    for gen in gens:            # check every device before seeding any
        if gen.capturing and gen.initial_seed() != value:
            gen.manual_seed(value)      # raises torch's capture error
    for gen in gens:
        gen.manual_seed(value)
    return bool(gens)


def seed() -> int:
    """Seed the current device's generator non-deterministically; returns the seed (0 without a
    device).  Before initialization, a ``manual_seed``/``manual_seed_all`` made earlier still
    lands last, as in torch."""
    if _device_count() == 0:
        return 0
    if _queued_for_good():
        return secrets.randbits(53)     # (the seed that is never applied, as torch's queued call)
    gen = _default_generator(_current_index())
    with _seeding:
        value = gen.seed()
        _seeds_again()
    return value


def seed_all() -> int:
    """Seed every device's generator with one non-deterministic seed; returns it.  Before
    initialization, a ``manual_seed``/``manual_seed_all`` made earlier still lands last, as in torch."""
    value = secrets.randbits(53)
    if _queued_for_good():
        return value
    with _seeding:      # (as manual_seed_all, but a plain call: torch queues it so)
        _seed_every_device(value)
        _seeds_again()
    return value


# -- fills -----------------------------------------------------------------------------
def _target(buf, generator, what: str):
    from ..buffer import Buffer
    if not isinstance(buf, Buffer):
        raise TypeError(f"{what} fills an accel.Buffer, got {type(buf).__name__}")
    buf._live()         # a closed buffer first, as fill_ (before its size is read or a kernel loaded)
    buf._writable()     # a read-only DLPack import, as fill_/copy_from refuse it (before any offset moves)
    if generator is None:
        return default_generator(buf.device_index)
    if not isinstance(generator, Generator):
        raise TypeError(f"generator must be an accel.random.Generator or None, got {type(generator).__name__}")
    # A generator of another device draws too, as torch (which checks the device type only:
    # test_randperm_device_compatibility, r69b); not in a capture (_device._fill_here).
    return generator


def _run(buf, plan, generator):
    from . import _device
    _device.fill(buf, plan, generator)
    return buf


def uniform_(buf, dtype="float32", low: float = 0.0, high: float = 1.0, generator: Generator = None):
    """Fill ``buf`` with uniform values in [low, high) of ``dtype`` (float32 or float64); returns ``buf``."""
    from . import _fills
    gen = _target(buf, generator, "uniform_")
    return _run(buf, _fills.plan_uniform(buf.nbytes, dtype, low, high), gen)


def normal_(buf, mean: float = 0.0, std: float = 1.0, dtype="float32", generator: Generator = None):
    """Fill ``buf`` with normal values (Box–Muller) of ``dtype`` (float32 or float64); returns ``buf``."""
    from . import _fills
    gen = _target(buf, generator, "normal_")
    return _run(buf, _fills.plan_normal(buf.nbytes, dtype, mean, std), gen)


def randint_(buf, low: int, high: int, dtype="int64", generator: Generator = None):
    """Fill ``buf`` with integers in [low, high) of ``dtype`` (int64 or int32); returns ``buf``.

    Each value is ``low + x % (high - low)``: ``x`` one 32-bit Philox word for spans under
    2**28, a 64-bit draw (two words) from 2**28 on, as torch's ``random_from_to``: the modulo's
    skew stays under about 5 % for spans up to 2**32 and grows with spans past 2**62 (a 64-bit
    draw modulo such a span favours the low values, as torch's does)."""
    from . import _fills
    gen = _target(buf, generator, "randint_")
    return _run(buf, _fills.plan_randint(buf.nbytes, dtype, low, high), gen)


def random_raw_(buf, generator: Generator = None):
    """Fill ``buf`` with raw 32-bit Philox words (uint32); returns ``buf``."""
    from . import _fills
    gen = _target(buf, generator, "random_raw_")
    return _run(buf, _fills.plan_raw(buf.nbytes), gen)


def register_kernel_source(language: str, loader) -> None:
    """Supply the Philox kernels for backends with ``kernel_language == language``
    (``loader() -> bytes``; same kernel names and arguments as the PTX)."""
    from . import _device
    _device.register_kernel_source(language, loader)


# -- graph capture hooks (called by accel.graphs) ----------------------------------------
class _GraphRNG:
    """A graph's generator states (torch's ``CUDAGraph::captured_generator_states_``): each
    registered state and the words one replay consumes from it (None until captured).

    Every state in ``states`` counts this token among its registered graphs (it holds its
    holders) until :func:`_graph_release`.  ``implicit``: the default generator's state that
    capture_begin registered because the user had not; an aborted capture unregisters it
    again, while the states the user registered stay registered until the graph is reset or
    collected.  ``capturing``: the states this token's capture put in graph-safe mode."""

    __slots__ = ("states", "implicit", "capturing", "device_index", "last", "__weakref__")

    def __init__(self):
        self.states: Dict[object, object] = {}
        self.implicit = None
        self.capturing: List = []
        self.device_index = None
        # The stream the holders were last used on (a weak reference; None: not known, e.g.
        # allocated on two streams): a replay's prologue writes them on the replay's stream, so
        # when that is another stream it waits for this one first (r65a: a replay on a second
        # stream overwrote the holders before the first stream's replay had read them, and both
        # drew the same numbers; under cudaMallocAsync a replay wrote them before their
        # allocation had run on the capture stream).
        self.last = None


def _note_holders_made(token: _GraphRNG, device_index: int) -> None:
    """Holders of ``token`` were just allocated on the current stream of ``device_index``
    (``_State._cache_alloc``): the stream its first replay's prologue must come after (the
    caching allocator's block may still be read by earlier work of that stream; a cudaMallocAsync
    allocation must have run: CUDA Runtime API, cudaMallocAsync).  Holders allocated on two
    streams: not known (the first replay synchronizes the device)."""
    from ..streams import current_stream
    stream = current_stream(device_index)
    if token.last is None:
        token.last = weakref.ref(stream)
    elif token.last() is not stream:
        token.last = _UNKNOWN


def _unknown():
    return None


_UNKNOWN = _unknown     # a "reference" to no stream: order after the whole device


def _after_last_use(token: _GraphRNG, stream) -> None:
    """Before a replay's prologue on ``stream``: the holders' last use (``token.last``) done, when
    it was on another stream.

    On the device, when the last stream is open (r66h): an event recorded on it and waited for
    by ``stream`` (:func:`_wait_on_device`), so a pipeline replaying one graph on two streams by
    turns queues each replay without blocking the host (1bc2eb7's host wait, per replay, did).
    The event is the device allocator's (``order_after``), so the replay owns none: nothing for
    a finalizer to destroy.  (A temporary Event per replay, and an Event owned by the graph, were
    destroyed by finalizers, and a persistently failing cudaEventDestroy leaked them:
    test_fault_sweep.)

    On the host where the device cannot order it: the last stream closed or not known (the
    device synchronized), or the device-side wait failed (the last stream synchronized); both
    under the capture gate, since a synchronize invalidates a capture another thread runs in
    global mode, and skipped while a capture is underway.  A last stream being captured is not
    waited for at all (3ecb155: the record would join the capture and the replay's stream with
    it; a synchronize would invalidate it): the replay goes on unordered."""
    last_ref = token.last
    last = last_ref() if last_ref is not None else None
    if last is stream:
        return
    from ..memory._guards import capture_underway
    from ..streams import _hold_open, on_device
    be = stream._backend
    hold = _hold_open(last) if last is not None else None     # None: closed (or unknown)
    try:
        if hold is not None and _wait_on_device(be, stream, last):
            return
        with be.capture_gate:
            if capture_underway(be):
                # Neither a synchronize (it would invalidate the other thread's capture) nor a
                # device-side wait (the stream is gone or not known, or the wait failed) is
                # possible: the replay goes on unordered, as before r65a's fix; refusing it would
                # fail a program whose only fault is the timing.
                return
            if hold is not None:
                with on_device(be, last._index):
                    be.stream_synchronize(last._handle)
            else:
                with on_device(be, stream._index):
                    be.device_synchronize()
    finally:
        if hold is not None:
            try:
                hold.__exit__(None, None, None)
            finally:
                if hold._in:    # a Ctrl-C as that call started (it released nothing): once more
                    hold.__exit__(None, None, None)


def _wait_on_device(be, stream, last) -> bool:
    """``stream`` waits on the device for the work queued on ``last`` (held open by the caller)
    so far, through the device allocator's :meth:`order_after` (its cached events: the replay
    owns none).  False when the host must wait instead (the wait could not be queued, or the
    allocator orders nothing); True when done, or when ``last`` is being captured (no wait is
    safe: the replay goes on unordered).  A KeyboardInterrupt leaves nothing to release; the
    replay then raises before its prologue (the generator not advanced)."""
    from .. import memory
    order_after = getattr(memory.device_allocator(stream._index), "order_after", None)
    return order_after is not None and order_after(stream._handle, last._handle, last._index)


# device -> weak reference to the token whose capture is underway there (one per device):
# single-key dict operations only (atomic; no lock a finalizer could wait on), and a token
# collected without its capture ending leaves a dead reference, read as no capture
_capturing: Dict[int, "weakref.ref[_GraphRNG]"] = {}


def _device_capturing(device_index: int) -> bool:
    """Whether a graph capture whose states follow it is underway on ``device_index`` (the
    default generator's state may have been switched for another during the capture)."""
    ref = _capturing.get(device_index)
    token = ref() if ref is not None else None
    return (token is not None and token.device_index == device_index) or \
        default_generator(device_index).capturing


def _not_capturing_anymore(token: _GraphRNG) -> None:
    index = token.device_index
    if index is not None:
        ref = _capturing.get(index)
        if ref is not None and ref() is token:
            _capturing.pop(index, None)
        token.device_index = None


def _graph_register(token, generator: Generator) -> _GraphRNG:
    """Register ``generator``'s current state with the graph owning ``token`` (None: a new
    token); returns the token.  Registering a state twice is a no-op, as torch's."""
    if not isinstance(generator, Generator):
        raise TypeError(f"register_generator_state expects an accel.random.Generator (a generator, or a "
                        f"state from graphsafe_get_state() or clone_state()), got {type(generator).__name__} "
                        f"{generator!r}")
    state = generator._state
    if state.capturing or _device_capturing(state.device_index):
        # torch: assertNotCapturing("Cannot register the state during capturing stage.")
        raise RuntimeError(f"Cannot register the state during capturing stage: a graph is being captured on "
                           f"device {state.device_index}; register generator states before capture_begin")
    if token is None:
        token = _GraphRNG()
    if state not in token.states:
        state.register_graph(token)
        try:
            _note_holders_made(token, state.device_index)
        except BaseException:       # nothing registered: the holders go back
            state.unregister_graph(token)
            raise
        token.states[state] = None
    return token


def _graph_capture_begin(device_index: int, token=None) -> _GraphRNG:
    """Before a capture on ``device_index``: the default generator's current state joins the
    graph's registered states (``token``, None: none), and every one enters graph-safe mode.
    On any error nothing changed (``token`` as it was)."""
    if token is not None:
        for state in token.states:
            if state.device_index != device_index:
                raise RuntimeError(f"a generator state of device {state.device_index} is registered with a graph "
                                   f"about to capture on device {device_index}: a graph replays the states of "
                                   f"its own device; register states of device {device_index} (nothing was "
                                   f"captured)")
    # Load (and JIT) the kernels now: module loading is no stream work a capture can
    # record, so it must not happen between cudaStreamBeginCapture and EndCapture.
    from . import _device
    _device.kernel_functions(_lazy.lazy_init(), device_index)
    new = token is None
    if new:
        token = _GraphRNG()
    default_state = default_generator(device_index)._state
    implicit = None
    try:
        if default_state not in token.states:
            default_state.register_graph(token)
            token.states[default_state] = None
            implicit = default_state
        token.implicit = implicit
        if implicit is not None:
            _note_holders_made(token, device_index)     # on failure _undo_capture unregisters it
        for state in list(token.states):
            _enter_graph_safe_mode(token, state)
        token.device_index = device_index
        _capturing[device_index] = weakref.ref(token)
    except BaseException:
        _undo_capture(token)
        raise
    return token


@_signals_deferred
def _enter_graph_safe_mode(token: _GraphRNG, state) -> None:
    """``state`` enters graph-safe mode and ``token`` lists it, with signals deferred (r55): a
    Ctrl-C as capture_prologue released its lock left the state capturing unlisted, so no
    abort or end ever took it out (every later capture on the device was refused)."""
    state.capture_prologue(graph=token)
    token.capturing.append(state)


def _undo_capture(token: _GraphRNG) -> None:
    """Leave graph-safe mode and unregister the implicit default state (each attempted)."""
    _not_capturing_anymore(token)
    capturing, token.capturing = token.capturing, []
    implicit, token.implicit = token.implicit, None
    try:
        for state in capturing:
            if state.capturing:
                state.capture_epilogue()
    finally:
        for state in token.states:
            token.states[state] = None
        if implicit is not None and token.states.pop(implicit, False) is None:
            implicit.unregister_graph(token)


def _graph_capture_end(token: _GraphRNG) -> None:
    """The capture ended: each state leaves graph-safe mode with the words one replay takes.
    (Called again when a KeyboardInterrupt cut the first call short: graphs.Graph._finish_end.)"""
    while token.capturing:
        state = token.capturing[-1]
        if state.capturing:
            token.states[state] = state.capture_epilogue()
        token.capturing.pop()
    _not_capturing_anymore(token)


def _graph_capture_abort(token):
    """A capture failed or was discarded: its states leave graph-safe mode and the implicit
    default state is unregistered.  Returns the token while it still holds states the user
    registered (they stay registered, for the next capture), else None."""
    if token is None:
        return None
    _undo_capture(token)
    return token if token.states else None


def _graph_release(token: _GraphRNG) -> None:
    """The graph is reset or gone: unregister it from every state (the last graph of a state
    frees its holders), each attempted."""
    states = list(token.states)
    token.states.clear()
    token.implicit = None
    _not_capturing_anymore(token)
    _release_states(states, token)


def _release_states(states, token) -> None:
    error = None
    for state in states:
        try:
            state.unregister_graph(token)
        except BaseException as exc:    # the rest are still released; the first error propagates
            if error is None:
                error = exc
    if error is not None:
        raise error


def _graph_replay(token: _GraphRNG, stream) -> None:
    """Before a replay on ``stream`` (the current stream of the graph's device): each state the
    graph draws from writes its seed and offset to its holders there, after their last users,
    and advances by the graph's words."""
    from ..streams import current_stream
    _after_last_use(token, stream)
    for state, increment in list(token.states.items()):
        if increment:   # (a state the graph drew nothing from: no kernel reads its holders)
            state.replay_prologue(increment, stream=current_stream(state.device_index).handle, graph=token)


def _graph_replayed(token: _GraphRNG, stream) -> None:
    """After a replay's launch on ``stream``: a next replay on another stream waits for it (it
    reads the holders that replay's prologue overwrites)."""
    token.last = weakref.ref(stream)
