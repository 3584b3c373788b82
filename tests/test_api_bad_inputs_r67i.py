"""r67i: a table-driven bad-input audit of accel's public API, on the three simulators.

The project's rule: bad input -- wrong types, bools where ints go, NaN/inf, ints past 64 bits,
negative sizes, out-of-range devices, wrong objects (an Event where a Stream goes), closed
objects, misuse during a graph capture -- gets a clear Python exception (TypeError, ValueError,
RuntimeError, IndexError, BufferError, or accel's own errors where the runtime refuses) whose
message names the bad value, and leaves all state as it was: never a crash, a hang, a wrong
result or a silent acceptance.

tests/test_refusals_r58.py swept every public function once with one or two bad values per
parameter; tests/test_api_fuzz_r32.py, test_adversarial.py and test_foreign_inputs_r59.py took
devices, RNG states and foreign producers.  Here each parameter, by its documented kind (a
device, an int, a float, a dtype, an object of one class, an object that may be closed), gets a
whole table of bad values: ``numpy.bool_``, NaN, +-inf, complex, bytes, lists, ``2**64`` and
``2**64 + 8``, ``-2**63 - 1``, padded and upper-case device strings, numpy floats, ...  Values a
parameter documents as valid (None where None is the default, DLPack's stream -1, a clamped
priority, ...) are left out of its row.  Each refused call is checked against a fingerprint of the
process (memory_stats and the settings of both devices, the simulator's live handles, current
device and streams, generator states, host statistics, captures underway).  Misuse during a
capture is tried on the capturing stream and from another stream of the device: each call is
refused with the capture left valid, or refused by the runtime with CaptureError (the capture
then reports the invalidation); the state after the graph is dropped is the state before.

Bugs found (each of these tests failed first; all fixed in session 27):

* ``uniform_``/``normal_`` take a numeric *string* for low/high/mean/std (``float("0.5")``), and an
  int too large for a float leaks a bare OverflowError (accel/random/_fills.py ``_finite``).
* ``uniform_``/``normal_``/``randint_`` take a non-native byte order dtype (``np.dtype(">f4")``:
  its ``.name`` is "float32") and fill native bytes: the caller reads garbage; ``dtype=None`` is
  taken as float64 (``np.dtype(None)``), not the documented default (``_fills._dtype_name``).
* ``Graph(pool=...)`` / ``graph(pool=...)`` take a bool, a negative id and ids past 64 bits
  (accel.graphs ``_check_pool``: ``operator.index``, no range), where memory_snapshot refuses a bool.
* ``memory_snapshot(mempool_id=...)`` refuses numpy integer ids (``type(x) is int``) that
  Graph(pool=...) takes.
* ``Kernel.max_potential_block_size`` refuses numpy integers, with ValueError
  (kernels/_module.py: ``isinstance(v, int)``).
* ``__dlpack__(dl_device=...)`` takes a bool device id (``operator.index``), where
  ``max_version`` refuses bools (_dlpack/exporting.py ``check_dl_device``).
* ``device_allocator(i).record_stream`` / ``host_allocator().record_stream`` take an int that is
  no live stream: the later ``free`` raises the runtime's invalid-handle error with the block
  half freed, and every ``empty_cache``/``empty_host_cache`` after it fails (memory/_caching.py
  ``check_use`` checks the range only; _host.py likewise).
* ``Graph.debug_dump`` writes ``str(path)``: a bytes path becomes a file named ``"b'x.dot'"``, a
  path with a NUL is cut at the NUL by the C call (another file is written), and a folder path
  gives cudaErrorOperatingSystem without naming it (graphs/graph_class.py ``debug_dump``).
* ``with closed_buffer:`` and ``with closed_module:`` enter silently (a closed Stream refuses):
  buffer/buffer_class.py / kernels/_module.py ``__enter__``.
* During a capture, importing (``from_dlpack``) or exporting (``__dlpack__()``, a host wait on
  Level Zero) a buffer last used on a stream outside the capture invalidates the capture (CUDA
  905 from the consumer's wait, Level Zero's host synchronize) instead of being refused first
  (_dlpack/ordering.py ``_refuse_waiting_on_capture`` only looks at a capturing *producer* stream).
* ``Generator.register_graph(alloc=5)`` leaks "'int' object is not callable".
"""

import gc
import math
import os

import numpy as np
import pytest

import accel
import accel.memory as M
import accel.random as R
from accel import _finalize, _lazy, sim
from conftest import SIMS, use_sim
from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module

pytestmark = pytest.mark.usefixtures("frozen_heap")

nan, inf = float("nan"), float("inf")
MiB = 1 << 20

#: builtin exceptions that mean accel tripped over its own code (or a binding leaked)
INTERNAL = (SystemError, AssertionError, KeyError, AttributeError, OverflowError, ZeroDivisionError,
            NameError, UnboundLocalError, RecursionError)
CLEAR = (TypeError, ValueError, RuntimeError, IndexError, BufferError, NotImplementedError)


# -- the fingerprint -----------------------------------------------------------------------------
def _fingerprint() -> dict:
    """Everything a refused call must leave as it was."""
    gc.collect()
    _finalize.drain()
    fp = {}
    for d in range(accel.device_count()):
        fp[f"memory_stats({d})"] = dict(M.memory_stats(d))
        fp[f"current_stream({d})"] = accel.current_stream(d)
        fp[f"rng_state({d})"] = R.get_rng_state(d).tobytes()
        fp[f"initial_seed({d})"] = R.initial_seed(d)
        fp[f"memory_fraction({d})"] = M.get_per_process_memory_fraction(d)
    fp["current_device"] = accel.current_device_index()
    fp["allocator_settings"] = M.get_allocator_settings()
    fp["host_memory_stats"] = dict(M.host_memory_stats())
    fp["history"] = M._history
    fp["captures_underway"] = _lazy.lazy_init().captures_underway()
    state = dict(vars(sim.state()))
    for key in ("calls", "config"):
        state.pop(key)
    fp["sim"] = state
    return fp


