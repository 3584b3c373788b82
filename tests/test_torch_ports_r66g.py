"""Round r66g: PyTorch tests of the runtime surface that tests/TORCH_PORTS.md did not list yet,
ported to accel.  tests/TORCH_PORTS_r66g.md names every test considered and where it went.

Copies read: test/test_cuda_nvml_based_avail.py ROCm/pytorch@10b22ea5 (TestExtendedCUDAIsAvail,
TestVisibleDeviceParses), test/test_cpp_extensions_stream_and_event.py pytorch/pytorch@2141bb37
(the device-generic Stream/Event test torch runs on its fake MTIA backend),
test/test_cpp_extensions_open_device_registration.py pytorch/pytorch@005c9672 (PrivateUse1 backend
registration: the generator and device-copy parts).

Conventions as tests/TORCH_PORTS.md: tensors are ``accel.Buffer``s, ``torch.Stream``/``torch.Event``
are ``accel.Stream``/``accel.Event``, ``torch.Generator(device)`` is ``accel.random.Generator``,
``torch.cuda._parse_visible_devices`` / ``_transform_uuid_to_ordinals`` / ``_device_count_nvml``
are ``accel.backends._visible.parse`` / ``uuids_to_ordinals`` / ``visible_ordinals`` (the port of
those torch functions that accel's fork-safe NVML count uses), and each parse is also checked
end to end: ``accel.device_count()`` on the CUDA simulator under that CUDA_VISIBLE_DEVICES, before
the runtime starts (NVML) and after (cudaGetDeviceCount), must agree.  Test names are
``test_<torch file>__<torch test>``.
"""

import warnings

import numpy as np
import pytest

import accel
import accel.random as R
from accel.backends import _visible

from conftest import run_forked, use_sim

# torch's eight GPU UUIDs of test_partial_uuid_resolver
TORCH_UUIDS = [
    "GPU-9942190a-aa31-4ff1-4aa9-c388d80f85f1",
    "GPU-9e8d35e3-a134-0fdd-0e01-23811fdbd293",
    "GPU-e429a63e-c61c-4795-b757-5132caeb8e70",
    "GPU-eee1dfbc-0a0f-6ad8-5ff6-dc942a8b9d98",
    "GPU-bbcd6503-5150-4e92-c266-97cc4390d04e",
    "GPU-472ea263-58d7-410d-cc82-f7fdece5bd28",
    "GPU-e56257c4-947f-6a5b-7ec9-0f45567ccf4e",
    "GPU-1c20e77d-1c1a-d9ed-fe37-18b8466a78ad",
]


def _counts_before_and_after_init(monkeypatch, visible: str, devices: int):
    """accel.device_count() on a fresh CUDA simulator with ``devices`` devices and
    CUDA_VISIBLE_DEVICES=``visible``: before the runtime starts (the NVML count, which must
    not start it, but for MIG- UUIDs: README "Device discovery", only the runtime resolves
    those) and after a device call started it.  No warning may say they disagree."""
    from accel import sim
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=devices, CUDA_VISIBLE_DEVICES=visible)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # "nvml found N ... but the initialized runtime reports M"
        before = accel.device_count()
        assert sim.state().runtime_initialized is visible.startswith("MIG-")
        if before:
            accel.Buffer(16)                  # starts the runtime (cudaGetDeviceCount)
            assert sim.state().runtime_initialized
        after = accel.device_count()
    return before, after


# =============================================== test_cuda_nvml_based_avail.py TestExtendedCUDAIsAvail
def _child_in_bad_fork() -> int:
    """TestExtendedCUDAIsAvail.in_bad_fork_test in the forked child: 10 when poisoned, 0 if not."""
    from accel import _lazy
    accel.is_available()
    return 10 if _lazy.is_in_bad_fork() else 0


