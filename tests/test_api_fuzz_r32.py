"""Table-driven adversarial calls of the public API, on every simulator, the way another
program would make them: wrong types, bools and numpy integers where ints go, out-of-range
and foreign devices, use after close, double close, pickling and
copying of every public object, context managers left out of order or on another thread,
bad RNG states and bad memory-API arguments.

Each call must either work or raise a clear Python exception (TypeError, ValueError or one
of accel's own errors) that names the bad value, and leave the process state as it was:
current device, current stream of each device, memory allocated on each device.  Where
torch 2.13 (CPU build) has the same function, it is the oracle for which inputs are
refused (torch.device strings)."""

import copy
import pickle
import threading

import numpy as np
import pytest

import accel
import accel.memory as M
import accel.random as R


def _count():
    return accel.device_count()


def _state():
    """What a refused call must leave unchanged."""
    n = _count()
    return (accel.current_device_index(),
            tuple(accel.current_stream(i) for i in range(n)),
            tuple(M.memory_allocated(i) for i in range(n)),
            accel.is_current_stream_capturing())


def _refused(fn, *exc, named=None):
    """fn() raises one of ``exc`` (default: TypeError/ValueError/RuntimeError, which accel's
    errors all are) whose message contains ``named``; state is unchanged."""
    before = _state()
    with pytest.raises(exc or (TypeError, ValueError, RuntimeError)) as info:
        fn()
    assert not isinstance(info.value, (AssertionError, OverflowError, AttributeError, KeyError, IndexError))
    if named is not None:
        assert named in str(info.value), (named, str(info.value))
    assert _state() == before, f"state changed by a refused call: {info.value}"
    return info.value


# -- device arguments ---------------------------------------------------------------

def _device_takers():
    """(name, fn(dev)) for every public function that takes a device argument."""
    return [
        ("set_device_index", accel.set_device_index),
        ("device_index", lambda d: accel.device_index(d).__enter__()),
        ("current_stream", accel.current_stream),
        ("default_stream", accel.default_stream),
        ("Stream", accel.Stream),
        ("Event", accel.Event),
        ("synchronize", accel.synchronize),
        ("Buffer", lambda d: accel.Buffer(16, d)),
        ("get_device_capability", accel.get_device_capability),
        ("get_device_properties", accel.get_device_properties),
        ("memory_allocated", M.memory_allocated),
        ("memory_stats", M.memory_stats),
        ("memory_summary", M.memory_summary),
        ("reset_peak_memory_stats", M.reset_peak_memory_stats),
        ("get_memory_info", M.get_memory_info),
        ("set_per_process_memory_fraction", lambda d: M.set_per_process_memory_fraction(0.5, d)),
        ("get_per_process_memory_fraction", M.get_per_process_memory_fraction),
        ("get_rng_state", R.get_rng_state),
        ("manual_seed on device", lambda d: R.set_rng_state(R.get_rng_state(0), d)),
    ]


def _bad_devices(kind):
    """(value, exception types, text the message must name)."""
    n = _count()
    return [
        (True, (TypeError,), "True"),
        (False, (TypeError,), "False"),
        (1.0, (TypeError,), "1.0"),
        (b"0", (TypeError,), "b'0'"),
        (object, (TypeError,), "object"),
        ([0], (TypeError,), "[0]"),
        (n, (accel.InvalidDeviceError,), str(n)),
        (2 ** 70, (accel.InvalidDeviceError,), str(2 ** 70)),
        (np.int64(n + 3), (accel.InvalidDeviceError,), str(n + 3)),
        (f"{kind}:{n + 3}", (accel.InvalidDeviceError,), str(n + 3)),
        (f"{kind}:x", (accel.InvalidDeviceError,), f"{kind}:x"),
        (f"{kind}:-1", (accel.InvalidDeviceError,), f"{kind}:-1"),
        ("cpu", (ValueError,), "cpu"),
        ("gpu:0", (ValueError,), "gpu"),
        (accel.device("cpu"), (ValueError,), "cpu"),
    ]


def test_bad_device_arguments_refused_state_unchanged(sim_backend):
    s1 = accel.Stream()
    accel.set_stream(s1)            # a non-default current stream must survive every refusal
    keep = accel.Buffer(64)
    for name, fn in _device_takers():
        for value, exc, named in _bad_devices(sim_backend):
            err = _refused(lambda: fn(value), *exc)
            assert named in str(err) or type(value).__name__ in str(err), (name, value, str(err))
    keep.close()
    s1.close()