def _current(fp: dict) -> dict:
    """``fp`` without memory_stats' running totals and peaks (a capture counts what it made)."""
    out = dict(fp)
    for key in [k for k in fp if k.startswith("memory_stats(")]:
        out[key] = {k: v for k, v in fp[key].items()
                    if not k.endswith((".allocated", ".freed", ".peak")) and k not in ("num_device_alloc",
                                                                                      "num_device_free")}
    return out


def _diff(a: dict, b: dict) -> str:
    out = []
    for key in a:
        if a[key] != b.get(key):
            if isinstance(a[key], dict):
                keys = sorted({k for k in a[key] if a[key].get(k) != b[key].get(k)}
                              | {k for k in b[key] if k not in a[key]}, key=str)
                out.append(f"{key}: " + ", ".join(f"{k} {a[key].get(k)!r}->{b[key].get(k)!r}" for k in keys[:4]))
            else:
                out.append(f"{key}: {str(a[key])[:80]} -> {str(b.get(key))[:80]}")
    return "; ".join(out)


def _names(value) -> set:
    """Texts any of which a refusal of ``value`` must contain."""
    out = {repr(value), str(value), type(value).__name__}
    if isinstance(value, float) and not math.isfinite(value):
        out.add(str(value))
    if isinstance(value, int) and not isinstance(value, bool):
        out.add(hex(value))
    return out


class Case:
    def __init__(self, label, fn, value=None, named=None, exc=CLEAR):
        self.label, self.fn, self.exc = label, fn, exc
        self.named = set(named) if named is not None else _names(value)


def _problem(case, fp_before, fp_after, err):
    out = []
    if err is None:
        out.append("accepted")
    else:
        typ, text = type(err), str(err)
        if typ in INTERNAL or (typ.__module__ == "builtins" and issubclass(typ, INTERNAL)):
            if not issubclass(typ, case.exc):
                out.append(f"internal {typ.__name__}: {text[:160]}")
        elif not issubclass(typ, case.exc):
            out.append(f"{typ.__name__}, not one of {[e.__name__ for e in case.exc]}: {text[:160]}")
        elif not any(n in text for n in case.named):
            out.append(f"message names none of {sorted(case.named)[:3]}: {typ.__name__}: {text[:160]}")
    if fp_before != fp_after:
        out.append(f"state changed: {_diff(fp_before, fp_after)}")
    return f"{case.label}: " + "; ".join(out) if out else None


def _sweep(where: str, cases) -> list:
    """Each case's fingerprint after it is the next one's before (nothing runs between them); a
    fresh one after the last case (what dropping its error released shows there)."""
    problems = []
    # what the test made so far out of the collector's sight (conftest's freeze unfreezes it
    # later): each fingerprint's collection then scans only what the cases made
    gc.collect()
    gc.freeze()
    before = _fingerprint()
    for case in cases:
        err = None
        try:
            case.fn()
        except Exception as exc:        # (KeyboardInterrupt propagates)
            err = exc
        after = _fingerprint()
        problem = _problem(case, before, after, err)
        if problem:
            problems.append(f"[{where}] {problem}")
        del err
        before = after
    after = _fingerprint()
    if after != before:
        problems.append(f"[{where}] after the last case: state changed: {_diff(before, after)}")
    return problems


def _row(label, fn, values, skip=(), named=None, exc=CLEAR):
    """One Case per bad value of one parameter; ``skip``: values the parameter documents as valid
    (compared with ``is`` or ``==`` on the repr, so that nan and np.bool_ compare as themselves)."""
    skipped = {repr(v) for v in skip}
    return [Case(f"{label}({v!r:.40})", (lambda v=v: fn(v)), v, named(v) if callable(named) else named, exc)
            for v in values if repr(v) not in skipped]


# -- the objects ---------------------------------------------------------------------------------
class Env:
    """Live and closed objects on device D (1 where there are two; device 0 stays current)."""

    def __init__(self, kind):
        self.kind = kind
        self.n = accel.device_count()
        self.D = 1 if self.n > 1 else 0
        self.O = 1 - self.D if self.n > 1 else self.D
        D = self.D
        accel.set_device_index(0)
        self.s, self.other = accel.Stream(D), accel.Stream(D)
        self.e = accel.Event(D)
        self.e.record(self.s)
        self.et = accel.Event(D, enable_timing=True)
        self.et.record(self.s)
        self.b = accel.Buffer(1 << 16, D)
        self.b.fill_(0)
        self.view = self.b.as_array(np.float32)
        self.gen = R.Generator(D, seed=5)
        self.pool = M.MemPool()
        self.cs, self.ce, self.cb = accel.Stream(D), accel.Event(D), accel.Buffer(64, D)
        self.cview = self.cb.as_array(np.uint8)
        for obj in (self.cs, self.ce, self.cb):
            obj.close()
        sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
        self.image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL}.get(kind) or spirv_module("saxpy")
        self.sig = None if kind == "cuda" else "f32, ptr, ptr, u64"
        self.mod = accel.Module(self.image, device=D)
        self.kernel = self.mod.function("saxpy", self.sig)
        self.cmod = accel.Module(self.image, device=D)
        self.ckernel = self.cmod.function("saxpy", self.sig)
        if kind == "cuda":
            self.kernel.max_potential_block_size()
            self.ckernel.max_threads_per_block
        self.cmod.close()
        # every first-use path once, so that a refusal's fingerprint compares like with like
        accel.launch(self.kernel, 1, 16, 1.0, self.b, self.b, 16)
        for gen in (None, self.gen):
            R.uniform_(self.b, generator=gen)
            R.normal_(self.b, generator=gen)
            R.randint_(self.b, 0, 9, generator=gen)
        accel.from_dlpack(self.b)
        self.view.__dlpack__()
        self.b.to_numpy()
        for d in range(self.n):
            accel.synchronize(d)