@pytest.mark.parametrize("nvml_avail", [True, False])
@pytest.mark.parametrize("avoid_init", ["1", "0", None])
def test_cuda_nvml_based_avail__test_cuda_is_available(monkeypatch, avoid_init, nvml_avail):
    # torch counts with NVML (a fork stays usable) only when PYTORCH_NVML_BASED_CUDA_CHECK=1 and
    # NVML works; otherwise is_available() starts the runtime and a forked child is poisoned.
    # accel always counts with NVML when it works (README "Device discovery": the count "never
    # starts the driver"), whatever the variable says: only nvml_avail decides.  r58 ported the
    # variable-unset pair; this is torch's full 3 x 2 grid.
    from accel import sim
    if avoid_init is None:
        monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", avoid_init)
    use_sim(monkeypatch, "cuda")
    if not nvml_avail:
        sim.configure(nvml=False)     # torch: patch _device_count_nvml to return -1
    assert accel.is_available()
    assert sim.state().runtime_initialized is (not nvml_avail)
    status = run_forked(_child_in_bad_fork)
    assert status == (0 if nvml_avail else 10)


# ================================================ test_cuda_nvml_based_avail.py TestVisibleDeviceParses
ENV_VAR_CASES = [
    ("1gpu2,2ampere", [1, 2]),               # rest of the string is ignored
    ("0, 1, 2, -1, 3", [0, 1, 2]),           # negatives abort parsing
    ("0, 1, 2, 1", []),                      # double mention of an ordinal: empty set
    ("2, +3, -0, 5", [2, 3, 0, 5]),          # unary pluses and minuses
    ("one,two,3,4", []),                     # a random string first: empty set
    ("4,3,two,one", [4, 3]),                 # a random string ends the list
    ("GPU-9e8d35e3", ["GPU-9e8d35e3"]),      # GPU ids are parsed
    ("GPU-123, 2", ["GPU-123"]),             # ordinals are not included in a GPU-id set
    ("MIG-89c850dc", ["MIG-89c850dc"]),      # MIG ids are parsed
]


@pytest.mark.parametrize("value, expected", ENV_VAR_CASES, ids=[v for v, _ in ENV_VAR_CASES])
def test_cuda_nvml_based_avail__test_env_var_parsing(monkeypatch, value, expected):
    assert _visible.parse(value) == expected
    # end to end on an 8-device simulator: ordinals count up to the first one past the devices;
    # the UUID prefixes name no simulated device (the simulator has no MIG): no device
    if expected and isinstance(expected[0], int):
        count = next((i for i, o in enumerate(expected) if o >= 8), len(expected))
    else:
        count = 0
    assert _counts_before_and_after_init(monkeypatch, value, 8) == (count, count)


def test_cuda_nvml_based_avail__test_env_var_parsing_unset():
    # torch's parser reads an unset variable as "every device" (its _parse_visible_devices
    # returns list(range(raw count))); accel's parse returns the ALL marker for it
    assert _visible.parse(None) is _visible.ALL
    assert _visible.visible_ordinals(None, 3, lambda: []) == [0, 1, 2]


def test_cuda_nvml_based_avail__test_partial_uuid_resolver():
    resolve = _visible.uuids_to_ordinals
    assert resolve(["GPU-9e8d35e3"], TORCH_UUIDS) == [1]
    assert resolve(["GPU-e4", "GPU-9e8d35e3"], TORCH_UUIDS) == [2, 1]
    assert resolve("GPU-9e8d35e3,GPU-1,GPU-47".split(","), TORCH_UUIDS) == [1, 7, 5]
    # the first invalid UUID aborts parsing
    assert resolve(["GPU-123", "GPU-9e8d35e3"], TORCH_UUIDS) == []
    assert resolve(["GPU-9e8d35e3", "GPU-123", "GPU-47"], TORCH_UUIDS) == [1]
    # the first ambiguous UUID aborts parsing ("GPU-e": e429…, eee1…, e562…)
    assert resolve(["GPU-9e8d35e3", "GPU-e", "GPU-47"], TORCH_UUIDS) == [1]
    # a device named twice (GPU-9e8 is GPU-9e8d35e3 again) empties the set
    assert resolve(["GPU-9e8d35e3", "GPU-47", "GPU-9e8"], TORCH_UUIDS) == []