def test_numpy_and_device_objects_taken_where_ints_go(sim_backend):
    last = _count() - 1
    for value in (np.int64(last), np.uint8(last), accel.device(sim_backend, last), f"{sim_backend}:{last}"):
        with accel.device_index(value):
            assert accel.current_device_index() == last
            assert accel.current_stream(value).device_index == last
            assert accel.Stream(value).device_index == last
            assert M.memory_allocated(value) >= 0
        assert accel.current_device_index() == 0


# torch.device's own string rules: accel.device refuses what torch.device refuses
_DEVICE_STRINGS = [" {k}:0", "{k}:0 ", "{k}: 0", "{k}:01", "{k}:00", "{k}:+1", "{k}:1_0", "{k}:１",
                   "{k}:", ":0", "{k}:0:0", "{K}:0", "{k}:0", "{k}:10", "{k}"]


@pytest.mark.parametrize("text", _DEVICE_STRINGS)
def test_device_strings_follow_torch(sim_backend, text):
    torch = pytest.importorskip("torch")
    text = text.format(k=sim_backend, K=sim_backend.upper())
    try:
        want = torch.device(text)
    except (RuntimeError, ValueError):
        want = None
    if want is None:
        with pytest.raises(ValueError, match="device"):
            accel.device(text)
        _refused(lambda: accel.set_device_index(text), ValueError)
    else:
        got = accel.device(text)
        assert (got.type, got.index) == (want.type, want.index)


def test_torch_device_objects_taken_as_accel_devices(sim_backend):
    """torch.accelerator takes torch.device objects wherever it takes a device, and a program
    using torch beside accel passes them: accel takes one as the accel.device of the same
    type and index (no import of torch), and refuses another type's as it refuses its string."""
    torch = pytest.importorskip("torch")
    last = _count() - 1
    for name, fn in _device_takers():
        before = _state()
        try:
            fn(torch.device(sim_backend, last))
            for ours, theirs in ((accel.device(sim_backend), torch.device(sim_backend)),):
                try:
                    fn(ours)
                except ValueError as exc:        # an index-less device where one is needed
                    with pytest.raises(type(exc)):
                        fn(theirs)
                else:
                    fn(theirs)
        finally:
            accel.set_device_index(before[0])
        assert _state()[0] == before[0], name
        err = _refused(lambda: fn(torch.device("cpu")), ValueError)
        assert "cpu" in str(err), (name, str(err))
    assert accel.device(torch.device(sim_backend, last)) == accel.device(sim_backend, last)
    with accel.device_index(torch.device(sim_backend, last)):
        assert accel.current_device_index() == last
    assert M.memory_allocated(torch.device(sim_backend, last)) == M.memory_allocated(last)
    assert accel.Stream(torch.device(sim_backend, last)).device_index == last
    assert accel.Buffer(16, torch.device(sim_backend, last)).device_index == last


# -- pickling, copying, repr of every public object -----------------------------------

def _objects(kind):
    objs = {
        "device": accel.device(kind, 0),
        "Stream": accel.Stream(),
        "current_stream": accel.current_stream(),
        "Event": accel.Event(),
        "Buffer": accel.Buffer(64),
        "Generator": R.Generator(0, seed=7),
        "default_generator": R.default_generator(0),
        "MemPool": M.MemPool(),
    }
    if kind != "mps":
        objs["Graph"] = accel.Graph()
    return objs


def test_pickle_and_copy_work_or_refuse_clearly(sim_backend):
    """pickle/copy/deepcopy of a public object either round-trips to an independent object
    or raises TypeError naming accel's class; never a message about some internal lock."""
    for name, obj in _objects(sim_backend).items():
        for how, fn in (("pickle", lambda o: pickle.loads(pickle.dumps(o))),
                        ("copy", copy.copy), ("deepcopy", copy.deepcopy)):
            before = _state()
            try:
                out = fn(obj)
            except TypeError as exc:
                assert "accel" in str(exc) and type(obj).__name__ in str(exc), (name, how, str(exc))
            else:
                assert type(out) is type(obj), (name, how)
                if how == "deepcopy" and name == "Buffer":
                    out.close()             # a device copy: the one state change allowed
                out = None
            assert _state() == before, (name, how)


def test_generator_pickles_and_copies_independently(sim_backend):
    """torch.Generator pickles and copies; so does accel's: same device, seed and offset, its
    own lock and no share of the original's graph holders."""
    gen = R.Generator(_count() - 1, seed=1234)
    gen.set_offset(40)
    for how, fn in (("pickle", lambda o: pickle.loads(pickle.dumps(o))),
                    ("copy", copy.copy), ("deepcopy", copy.deepcopy)):
        out = fn(gen)
        assert type(out) is R.Generator and out is not gen, how
        assert (out.device_index, out.initial_seed(), out.offset) == (gen.device_index, 1234, 40), how
        assert out.get_state().tobytes() == gen.get_state().tobytes(), how
        out.manual_seed(5)
        assert gen.initial_seed() == 1234 and gen.offset == 40, how
        assert out._lock is not gen._lock and not out._holders and out._graphs == 0, how