@pytest.fixture(params=SIMS)
def env(request, monkeypatch):
    use_sim(monkeypatch, request.param)
    return Env(request.param)


# -- the tables ----------------------------------------------------------------------------------
INTS = [True, np.bool_(True), 1.5, nan, inf, "8", b"8", None, 2 ** 64, 2 ** 64 + 8, -1, -2 ** 63 - 1,
        np.float64(8.0), complex(8, 0), [8]]
FLOATS = [nan, inf, -inf, None, True, np.bool_(True), complex(0.5, 0), [0.5], "x"]
HUGE = (2 ** 64, 2 ** 64 + 8)
NEGATIVE = (-1, -2 ** 63 - 1)


def _devices(kind):
    return [np.bool_(True), nan, inf, 2 ** 64, -2 ** 64, f"{kind}:-1", f"{kind}:1.0", f"{kind}: 1",
            f" {kind}:0", f"{kind}:0 ", f"{kind.upper()}:0", b"cuda:0", [0], (0,), object(),
            np.uint64(2 ** 64 - 1), np.float64(1.0), complex(1, 0)]


def _device_cases(env):
    b, s, kind = env.b, env.s, env.kind
    takers = {
        "current_stream": accel.current_stream, "default_stream": accel.default_stream,
        "get_device_capability": accel.get_device_capability,
        "get_device_properties": accel.get_device_properties, "set_device_index": accel.set_device_index,
        "synchronize": accel.synchronize, "device_index": lambda d: accel.device_index(d).__enter__(),
        "can_device_access_peer": lambda d: accel.can_device_access_peer(d, 0),
        "get_memory_info": M.get_memory_info, "memory_stats": M.memory_stats, "memory_summary": M.memory_summary,
        "reset_peak_memory_stats": M.reset_peak_memory_stats,
        "set_per_process_memory_fraction": lambda d: M.set_per_process_memory_fraction(0.5, d),
        "get_per_process_memory_fraction": M.get_per_process_memory_fraction,
        "device_allocator": M.device_allocator, "initial_seed": R.initial_seed, "get_rng_state": R.get_rng_state,
        "set_rng_state": lambda d: R.set_rng_state(R.get_rng_state(0), d),
        "default_generator": R.default_generator, "Generator": lambda d: R.Generator(d),
        "Stream": accel.Stream, "Event": accel.Event, "Buffer": lambda d: accel.Buffer(16, d),
        "ExternalStream": lambda d: accel.ExternalStream(s.handle, d),
        "Stream.from_handle": lambda d: accel.Stream.from_handle(s.handle, d),
        "Buffer.from_ptr": lambda d: accel.Buffer.from_ptr(b.ptr, 16, d),
        "Module": lambda d: accel.Module(env.image, d),
    }
    if kind != "mps":
        takers.update({k: getattr(accel, k) for k in ("clock_rate", "temperature", "utilization", "memory_usage",
                                                        "power_draw", "device_memory_used", "list_gpu_processes")})
    out = []
    for name, fn in takers.items():
        # a negative index is a no-op for these, as torch's; can_device_access_peer raises torch's AssertionError
        skip = (-2 ** 64,) if name in ("set_device_index", "device_index") else ()
        exc = CLEAR + (AssertionError,) if name == "can_device_access_peer" else CLEAR
        out += _row(name, fn, _devices(kind), skip=skip, exc=exc)
    return out