def test_cuda_nvml_based_avail__test_partial_uuid_resolver_on_the_simulator(monkeypatch):
    # the same rules through CUDA_VISIBLE_DEVICES on the simulator, with its devices' UUIDs
    # (the runtime's view, as a user copies it): a unique prefix selects, an unknown one ends
    from accel.sim import core
    u = [core.uuid_text(i) for i in range(4)]
    assert all(x.startswith("GPU-") for x in u)
    cases = [
        (u[2][:13], 1),                           # one device by a unique prefix
        (f"{u[3][:13]},{u[1]}", 2),               # prefix and full UUID, in that order
        (f"{u[1]},GPU-ffff,{u[0]}", 1),           # an unknown UUID ends the list
        (f"{u[1]},{u[1][:13]}", 0),               # the same device twice: empty
    ]
    for visible, count in cases:
        assert _counts_before_and_after_init(monkeypatch, visible, 4) == (count, count), visible
    # the order is the variable's: device 0 is the third physical one
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=4, CUDA_VISIBLE_DEVICES=f"{u[2]},{u[0]}")
    assert f"GPU-{accel.get_device_properties(0).uuid}" == u[2]
    assert f"GPU-{accel.get_device_properties(1).uuid}" == u[0]


def test_cuda_nvml_based_avail__test_ordinal_parse_visible_devices(monkeypatch):
    # torch: _raw_device_count_nvml patched to 2
    assert len(_visible.visible_ordinals("1, 0", 2, lambda: [])) == 2
    # an ordinal out of bounds aborts parsing
    assert len(_visible.visible_ordinals("1, 5, 0", 2, lambda: [])) == 1
    # end to end on a 2-device simulator
    assert _counts_before_and_after_init(monkeypatch, "1, 0", 2) == (2, 2)
    assert _counts_before_and_after_init(monkeypatch, "1, 5, 0", 2) == (1, 1)


# ======================================= test_cpp_extensions_stream_and_event.py TestCppExtensionStreamAndEvent
def test_cpp_extensions_stream_and_event__test_stream_event(sim_backend):
    s = accel.Stream()
    assert s.device.type == accel.current_accelerator().type
    e = accel.Event(enable_timing=True)
    e1 = accel.Event(enable_timing=True)
    e1.record()
    # an event not yet recorded has no handle: event_id 0
    assert e.event_id == 0
    s.record_event(event=e)
    assert e.event_id != 0
    assert e.device.type == accel.current_accelerator().type
    # an event made by record_event() has timing off
    e2 = s.record_event()
    assert e2.event_id != 0
    assert e2.event_id != e.event_id
    assert e2.enable_timing is False
    e.synchronize()
    e1.synchronize()
    e2.synchronize()
    assert isinstance(e.elapsed_time(e1), float)
    with pytest.raises(ValueError, match="Both events must be created with argument 'enable_timing=True'"):
        e.elapsed_time(e2)
    # recording again reuses the event's handle
    old_event_id = e.event_id
    e.record(stream=s)
    assert e.event_id == old_event_id
    s.synchronize()


# ============================= test_cpp_extensions_open_device_registration.py TestCppExtensionOpenRgistration
def test_cpp_extensions_open_device_registration__test_base_device_registration(sim_backend):
    device = accel.device(accel.current_accelerator().type, 0)
    rng = np.random.default_rng(66)
    xs, ys = (rng.standard_normal(16).astype(np.float32) for _ in range(2))
    x = accel.Buffer(xs.nbytes, device=device).copy_from(xs)
    y = accel.Buffer(ys.nbytes, device=device).copy_from(ys)
    assert x.device == device and y.device == device
    # torch's z = x + y (its custom add kernel) is a device-to-device copy here
    z = accel.Buffer(x.nbytes, device=device)
    z.copy_from(x)
    z_cpu = z.to_numpy(np.float32)
    assert z.device == device
    np.testing.assert_array_equal(z_cpu, xs)
    np.testing.assert_array_equal(y.to_numpy(np.float32), ys)


def test_cpp_extensions_open_device_registration__test_open_device_generator_registration_and_hooks(sim_backend):
    kind = accel.current_accelerator().type
    device = accel.device(kind, 0)
    gen = R.Generator(device)
    assert gen.device == device
    default_gen = R.default_generator(0)
    assert default_gen.device.type == kind
    # a device generator draws on its device: the same seed gives the same numbers
    gen.manual_seed(7)
    a = accel.Buffer(64)
    R.uniform_(a, generator=gen)
    gen.manual_seed(7)
    b = accel.Buffer(64)
    R.uniform_(b, generator=gen)
    np.testing.assert_array_equal(a.to_numpy(np.float32), b.to_numpy(np.float32))