def test_closed_objects_repr_hash_eq_double_close(sim_backend):
    objs = _objects(sim_backend)
    closers = {"Stream": "close", "Event": "close", "Buffer": "close"}
    for name, method in closers.items():
        obj = objs[name]
        h = hash(obj)
        getattr(obj, method)()
        getattr(obj, method)()              # a second close is a no-op
        assert "closed" in repr(obj) and "closed" in str(obj)
        assert hash(obj) == h and obj == obj and obj != 1
        assert {obj: 1}[obj] == 1
    s, e, b = objs["Stream"], objs["Event"], objs["Buffer"]
    dst = accel.Buffer(64)
    for fn in (s.synchronize, s.query, s.__enter__, lambda: accel.set_stream(s), s.record_event,
               lambda: accel.current_stream().wait_stream(s), e.record, e.query, e.synchronize, e.wait,
               lambda: b.to_numpy(), lambda: b.fill_(0), lambda: b.copy_from(np.zeros(64, np.uint8)),
               lambda: R.uniform_(b), lambda: dst.copy_from(b)):
        _refused(fn, RuntimeError, named="closed")


# -- context managers --------------------------------------------------------------

def test_stream_contexts_out_of_order_and_cross_thread(sim_backend):
    n = _count()
    start = _state()
    a, b = accel.Stream(0), accel.Stream(n - 1)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)            # out of order
    b.__exit__(None, None, None)
    assert _state() == start
    _refused(lambda: a.__exit__(None, None, None), RuntimeError, named="without a matching __enter__")
    a.__enter__()
    errors = []

    def other():
        try:
            a.__exit__(None, None, None)
        except RuntimeError as exc:
            errors.append(exc)
    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert len(errors) == 1 and "thread" in str(errors[0])
    assert accel.current_stream(0) == a
    a.__exit__(None, None, None)
    assert _state() == start
    with a:
        with a:
            assert accel.current_stream(0) == a
        assert accel.current_stream(0) == a
    assert _state() == start