def _int_cases(env):
    b, s, view, gen, k, D = env.b, env.s, env.view, env.gen, env.kernel, env.D
    big = lambda v: _names(v) | {"1EB"}          # noqa: E731  (an out-of-memory message names the size so)
    rows = [
        ("Buffer(nbytes)", lambda v: accel.Buffer(v, D), (), big),
        ("empty_pinned(shape)", lambda v: accel.empty_pinned(v), ([8],), big),
        ("empty_pinned((2, n))", lambda v: accel.empty_pinned((2, v)), (), big),
        ("Stream(priority)", lambda v: accel.Stream(D, priority=v), HUGE + NEGATIVE, None),   # clamped, as torch
        ("Stream.from_handle", lambda v: accel.Stream.from_handle(v, D), (), None),
        ("ExternalStream", lambda v: accel.ExternalStream(v, D), (), None),
        ("get_stream_from_external", lambda v: accel.get_stream_from_external(v, D), (), None),
        ("Buffer.from_ptr(ptr)", lambda v: accel.Buffer.from_ptr(v, 16, D), (), None),
        ("Buffer.from_ptr(nbytes)", lambda v: accel.Buffer.from_ptr(b.ptr, v, D), (), None),
        ("Buffer.fill_", lambda v: b.fill_(v), (), None),
        ("Buffer.as_array(offset)", lambda v: b.as_array(np.float32, (4,), offset=v), (), None),
        ("Buffer.as_array(shape[0])", lambda v: b.as_array(np.float32, (v,)), (), None),
        ("Buffer.as_array(strides[0])", lambda v: b.as_array(np.float32, (4,), strides=(v,)), (), None),
        ("ArrayView(offset)", lambda v: accel.ArrayView(b, np.float32, (4,), offset=v), (), None),
        ("Buffer.to_numpy(shape[0])", lambda v: b.to_numpy(np.uint8, (v,)), (), None),
        ("Buffer.copy_from(stream)", lambda v: b.copy_from(np.zeros(1 << 16, np.uint8), stream=v), (None,), None),
        ("Buffer.copy_to(stream)", lambda v: b.copy_to(np.zeros(1 << 16, np.uint8), stream=v), (None,), None),
        ("Buffer.to_numpy(stream)", lambda v: b.to_numpy(stream=v), (None,), None),
        ("Buffer.fill_(stream)", lambda v: b.fill_(0, stream=v), (None,), None),
        ("Buffer.record_stream", lambda v: b.record_stream(v), (), None),
        ("Buffer.__dlpack__(stream)", lambda v: b.__dlpack__(stream=v), (None, -1), None),
        ("Buffer.__dlpack__(max_version)", lambda v: b.__dlpack__(max_version=v), (None,), None),
        ("Buffer.__dlpack__(dl_device=(v, id))", lambda v: b.__dlpack__(dl_device=(v, D)), (True,), None),
        ("Buffer.__dlpack__(dl_device=(type, v))",
         lambda v: b.__dlpack__(dl_device=(b.__dlpack_device__()[0], v)), (True,), None),
        ("ArrayView.__dlpack__(stream)", lambda v: view.__dlpack__(stream=v), (None, -1), None),
        ("ArrayView.to_numpy(stream)", lambda v: view.to_numpy(stream=v), (None,), None),
        ("ArrayView.copy_from(stream)", lambda v: view.copy_from(np.zeros(1 << 14, np.float32), stream=v),
         (None,), None),
        ("ArrayView.record_stream", lambda v: view.record_stream(v), (), None),
        ("from_dlpack(stream)", lambda v: accel.from_dlpack(b, stream=v), (None, -1), None),
        ("Stream.wait_stream", lambda v: s.wait_stream(v), (), None),
        ("Stream.wait_event", lambda v: s.wait_event(v), (), None),
        ("Stream.record_event", lambda v: s.record_event(v), (None,), None),
        ("Event.record", lambda v: env.e.record(v), (None,), None),
        ("Event.wait", lambda v: env.e.wait(v), (None,), None),
        ("Event.elapsed_time", lambda v: env.et.elapsed_time(v), (), None),
        ("set_stream", lambda v: accel.set_stream(v), (), None),
        ("randint_(low)", lambda v: R.randint_(b, v, 9), (-1,), None),
        ("randint_(high)", lambda v: R.randint_(b, 0, v), (), None),
        ("manual_seed", lambda v: R.manual_seed(v), (-1,), None),           # negatives mod 2**64, as documented
        ("manual_seed_all", lambda v: R.manual_seed_all(v), (-1,), None),
        ("Generator(seed)", lambda v: R.Generator(D, v), (None, -1), None),
        ("Generator(device_index)", lambda v: R.Generator(v), (), None),
        ("Generator.manual_seed", lambda v: gen.manual_seed(v), (-1,), None),
        ("Generator.set_offset", lambda v: gen.set_offset(v), (), None),
        ("Generator.reserve", lambda v: gen.reserve(v), (), None),
        ("Generator.philox_args", lambda v: gen.philox_args(v), (), None),
        ("set_rng_state(int)", lambda v: R.set_rng_state(v), (), None),
        # documented: a larger count keeps everything (torch's size_t sys.maxsize default)
        ("record_history(max_entries)", lambda v: M.record_history("all", max_entries=v), HUGE, None),
        # an unknown pool id answers [] (as torch's); a bool is no id
        ("memory_snapshot((v, 1))", lambda v: M.memory_snapshot((v, 1)), HUGE + NEGATIVE, None),
        ("launch(grid)", lambda v: accel.launch(k, v, 16, 1.0, b, b, 16), (), None),
        ("launch(grid=(1, v, 1))", lambda v: accel.launch(k, (1, v, 1), 16, 1.0, b, b, 16), (), None),
        ("launch(block)", lambda v: accel.launch(k, 1, v, 1.0, b, b, 16), (), None),
        ("launch(block=(16, 1, v))", lambda v: accel.launch(k, 1, (16, 1, v), 1.0, b, b, 16), (), None),
        ("launch(shared_mem)", lambda v: accel.launch(k, 1, 16, 1.0, b, b, 16, shared_mem=v), (), None),
        ("launch(stream)", lambda v: accel.launch(k, 1, 16, 1.0, b, b, 16, stream=v), (None,), None),
        ("launch(u64 argument)", lambda v: accel.launch(k, 1, 16, 1.0, b, b, v), (None,), None),   # None: NULL
        ("launch(ptr argument)", lambda v: accel.launch(k, 1, 16, 1.0, v, b, 16), (None,), None),
    ]
    if env.kind == "cuda":
        rows += [("Kernel.max_potential_block_size(dynamic_smem)", lambda v: k.max_potential_block_size(v), (), None),
                 # 0 is "no limit"; a larger limit than the device's is the device's
                 ("Kernel.max_potential_block_size(block_size_limit)",
                  lambda v: k.max_potential_block_size(0, v), HUGE, None)]
    if env.kind != "mps":
        rows += [("Graph(pool=(v, 1))", lambda v: accel.Graph(pool=(v, 1)), (True,) + HUGE + NEGATIVE, None)]
    out = []
    for label, fn, skip, named in rows:
        out += _row(label, fn, INTS, skip=skip, named=named)
    return out


def _float_cases(env):
    b, k = env.b, env.kernel
    rows = [
        ("set_per_process_memory_fraction", lambda v: M.set_per_process_memory_fraction(v, env.D), ()),
        ("uniform_(low)", lambda v: R.uniform_(b, low=v), ()),
        ("uniform_(high)", lambda v: R.uniform_(b, high=v), ()),
        ("normal_(mean)", lambda v: R.normal_(b, mean=v), ()),
        ("normal_(std)", lambda v: R.normal_(b, std=v), ()),
        ("launch(f32 argument)", lambda v: accel.launch(k, 1, 16, v, b, b, 16), (nan, inf, -inf)),  # floats, all
    ]
    out = []
    for label, fn, skip in rows:
        out += _row(label, fn, FLOATS, skip=skip)
    out.append(Case("launch(f32 argument=1e39)", lambda: accel.launch(k, 1, 16, 1e39, b, b, 16), 1e39))
    return out