# ================================================ test_cpp_extensions_mtia_backend.py TestCppExtensionMTIABackend
# torch runs these on a fake two-device "mtia" backend built from a C++ extension; they test the
# device-generic stream/device/generator surface, which accel has on every simulator (Metal has one
# device: the two-device parts skip there).  torch.mtia.stream(s) is ``with s:``,
# torch.mtia.device(d) ``accel.device_index(d)``, torch.mtia.default_generators[i]
# ``accel.random.default_generator(i)``.
def _need_two():
    if accel.device_count() < 2:
        pytest.skip(f"{accel.current_accelerator().type} has one device")


def test_cpp_extensions_mtia_backend__test_get_device_module(sim_backend):
    device = accel.device(accel.current_accelerator().type, 0)
    default_stream = accel.current_stream(device)
    assert default_stream.device.type == device.type
    assert default_stream.device_index == 0
    assert isinstance(default_stream, accel.Stream)


def test_cpp_extensions_mtia_backend__test_stream_basic(sim_backend):
    default_stream = accel.current_stream()
    user_stream = accel.Stream()
    assert accel.current_stream() == default_stream
    assert default_stream != user_stream
    # mtia_extension.cpp numbers the default stream 0 and torch.cuda's legacy default stream has
    # id 0 too; accel's stream_id is the native handle, so 0 where the backend has a null stream
    # (CUDA; the Metal simulator's default queue too) and the in-order queue's handle on Level Zero
    if sim_backend == "cuda":
        assert default_stream.stream_id == 0
    assert user_stream.stream_id != 0
    assert user_stream.stream_id != default_stream.stream_id
    with user_stream:
        assert accel.current_stream() == user_stream
    assert user_stream.query()
    default_stream.synchronize()
    assert default_stream.query()


def test_cpp_extensions_mtia_backend__test_stream_context(sim_backend):
    kind = accel.current_accelerator().type
    stream_0 = accel.Stream(device=f"{kind}:0")
    stream_1 = accel.Stream(device=f"{kind}:0")
    with stream_0:
        assert accel.current_stream() == stream_0
    with stream_1:
        assert accel.current_stream() == stream_1
    assert accel.current_stream() == accel.default_stream(0)


def test_cpp_extensions_mtia_backend__test_stream_context_different_device(sim_backend):
    _need_two()
    kind = accel.current_accelerator().type
    device_0, device_1 = accel.device(kind, 0), accel.device(kind, 1)
    stream_0 = accel.Stream(device=device_0)
    stream_1 = accel.Stream(device=device_1)
    orig_current_device = accel.current_device_index()
    with stream_0:
        assert accel.current_device_index() == device_0.index
        assert accel.current_stream() == stream_0
    assert accel.current_device_index() == orig_current_device
    with stream_1:
        assert accel.current_device_index() == device_1.index
        assert accel.current_stream() == stream_1
    assert accel.current_device_index() == orig_current_device


def test_cpp_extensions_mtia_backend__test_device_context(sim_backend):
    kind = accel.current_accelerator().type
    last = accel.device_count() - 1             # torch's mtia:1; device 0 on Metal
    before = accel.current_device_index()
    with accel.device_index(accel.device(kind, 0)):
        assert accel.current_device_index() == 0
    with accel.device_index(accel.device(kind, last)):
        assert accel.current_device_index() == last
    assert accel.current_device_index() == before


def test_cpp_extensions_mtia_backend__test_default_generators(sim_backend):
    accel.current_stream()                      # torch: triggers lazy initialization first
    device_count = accel.device_count()
    gens = [R.default_generator(i) for i in range(device_count)]
    assert all(isinstance(g, R.Generator) for g in gens)
    # one generator per device, the same object each time it is asked for
    assert [R.default_generator(i) for i in range(device_count)] == gens
    assert all(R.default_generator(i) is gens[i] for i in range(device_count))
    assert len({id(g) for g in gens}) == device_count
    assert [g.device.index for g in gens] == list(range(device_count))
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        R.default_generator(device_count)