def test_two_threads_keep_their_own_device_and_stream(sim_backend):
    n = _count()
    barrier = threading.Barrier(2)
    seen, errors = {}, []

    def worker(idx):
        try:
            s = accel.Stream(idx)
            with accel.device_index(idx), s:
                barrier.wait()
                buf = accel.Buffer(256)
                R.uniform_(buf)
                seen[idx] = (accel.current_device_index(), accel.current_stream(), buf.device.index)
                barrier.wait()
                buf.close()
            s.close()
        except BaseException as exc:          # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()
    start = _state()
    ths = [threading.Thread(target=worker, args=(i,)) for i in (0, n - 1)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    assert not errors, errors
    assert seen[0][0] == 0 and seen[n - 1][0] == n - 1
    assert seen[0][1].device_index == 0 and seen[n - 1][1].device_index == n - 1
    assert _state() == start


# -- random --------------------------------------------------------------------------

_BAD_STATES = [None, [0] * 16, "x" * 16, np.zeros(16, np.int8), np.zeros(16, np.float32),
               np.zeros((4, 4), np.uint8), np.zeros(15, np.uint8), np.zeros(17, np.uint8),
               np.array([0] * 8 + [1] + [0] * 7, np.uint8),           # offset 1: not a multiple of 4
               np.array([0] * 8 + [0] * 7 + [0x80], np.uint8)]        # negative offset


def test_rng_state_bad_values_leave_generators_unchanged(sim_backend):
    R.manual_seed_all(99)
    gen = R.default_generator(0)
    gen.set_offset(8)
    before = R.get_rng_state_all()
    for bad in _BAD_STATES:
        _refused(lambda: R.set_rng_state(bad), TypeError, RuntimeError)
        _refused(lambda: R.set_rng_state_all([before[0], bad][:_count()] if _count() > 1 else [bad]),
                 TypeError, RuntimeError)
        _refused(lambda: gen.set_state(bad), TypeError, RuntimeError)
        assert [s.tobytes() for s in R.get_rng_state_all()] == [s.tobytes() for s in before]
    for bad in (True, 1.5, "5", None, 2 ** 64, -2 ** 63 - 1):
        _refused(lambda: R.manual_seed(bad), TypeError, ValueError)
        _refused(lambda: R.Generator(0, bad) if bad is not None else R.manual_seed_all(bad), TypeError, ValueError)
    for bad in (True, 3, 2 ** 63, -4, 1.0):
        _refused(lambda: gen.set_offset(bad), TypeError, RuntimeError)
    assert [s.tobytes() for s in R.get_rng_state_all()] == [s.tobytes() for s in before]


# -- memory API ----------------------------------------------------------------------

def test_memory_api_bad_arguments(sim_backend):
    fraction = M.get_per_process_memory_fraction()
    for bad in (True, 0, 1, "0.5", None, np.float32(0.5)):
        _refused(lambda: M.set_per_process_memory_fraction(bad), TypeError)
    for bad in (-0.1, 1.1, float("nan"), float("inf")):
        _refused(lambda: M.set_per_process_memory_fraction(bad), ValueError, named=str(bad))
    assert M.get_per_process_memory_fraction() == fraction
    for kw in (dict(enabled="bogus"), dict(enabled=1), dict(context="bogus"), dict(stacks="bogus"),
               dict(max_entries=0), dict(max_entries=-1), dict(max_entries=True), dict(max_entries=1.0)):
        _refused(lambda: M.record_history(**kw), TypeError, ValueError)
        assert M._history is None, kw
    for bad in (5, "x", True, (0,), (0, 1, 2)):
        _refused(lambda: M.memory_snapshot(bad), TypeError, ValueError)
    for bad in (None, "x", (0, 1)):
        _refused(lambda: M.use_mem_pool(bad).__enter__(), TypeError)


def test_record_history_huge_max_entries(sim_backend):
    """torch's default max_entries is sys.maxsize; a larger int means "keep everything" too
    (it failed with OverflowError from deque(maxlen=...), after the new options were stored)."""
    keep = accel.Buffer(64)
    try:
        M.record_history("all", max_entries=2 ** 70)
        buf = accel.Buffer(128)
        buf.close()
        actions = [e["action"] for e in M._snapshot()["device_traces"][0]]
        assert "alloc" in actions and "free_requested" in actions
    finally:
        M.record_history(None)
    keep.close()


def test_buffer_and_stream_argument_edges(sim_backend):
    for bad, exc in ((-1, ValueError), (True, TypeError), (1.0, TypeError), ("8", TypeError), (None, TypeError),
                     (2 ** 70, accel.OutOfMemoryError)):
        _refused(lambda: accel.Buffer(bad), exc)
    for bad in (True, 1.0, "high", None):
        _refused(lambda: accel.Stream(priority=bad), TypeError)
    s = accel.Stream()
    for bad in (None, 0, "x", accel.Event()):
        _refused(lambda: accel.set_stream(bad), TypeError)
        _refused(lambda: s.wait_stream(bad), TypeError)
    for bad in (None, s, 1):
        _refused(lambda: s.wait_event(bad), TypeError)
    for bad in (-1, 2 ** 64, "x", None, True, 1.0):
        _refused(lambda: accel.Stream.from_handle(bad), TypeError, ValueError)
    b = accel.Buffer(64)
    for bad in (np.zeros(10, np.uint8), np.zeros(100, np.uint8), np.zeros(128, np.uint8)[::2], [1, 2], None):
        _refused(lambda: b.copy_from(bad), TypeError, ValueError)
    for bad in (256, -1, 1.5, True):
        _refused(lambda: b.fill_(bad), ValueError, TypeError)
    s.close()
    b.close()


# -- graph contexts ------------------------------------------------------------------

def test_graph_contexts_refused_before_they_synchronize(sim_graph_backend):
    """Entering a graph that is capturing (or a second graph on the capturing device) is
    refused before ``with g:`` / ``accel.graph()`` synchronize: the synchronize itself would
    invalidate the capture underway (it did: CaptureError from cudaDeviceSynchronize /
    device_synchronize, and the outer capture ended with nothing)."""
    buf = accel.Buffer(64)
    buf.fill_(0)
    side, g, g2 = accel.Stream(), accel.Graph(), accel.Graph()
    with side:
        g.__enter__()
        buf.fill_(7)
        _refused(g.__enter__, RuntimeError, named="already capturing")
        _refused(lambda: accel.graph(g).__enter__(), RuntimeError, named="already capturing")
        _refused(g2.__enter__, RuntimeError, named="another graph is being captured")
        _refused(lambda: accel.graph(g2).__enter__(), RuntimeError, named="another graph is being captured")
        g.__exit__(None, None, None)
    g.replay()
    assert (buf.to_numpy() == 7).all()
    with side:
        _refused(g.__enter__, RuntimeError, named="already holds a capture")
    _refused(lambda: accel.graph(g).__enter__(), RuntimeError, named="already holds a capture")
    g.reset()
    buf.close()