_OBJECT_DTYPE = {"object", "Python object"}


def _dtype_cases(env):
    b = env.b
    held = np.dtype([("a", "u1"), ("b", "O")])
    values = [(np.dtype("O"), _OBJECT_DTYPE), ("O", _OBJECT_DTYPE), (object, _OBJECT_DTYPE), (held, {"'O'"}),
              (5, {"5"}), ("bogus", {"bogus"})]
    out = []
    for label, fn in (("Buffer.to_numpy(dtype)", lambda v: b.to_numpy(v)), ("Buffer.as_array(dtype)", b.as_array),
                      ("ArrayView(dtype)", lambda v: accel.ArrayView(b, v)),
                      ("empty_pinned(dtype)", lambda v: accel.empty_pinned(16, v))):
        out += [Case(f"{label}({v!r:.30})", (lambda v=v, fn=fn: fn(v)), v, named) for v, named in values]
    out += [Case(f"Buffer.as_array({v!r})", (lambda v=v: b.as_array(v)), v, {"itemsize 0", "no fixed size"})
            for v in ("S0", "V0", "U0")]
    for label, fn, bad in (("uniform_(dtype)", lambda v: R.uniform_(b, v), ("float16", "int32", "U4", "O", 5)),
                           ("normal_(dtype)", lambda v: R.normal_(b, dtype=v), ("float16", "uint8", "c8", "O")),
                           ("randint_(dtype)", lambda v: R.randint_(b, 0, 9, v), ("float32", "U4", "O", "bool"))):
        out += _row(label, fn, bad)
    return out


def _object_cases(env):
    """Parameters taking one class of object, given another (each row leaves out its own class)."""
    b, s, e, gen, view = env.b, env.s, env.e, env.gen, env.view
    objects = {"int": 5, "str": "x", "object": object(), "Event": e, "Stream": s, "Buffer": b, "Generator": gen,
               "ndarray": np.zeros(4, np.uint8), "MemPool": env.pool, "type": accel.Stream}
    takers = [
        ("set_stream", accel.set_stream, {"Stream"}),
        ("Stream.wait_event", s.wait_event, {"Event"}),
        ("Stream.wait_stream", s.wait_stream, {"Stream"}),
        ("Stream.record_event", s.record_event, {"Event"}),
        ("Event.record", e.record, {"Stream"}),
        ("Event.wait", e.wait, {"Stream"}),
        ("Event.elapsed_time", env.et.elapsed_time, {"Event"}),
        ("Buffer.record_stream", b.record_stream, {"Stream"}),
        ("ArrayView.record_stream", view.record_stream, {"Stream"}),
        ("uniform_(buf)", R.uniform_, {"Buffer"}),
        ("uniform_(generator)", lambda v: R.uniform_(b, generator=v), {"Generator"}),
        ("Generator.graphsafe_set_state", gen.graphsafe_set_state, {"Generator"}),
        ("use_mem_pool", lambda v: M.use_mem_pool(v).__enter__(), {"MemPool"}),
        ("from_dlpack", accel.from_dlpack, {"Buffer"}),
        ("launch(kernel)", lambda v: accel.launch(v, 1, 1), set()),
        ("ArrayView(buffer)", lambda v: accel.ArrayView(v, np.uint8), {"Buffer"}),
        ("Buffer(stream)", lambda v: accel.Buffer(16, env.D, stream=v), {"Stream"}),
        ("Buffer.fill_(stream)", lambda v: b.fill_(0, stream=v), {"Stream"}),
        ("Buffer.to_numpy(stream)", lambda v: b.to_numpy(stream=v), {"Stream"}),
        ("attach_out_of_memory_observer", M.attach_out_of_memory_observer, {"type"}),   # a class is callable
    ]
    if env.kind != "mps":
        takers += [("Graph.register_generator_state", lambda v: accel.Graph().register_generator_state(v),
                    {"Generator"}),
                   ("graph(cuda_graph)", lambda v: accel.graph(v).__enter__(), set()),
                   ("graph(stream)", lambda v: accel.graph(accel.Graph(), stream=v).__enter__(), {"Stream"})]
    out = []
    for label, fn, own in takers:
        for name, value in objects.items():
            if name not in own:
                # (a host array given to from_dlpack is refused as host memory: kDLCPU)
                out.append(Case(f"{label}({name})", (lambda fn=fn, value=value: fn(value)), value,
                                _names(value) | {name} | ({"kDLCPU"} if label == "from_dlpack" else set())))
    return out