def test_cpp_extensions_mtia_backend__test_new_generator(sim_backend):
    gen = R.Generator(f"{accel.current_accelerator().type}:0")
    assert isinstance(gen, R.Generator)
    assert gen is not R.default_generator(0)


# ============================================================ test/jit/test_cuda.py TestCUDA
# torch scripts (TorchScript) calls of the torch.cuda stream/event/device API and checks what they
# return; the scripting is torch-internal, the calls are the runtime surface: ported unscripted,
# on CUDA and Level Zero (two devices).  ``s.id()`` is ``stream_id``, ``Event(a, b, c)``
# ``Event(enable_timing=a, blocking=b, interprocess=c)``, a matmul a device-to-device copy.
def _copy_of(src, stream=None):
    out = accel.Buffer(src.nbytes, device=src.device, stream=stream)
    out.copy_from(src, stream=stream, non_blocking=True)
    return out


def _rand(n, device=None, seed=0):
    host = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return host, accel.Buffer(host.nbytes, device=device).copy_from(host)


def test_jit_cuda__test_cuda_synchronize(sim_graph_backend):
    kind = sim_graph_backend
    prev = accel.current_device_index()
    for target in (None, kind, f"{kind}:0", 0, accel.device(kind, 1)):
        accel.synchronize(target)
        assert accel.current_device_index() == prev
    accel.synchronize(accel.device(kind, 0))
    prev = accel.current_device_index()
    accel.synchronize(1)
    assert accel.current_device_index() == prev


def test_jit_cuda__test_stream_args(sim_graph_backend):
    kind = sim_graph_backend
    assert accel.Stream().device_index == accel.current_device_index()
    assert accel.Stream(priority=0).device_index == accel.current_device_index()
    assert accel.Stream(accel.device(kind, 1)).device_index == 1
    assert accel.Stream(accel.device(kind, 0), 0).device_index == 0


def test_jit_cuda__test_event_args(sim_graph_backend):
    assert accel.Event() is not None
    e = accel.Event(enable_timing=True, blocking=False, interprocess=False)
    assert e.enable_timing and not e.blocking


def test_jit_cuda__test_current_stream(sim_graph_backend):
    kind = sim_graph_backend
    device_index = accel.current_device_index()
    s0 = accel.current_stream(accel.device(kind, device_index))
    s1 = accel.current_stream(accel.device(kind, 1))
    s2 = accel.current_stream(accel.device(kind, 0))
    assert (s0.device_index, s1.device_index, s2.device_index) == (0, 1, 0)
    s0 = accel.current_stream(device_index)
    s1 = accel.current_stream(1)
    s2 = accel.current_stream(0)
    assert (s0.device_index, s1.device_index, s2.device_index) == (0, 1, 0)
    assert s0 == s2