def _closed_cases(env):
    b, s, view, cb, cs, cview, ce = env.b, env.s, env.view, env.cb, env.cs, env.cview, env.ce
    closed = {"closed"}
    cases = [
        ("closed Buffer.ptr", lambda: cb.ptr),
        ("view of a closed Buffer: ptr", lambda: cview.ptr),
        ("view of a closed Buffer: to_numpy", lambda: cview.to_numpy()),
        ("view of a closed Buffer: copy_from", lambda: cview.copy_from(np.zeros(64, np.uint8))),
        ("view of a closed Buffer: record_stream", lambda: cview.record_stream(s)),
        ("view of a closed Buffer: __dlpack__", lambda: cview.__dlpack__()),
        ("from_dlpack(view of a closed Buffer)", lambda: accel.from_dlpack(cview)),
        ("Buffer.copy_from(view of a closed Buffer)", lambda: b.copy_from(cview)),
        ("ArrayView.copy_from(view of a closed Buffer)", lambda: view.copy_from(cview)),
        ("ArrayView(closed Buffer, offset)", lambda: accel.ArrayView(cb, np.uint8, (4,), offset=4)),
        ("closed Stream.is_capturing", lambda: cs.is_capturing()),
        ("ArrayView.record_stream(closed)", lambda: view.record_stream(cs)),
        ("ArrayView.to_numpy(stream=closed)", lambda: view.to_numpy(stream=cs)),
        ("ArrayView.copy_from(stream=closed)", lambda: view.copy_from(np.zeros(1 << 14, np.float32), stream=cs)),
        ("Buffer.copy_to(stream=closed)", lambda: b.copy_to(np.zeros(1 << 16, np.uint8), stream=cs)),
        ("Buffer.__dlpack__(stream=closed Stream)", lambda: b.__dlpack__(stream=cs)),
        ("from_dlpack(stream=closed Stream)", lambda: accel.from_dlpack(b, stream=cs)),
        ("Stream.wait_event(closed Event)", lambda: s.wait_event(ce)),
        ("Event.elapsed_time(closed Event)", lambda: env.et.elapsed_time(ce)),
        ("launch(view of a closed Buffer)", lambda: accel.launch(env.kernel, 1, 16, 1.0, cview, b, 16)),
        ("launch(kernel of a closed Module)", lambda: accel.launch(env.ckernel, 1, 16, 1.0, b, b, 16)),
        ("closed Module.function", lambda: env.cmod.function("saxpy", env.sig)),
        ("launch(stream=closed Stream)", lambda: accel.launch(env.kernel, 1, 16, 1.0, b, b, 16, stream=cs)),
    ]
    if env.kind == "cuda":
        # (a property: reading it on a closed stream raises, naming it)
        cases.append(("closed Stream.__cuda_stream__", lambda: cs.__cuda_stream__()))
        cases += [(f"Kernel of a closed Module: {a}", (lambda a=a: getattr(env.ckernel, a)))
                  for a in ("max_threads_per_block", "num_regs", "shared_size_bytes")]
        cases.append(("Kernel of a closed Module: max_potential_block_size",
                      lambda: env.ckernel.max_potential_block_size()))
    return [Case(label, fn, named=closed) for label, fn in cases]


GROUPS = {"devices": _device_cases, "ints": _int_cases, "floats": _float_cases, "dtypes": _dtype_cases,
          "objects": _object_cases, "closed": _closed_cases}


@pytest.mark.parametrize("group", list(GROUPS))
def test_bad_values_of_each_parameter_are_refused_and_change_nothing(env, group):
    cases = GROUPS[group](env)
    assert len(cases) > 20
    problems = _sweep(f"{env.kind} {group}", cases)
    assert not problems, "\n".join(problems[:40]) + (f"\n... {len(problems) - 40} more" if len(problems) > 40 else "")
    # the next valid operation works
    env.b.fill_(7)
    assert (env.b.to_numpy() == 7).all()


# -- misuse during a capture -----------------------------------------------------------------------
def _capture_misuse(env, g_done, bo, pinned):
    """(label, fn, misuse off the capturing stream too): calls a capture underway on device D
    refuses (or the runtime refuses).  The third field is False for a call that is legal from a
    stream that is not capturing (it queues there, outside the capture)."""
    D, O = env.D, env.O
    so = accel.Stream(O)
    return [
        ("manual_seed(another seed)", lambda: R.manual_seed(12345), True),
        ("manual_seed_all(another seed)", lambda: R.manual_seed_all(12345), True),
        ("seed()", lambda: R.seed(), True),
        ("seed_all()", lambda: R.seed_all(), True),
        ("set_rng_state(D)", lambda: R.set_rng_state(R.get_rng_state(O), D), True),
        ("set_rng_state_all", lambda: R.set_rng_state_all(R.get_rng_state_all()), True),
        ("default_generator(D).set_offset(0)", lambda: R.default_generator(D).set_offset(0), True),
        ("default_generator(D).set_state", lambda: R.default_generator(D).set_state(R.get_rng_state(O)), True),
        ("default_generator(D).manual_seed(another)", lambda: R.default_generator(D).manual_seed(777), True),
        ("replay of a captured graph onto the current stream", lambda: g_done.replay(), False),
        ("a second capture on the device", lambda: (env.other.__enter__(), accel.Graph().capture_begin()), True),
        ("graph(another Graph) on the device", lambda: accel.graph(accel.Graph()).__enter__(), True),
        ("device_allocator(D).empty_cache()", lambda: M.device_allocator(D).empty_cache(), True),
        ("Event.elapsed_time (host wait)", lambda: env.et.elapsed_time(env.et), True),
        ("another stream's synchronize", lambda: env.other.synchronize(), True),
        ("the other device's stream synchronize", lambda: so.synchronize(), True),
        ("synchronize(other device)", lambda: accel.synchronize(O), True),
        ("Event.query", lambda: env.e.query(), True),
        ("to_numpy of the other device's buffer", lambda: bo.to_numpy(), True),
        ("Buffer.copy_to(host) of a buffer of the device", lambda: env.b.copy_to(np.zeros(1 << 16, np.uint8)), True),
        ("blocking copy from a pinned array", lambda: env.b.copy_from(pinned), True),
        ("Stream.close of the capturing stream", lambda: env.s.close(), True),
        ("uniform_(unregistered generator)", lambda: R.uniform_(env.b, generator=env.gen), False),
        ("Generator.clone_state of the default generator", lambda: R.default_generator(D).clone_state(), True),
    ]


@pytest.mark.parametrize("where", ["on the capturing stream", "from another stream of the device"])
def test_misuse_during_a_capture_is_refused_or_reported_and_the_state_kept(monkeypatch, where):
    """A capture on env.s (device D; global mode).  Each call, made with the capturing stream
    current or from the device's default stream, either raises with the capture left valid (it
    ends and replays its fill), or raises CaptureError and capture_end reports the invalidation.
    Once the graph is dropped the state is what it was before the capture began."""
    problems = []
    for kind in [k for k in SIMS if k != "mps"]:
        use_sim(monkeypatch, kind)
        env = Env(kind)
        D, O = env.D, env.O
        target = accel.Buffer(4096, D)
        bo = accel.Buffer(1 << 16, O)
        bo.fill_(1)
        g_done = accel.Graph()
        with env.s:
            g_done.capture_begin()
            target.fill_(9)
            g_done.capture_end()
        for d in range(env.n):
            accel.synchronize(d)
        pinned = accel.empty_pinned(1 << 16)
        for label, fn, off_too in _capture_misuse(env, g_done, bo, pinned):
            if not (off_too or where.startswith("on")):
                continue
            where_ = f"[{kind} {where}] {label}"
            before = _current(_fingerprint())
            g = accel.Graph()
            with env.s:
                g.capture_begin()
                target.fill_(1)
                err = None
                if where.startswith("on"):
                    try:
                        fn()
                    except Exception as exc:
                        err = exc
            if not where.startswith("on"):
                accel.set_device_index(D)
                try:
                    fn()
                except Exception as exc:
                    err = exc
            while accel.current_stream(D) is env.other:        # a case that entered env.other
                env.other.__exit__(None, None, None)
            invalidated = False
            with env.s:
                try:
                    g.capture_end()
                except accel.CaptureError:
                    invalidated = True
            if err is None:
                problems.append(f"{where_}: accepted")
            elif not isinstance(err, (RuntimeError, ValueError, TypeError)):
                problems.append(f"{where_}: {type(err).__name__}: {err}")
            elif invalidated and not isinstance(err, accel.CaptureError):
                problems.append(f"{where_}: the capture was invalidated, but the call raised "
                                f"{type(err).__name__}, not CaptureError: {err}")
            if not invalidated:
                target.fill_(0)
                g.replay()
                accel.synchronize(D)
                if not (target.to_numpy() == 1).all():
                    problems.append(f"{where_}: the capture replays wrong")
            g.reset()
            del g, err
            accel.set_device_index(0)
            after = _current(_fingerprint())
            if after != before:
                problems.append(f"{where_}: state changed: {_diff(before, after)}")
        g_done.reset()
    assert not problems, "\n".join(problems)


# -- bugs found (each failed first; fixed in session 27) ----------------------------------------------------------------------
_FLOAT_ARGS = {
    "uniform_(low)": lambda b, v: R.uniform_(b, low=v, high=2.0),
    "uniform_(high)": lambda b, v: R.uniform_(b, high=v),
    "normal_(mean)": lambda b, v: R.normal_(b, mean=v),
    "normal_(std)": lambda b, v: R.normal_(b, std=v),
}


@pytest.mark.parametrize("arg", list(_FLOAT_ARGS))
def test_rng_float_arguments_refuse_numeric_strings(sim_cuda, arg):
    b = accel.Buffer(64)
    state = R.get_rng_state(0).tobytes()
    with pytest.raises(TypeError, match="'0.5'"):
        _FLOAT_ARGS[arg](b, "0.5")
    assert R.get_rng_state(0).tobytes() == state


@pytest.mark.parametrize("arg", list(_FLOAT_ARGS))
def test_rng_float_arguments_refuse_ints_too_large_for_a_float(sim_cuda, arg):
    b = accel.Buffer(64)
    state = R.get_rng_state(0).tobytes()
    with pytest.raises(ValueError, match=arg.split("(")[1].rstrip(")")):
        _FLOAT_ARGS[arg](b, 10 ** 400)
    assert R.get_rng_state(0).tobytes() == state


_FILLS = {
    "uniform_(>f4)": (lambda b: R.uniform_(b, dtype=np.dtype(">f4")), ">f4"),
    "normal_(>f8)": (lambda b: R.normal_(b, dtype=np.dtype(">f8")), ">f8"),
    "randint_(>i8)": (lambda b: R.randint_(b, 0, 9, np.dtype(">i8")), ">i8"),
    "uniform_(dtype=None)": (lambda b: R.uniform_(b, dtype=None), "f4"),
}


@pytest.mark.parametrize("fill", list(_FILLS))
def test_rng_fills_refuse_a_dtype_they_do_not_write(sim_backend, fill):
    """A fill either writes the dtype asked for (read back with it, the numbers are in range) or
    refuses it with TypeError; it never writes another layout."""
    fn, dtype = _FILLS[fill]
    b = accel.Buffer(256)
    try:
        fn(b)
    except TypeError as exc:
        assert str(np.dtype(dtype)) in str(exc) or "None" in str(exc) or dtype in str(exc)
        return
    got = b.to_numpy(dtype)
    if fill.startswith("uniform_"):
        assert ((got >= 0) & (got < 1)).all(), got[:4]
    elif fill.startswith("randint_"):
        assert ((got >= 0) & (got < 9)).all(), got[:4]
    else:
        assert (np.abs(got) < 1e3).all(), got[:4]


@pytest.mark.filterwarnings("ignore:The .* Graph is empty")     # (an accepted graph() ended at once)
@pytest.mark.parametrize("bad", [(True, 1), (-1, 1), (2 ** 64, 1)], ids=["bool", "negative", "2**64"])
@pytest.mark.parametrize("how", ["Graph(pool=)", "graph(g, pool=)"])
def test_graph_pool_ids_refuse_bools_negatives_and_ids_past_64_bits(sim_graph_backend, bad, how):
    accel.Buffer(5 * MiB).close()                # cached memory, which graph() would empty first
    reserved = M.memory_stats(0)["reserved_bytes.all.current"]
    entered = accel.graph(accel.Graph(), pool=bad) if how != "Graph(pool=)" else None
    try:
        with pytest.raises((TypeError, ValueError), match=str(bad[0])):
            if entered is None:
                accel.Graph(pool=bad)
            else:
                entered.__enter__()
    except BaseException:
        if entered is not None and accel.is_current_stream_capturing():
            entered.__exit__(None, None, None)          # accepted: the capture it began is ended
        raise
    assert M.memory_stats(0)["reserved_bytes.all.current"] == reserved
    assert not accel.is_current_stream_capturing()