def test_jit_cuda__test_streams_and_events(sim_graph_backend):
    kind = sim_graph_backend
    d0, d1 = accel.device(kind, 0), accel.device(kind, 1)
    # default streams by index and by device; the current stream is the default one
    assert (accel.default_stream(0).device_index, accel.default_stream(1).device_index) == (0, 1)
    s0, s1 = accel.default_stream(d0), accel.default_stream(d1)
    s2 = accel.current_stream(d0)
    assert s2.stream_id == s0.stream_id and accel.current_device_index() == s2.device_index
    with accel.device_index(d1):
        s3 = accel.current_stream(d1)
        assert s3.stream_id == s1.stream_id and accel.current_device_index() == s3.device_index
    assert accel.current_device_index() == s2.device_index
    # a device context of None is a no-op
    with accel.device_index(None):
        assert accel.current_device_index() == 0
    # a new stream is on the current device
    assert accel.Stream().device_index == accel.current_device_index()

    # test_get_stream: current == default, user stream differs, the context sets and resets it
    current_stream, default_stream = accel.current_stream(d0), accel.default_stream(d0)
    user_stream = accel.Stream()
    assert current_stream.stream_id == default_stream.stream_id
    assert default_stream.stream_id != user_stream.stream_id
    with user_stream:
        assert accel.current_stream(d0).stream_id == user_stream.stream_id
    assert accel.current_stream(d0).stream_id == current_stream.stream_id
    host1, t1 = _rand(10000)
    t2 = _copy_of(t1)
    default_stream.synchronize()
    assert default_stream.query()
    np.testing.assert_array_equal(t2.to_numpy(np.float32), host1)
    if kind == "cuda":                   # the legacy default stream is id 0 (Level Zero: a queue handle)
        assert default_stream.stream_id == 0
    assert user_stream.stream_id != 0

    # test_multiple_stream: nested streams on two devices set and restore stream and device
    prev_device_index = accel.current_device_index()
    prev_current_stream = accel.current_stream(d0)
    st1, st2 = accel.Stream(d0, 0), accel.Stream(d1, 0)
    host_a, a = _rand(1000, seed=1)
    host_b, b = _rand(1000, device=1, seed=2)
    with st1:
        c = _copy_of(a, st1)
        assert accel.current_stream(d0).stream_id == st1.stream_id
        assert accel.current_device_index() == st1.device_index
        with st2:
            assert accel.current_stream(d1).stream_id == st2.stream_id
            assert accel.current_device_index() == st2.device_index
            d = _copy_of(b, st2)
        assert accel.current_stream(d0).stream_id == st1.stream_id
        assert accel.current_device_index() == st1.device_index
        st2.synchronize()
    st1.synchronize()
    assert accel.current_device_index() == prev_device_index
    assert accel.current_stream(d0).stream_id == prev_current_stream.stream_id
    np.testing.assert_array_equal(c.to_numpy(np.float32), host_a)
    np.testing.assert_array_equal(d.to_numpy(np.float32), host_b)

    # test_data_dependency_between_streams: s2 waits on s1's event before it reads s1's output
    sa, sb = accel.Stream(d0, 0), accel.Stream(d0, 0)
    event = accel.Event(enable_timing=False, blocking=False, interprocess=False)
    sa.wait_stream(accel.current_stream())
    with sa:
        bb = _copy_of(a, sa)
    sa.record_event(event)
    assert accel.current_stream(d0).stream_id == prev_current_stream.stream_id
    sb.wait_event(event)
    with sb:
        cc = _copy_of(bb, sb)
    sb.synchronize()
    np.testing.assert_array_equal(cc.to_numpy(np.float32), host_a)

    # test_event / test_stream_synchronize / test_event_synchronize / test_event_wait
    stream = accel.current_stream(d0)
    ev = accel.Event(enable_timing=True)
    assert ev.query()
    start = accel.Event(enable_timing=True)
    stream.record_event(start)
    _copy_of(a)
    stream.record_event(ev)
    ev.synchronize()
    assert ev.query() and start.elapsed_time(ev) >= 0
    s = accel.Stream()
    tik, tok = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    tik.record(s)
    with s:
        _copy_of(a, s)
    s.record_event(tok)
    tok.synchronize()
    s.synchronize()
    assert s.query() and tik.elapsed_time(tok) >= 0
    s0c, s1n = accel.current_stream(d0), accel.Stream()
    tik, tok = accel.Event(enable_timing=True, blocking=True), accel.Event(enable_timing=True, blocking=True)
    tik.record(s0c)
    e_sync = accel.Event(enable_timing=True)
    e_sync.record(accel.current_stream(d0))
    e_sync.wait(s1n)
    with s1n:
        _copy_of(a, s1n)
    s1n.synchronize()
    tok.record(accel.current_stream(d0))
    tok.synchronize()
    s0c.synchronize()
    assert s0c.query() and s1n.query() and e_sync.query()
    assert tik.elapsed_time(tok) >= 0

    # test_wait_event: device 0's stream waits on an event recorded on device 1
    with accel.device_index(d1):
        s_d1 = accel.current_stream(d1)
        _copy_of(b)
        e0 = accel.Event()
        s_d1.record_event(e0)
    s_d0 = accel.current_stream(d0)
    s_d0.wait_event(e0)
    s_d0.synchronize()
    assert e0.query() and s_d1.query() and s_d0.query()