def test_memory_snapshot_takes_numpy_integer_pool_ids(sim_backend):
    pool = M.MemPool()
    with M.use_mem_pool(pool):
        buf = accel.Buffer(4096)
    ids = tuple(np.int64(x) for x in pool.id)
    assert M.memory_snapshot(ids) == M.memory_snapshot(pool.id) != []
    buf.close()


def test_max_potential_block_size_takes_numpy_integers(sim_cuda):
    kernel = accel.Module(SAXPY_PTX).function("saxpy")
    assert kernel.max_potential_block_size(np.int64(0), np.int32(256)) == kernel.max_potential_block_size(0, 256)


def test_dlpack_dl_device_refuses_a_bool_device_id(sim_backend):
    index = accel.device_count() - 1
    b = accel.Buffer(64, index)
    kind, _ = b.__dlpack_device__()
    with pytest.raises(TypeError, match=repr(bool(index))):
        b.__dlpack__(dl_device=(kind, bool(index)))


def _live_stream_check(alloc_kind):
    if alloc_kind == "device":
        alloc, empty = M.device_allocator(0), M.empty_cache
        ptr = alloc.malloc(512)
    else:
        alloc, empty = M.host_allocator(), M.empty_host_cache
        accel.Buffer(16)                       # the runtime started
        ptr = alloc.malloc(512)
    return alloc, empty, ptr


@pytest.mark.parametrize("alloc_kind", ["device", "host"])
def test_allocator_record_stream_refuses_a_handle_that_is_no_stream(sim_backend, alloc_kind):
    alloc, empty, ptr = _live_stream_check(alloc_kind)
    bogus = 0x3039
    try:
        with pytest.raises(ValueError, match="0x3039|12345"):
            alloc.record_stream(ptr, bogus, 0)
    finally:
        try:
            alloc.free(ptr)
            empty()                            # neither wedged
        finally:
            _lazy._reset_for_tests()           # (a wedged allocator is not left to the next test)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _debug_graph():
    b, s = accel.Buffer(64), accel.Stream()
    g = accel.Graph()
    g.enable_debug_mode()
    with s:
        g.capture_begin()
        b.fill_(1)
        g.capture_end()
    return g, b


def test_debug_dump_writes_a_bytes_path_where_it_names(sim_graph_backend, in_tmp):
    g, _ = _debug_graph()
    g.debug_dump(b"x.dot")
    assert sorted(os.listdir(in_tmp)) == ["x.dot"]


def test_debug_dump_refuses_a_path_with_a_nul(sim_cuda, in_tmp):
    g, _ = _debug_graph()
    with pytest.raises(ValueError):
        g.debug_dump("a\0b.dot")
    assert os.listdir(in_tmp) == []


def test_debug_dump_of_a_folder_names_it(sim_cuda, in_tmp):
    g, _ = _debug_graph()
    with pytest.raises(OSError, match=str(in_tmp)):
        g.debug_dump(str(in_tmp))


@pytest.mark.parametrize("what", ["Buffer", "Module"])
def test_with_a_closed_buffer_or_module_is_refused(sim_backend, what):
    if what == "Buffer":
        obj = accel.Buffer(16)
    else:
        sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
        obj = accel.Module({"cuda": SAXPY_PTX, "mps": SAXPY_MSL}.get(sim_backend) or spirv_module("saxpy"))
    obj.close()
    with pytest.raises((RuntimeError, ValueError), match="closed"):     # (each as its other methods)
        with obj:
            pass


_DLPACK_IN_CAPTURE = {
    "from_dlpack(buffer)": lambda b: accel.from_dlpack(b),
    "buffer.__dlpack__()": lambda b: b.__dlpack__(),
}


@pytest.mark.parametrize("kind, call", [
    ("cuda", "from_dlpack(buffer)"),
    ("xpu", "from_dlpack(buffer)"),
    ("xpu", "buffer.__dlpack__()"),
    ("cuda", "buffer.__dlpack__()"),            # the legacy stream: the buffer's own, no wait
])
def test_dlpack_during_a_capture_keeps_the_capture_valid(monkeypatch, kind, call):
    """The buffer was last used on the default stream (outside the capture): the call either
    works or is refused before anything is queued; the capture ends and replays either way."""
    if kind not in SIMS:
        pytest.skip(f"ACCEL_TEST_SIMS leaves out {kind}")
    use_sim(monkeypatch, kind)
    b = accel.Buffer(64)
    b.fill_(1)
    accel.synchronize()
    cap, target = accel.Stream(), accel.Buffer(64)
    g = accel.Graph()
    with cap:
        g.capture_begin()
        target.fill_(2)
        try:
            _DLPACK_IN_CAPTURE[call](b)
        except (RuntimeError, ValueError, BufferError):
            pass
        try:
            g.capture_end()
        except accel.CaptureError as exc:
            g.reset()
            pytest.fail(f"{call} invalidated the capture: {exc}")
    target.fill_(0)
    g.replay()
    accel.synchronize()
    assert (target.to_numpy() == 2).all()
    g.reset()


def test_register_graph_names_an_allocator_that_is_not_callable(sim_cuda):
    gen = R.Generator(0, seed=1)
    with pytest.raises(TypeError, match="alloc.*5"):
        gen.register_graph("g", alloc=5, free=print)
