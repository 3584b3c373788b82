"""Realistic user programs, fourth round (r42).

Rounds one to three (test_user_programs.py, test_user_programs2.py, test_user_programs_r41.py,
test_examples.py) took streams, events, graphs, MemPools, OOM, fork and threads.  These take what
they left: accel.random (generators, checkpoints, graph-safe draws replayed), DLPack/CAI keyword
combinations and read-only imports, user kernels from threads and captures, events across
devices and dropped streams, and the environment (visible devices, ACCEL_ALLOC_CONF) in fresh
interpreters.
"""

import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import accel
from accel import _dlpack
from test_user_programs import _devices, allocated, join_all, settle

R = accel.random


def _read_only_import(src: "accel.Buffer") -> "accel.Buffer":
    """What a producer of immutable arrays hands over: a versioned capsule flagged read-only."""
    cap = src.as_array(np.float32).__dlpack__(max_version=(1, 0))
    info = _dlpack.parse(cap)
    _dlpack.DLManagedTensorVersioned.from_address(info.address).flags |= _dlpack.FLAG_READ_ONLY
    return accel.from_dlpack(cap)


# -- 1. random fills into read-only memory -------------------------------------------------------
@pytest.mark.parametrize("fill", ["uniform_", "normal_", "randint_", "random_raw_"])
def test_random_fill_refuses_a_read_only_import(sim_backend, fill):
    """A user imports a read-only array (DLPack read-only flag) and, by mistake, fills it with
    random numbers: refused as fill_/copy_from refuse it, the producer's memory unchanged and
    the generator not advanced.  (The fills wrote into the read-only memory.)"""
    dev = _devices()[-1]
    data = np.arange(16, dtype=np.float32)
    src = accel.Buffer(data.nbytes, device=dev).copy_from(data)
    ro = _read_only_import(src)
    assert ro.readonly
    gen = R.Generator(dev, seed=3)
    args = {"randint_": (0, 5), }.get(fill, ())
    kw = {"dtype": "int32"} if fill == "randint_" else {}
    with pytest.raises(ValueError, match="read-only"):
        getattr(R, fill)(ro, *args, generator=gen, **kw)
    with pytest.raises(ValueError, match="read-only"):
        getattr(R, fill)(ro, *args, **kw)
    assert gen.offset == 0
    assert (src.to_numpy(np.float32) == data).all()
    del ro, src
    settle()


# -- 2. a generator run to the end of its offsets ------------------------------------------------
def test_generator_exhausted_offset_is_not_a_capture_error(sim_backend):
    """A long job sets a generator's offset near 2**63 (a checkpoint of a huge run) and draws:
    the refusal is a plain RuntimeError asking to reseed -- not accel.CaptureError, which says
    "illegal while a stream is being captured" when nothing captures -- and the generator then
    works after a reseed.  (It was raised as CaptureError.)"""
    dev = _devices()[-1]
    gen = R.Generator(dev, seed=1)
    gen.set_offset(2 ** 63 - 8)
    buf = accel.Buffer(4 * 64, device=dev)
    with pytest.raises(RuntimeError, match="reseed") as info:
        R.uniform_(buf, generator=gen)
    assert not isinstance(info.value, accel.CaptureError), repr(info.value)
    assert gen.offset == 2 ** 63 - 8
    default = R.default_generator(dev)
    saved = R.get_rng_state(dev)
    default.set_offset(2 ** 63 - 4)
    with pytest.raises(RuntimeError, match="reseed") as info:
        R.random_raw_(buf)
    assert not isinstance(info.value, accel.CaptureError), repr(info.value)
    R.set_rng_state(saved, dev)
    gen.manual_seed(1)
    R.uniform_(buf, generator=gen)
    assert gen.offset == 64


# -- 3. a __cuda_array_interface__ source on another device into a typed view -------------------
class _Foreign:
    """Another library's array over device memory (CuPy's cupy.asarray(view) looks like this)."""

    def __init__(self, cai: dict):
        self.__cuda_array_interface__ = cai


def test_view_copy_from_a_cai_array_of_another_device(sim_cuda):
    """A user wraps device 1's data in another library's array (CAI v3) and copies it into a typed
    view on device 0: refused with a clear error, as a view, Buffer or DLPack source of another
    device is, and both devices keep working; Buffer.copy_from (which copies between devices)
    takes the same source.  (The view queued the copy on device 0 reading device 1's memory
    without access: cudaErrorIllegalAddress, sticky -- every later call failed.)"""
    data = np.arange(64, dtype=np.float32)
    src = accel.Buffer(data.nbytes, device=1).copy_from(data)
    foreign = _Foreign(src.as_array(np.float32, (8, 8)).__cuda_array_interface__)
    strided = _Foreign(src.as_array(np.float32, (8, 4), strides=(32, 8)).__cuda_array_interface__)
    dst = accel.Buffer(data.nbytes, device=0)
    with pytest.raises(ValueError, match="device") as info:
        dst.as_array(np.float32, (8, 8)).copy_from(foreign)
    assert "cuda:1" in str(info.value) and "nothing was copied" in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="device"):
        dst.as_array(np.float32, (8, 4)).copy_from(strided)
    assert (dst.fill_(0).to_numpy(np.float32) == 0).all()        # device 0 still works
    dst.copy_from(foreign)                                      # the Buffer path copies across
    assert (dst.to_numpy(np.float32) == data).all()
    mine = accel.Buffer(data.nbytes, device=1)
    mine.as_array(np.float32, (8, 4)).copy_from(strided)        # same device: a strided copy
    assert (mine.to_numpy(np.float32)[:32] == data.reshape(8, 8)[:, ::2].ravel()).all()
    del src, dst, mine, foreign, strided, info
    settle()
    assert allocated() == (0, 0)


# -- 4. graph-safe RNG: replays against eager draws (passing program) ---------------------------
def test_captured_draws_replay_as_eager_draws_at_the_same_state(sim_graph_backend):
    """A user checks a captured dropout mask against eager code: with the same RNG state the
    replay draws what eager fills draw; each replay moves on; set_rng_state before a replay
    reproduces it, from another thread or with another device current; an eager fill from
    another thread during the capture takes eager numbers; a capture that raised leaves the
    generator out of graph-safe mode with its holders freed.  Level Zero refuses captured fills
    (no kernel) with CaptureError and nothing changes."""
    last = _devices()[-1]
    gen = R.default_generator(last)
    R.manual_seed_all(5)
    out, out2 = accel.Buffer(4 * 256, device=last), accel.Buffer(8 * 64, device=last)
    s, g = accel.Stream(last), accel.Graph()
    if sim_graph_backend == "xpu":
        with pytest.raises(accel.CaptureError, match="cannot be captured"):
            with accel.device_index(last), s, g:
                R.uniform_(out)
        assert not gen.capturing and gen.offset == 0 and not accel.is_current_stream_capturing()
        R.uniform_(out)
        assert gen.offset == 256
        return
    with pytest.raises(KeyError):
        with accel.device_index(last), s, accel.Graph():
            R.uniform_(out)
            raise KeyError("model code failed")
    gc.collect()
    assert not gen.capturing and gen.offset == 0 and not gen._holders
    ref, started, done = {}, threading.Event(), threading.Event()

    def eager_neighbour():
        started.wait(30)
        with accel.device_index(last):
            ref["buf"] = R.uniform_(accel.Buffer(4 * 256, device=last, stream=accel.Stream(last)))
        done.set()

    t = threading.Thread(target=eager_neighbour)
    t.start()
    with accel.device_index(last), s, g:
        R.uniform_(out)
        R.normal_(out2, dtype="float64")
        started.set()
        done.wait(30)
    join_all([t])
    assert gen.offset == 256                   # the neighbour's eager draw; the capture took none
    state = R.get_rng_state(last)
    g.replay()
    first, first2 = out.to_numpy(np.float32), out2.to_numpy(np.float64)
    R.set_rng_state(state, last)
    with accel.device_index(last):
        R.uniform_(out)
        R.normal_(out2, dtype="float64")
    assert (out.to_numpy(np.float32) == first).all() and np.allclose(out2.to_numpy(np.float64), first2)
    g.replay()
    assert not (out.to_numpy(np.float32) == first).all()
    R.set_rng_state(state, last)
    with accel.device_index(0):
        g.replay()
    assert (out.to_numpy(np.float32) == first).all()
    R.set_rng_state(state, last)
    t = threading.Thread(target=g.replay)
    t.start()
    join_all([t])
    accel.synchronize(last)
    assert (out.to_numpy(np.float32) == first).all()
    R.manual_seed_all(5)
    assert (ref["buf"].to_numpy(np.float32) == R.uniform_(accel.Buffer(4 * 256, device=last)).to_numpy(np.float32)).all()
    ref.clear()
    del g
    gc.collect()
    assert not gen._holders and gen._graphs == 0
    settle()


# -- 5. DLPack keyword combinations and capsule lifetimes (passing program) --------------------
def test_dlpack_keywords_capsules_and_closed_exports(sim_backend):
    """The DLPack 1.x producer rules as a consumer library exercises them: max_version picks
    the capsule kind, dl_device/copy per the array API standard, stream values per backend, a
    capsule taken once, a capsule outliving the buffer's close(), and every export released."""
    last = _devices()[-1]
    data = np.arange(64, dtype=np.float32)
    buf = accel.Buffer(data.nbytes, device=last).copy_from(data)
    view = buf.as_array(np.float32, (8, 4), strides=(32, 8), offset=4)
    own = view.__dlpack_device__()
    base = _dlpack.live_exports()
    assert _dlpack.parse(view.__dlpack__(max_version=(1, 0))).versioned
    assert _dlpack.parse(view.__dlpack__(max_version=(2, 3))).versioned
    assert not _dlpack.parse(view.__dlpack__(max_version=(0, 8))).versioned
    assert not _dlpack.parse(view.__dlpack__()).versioned
    view.__dlpack__(dl_device=own, copy=False)
    assert _dlpack.parse(view.__dlpack__(dl_device=(1, 0))).device_type == 1    # a host copy (r80b, session 39)
    with pytest.raises(ValueError, match="copy=False"):
        view.__dlpack__(dl_device=(1, 0), copy=False)
    copied = _dlpack.parse(view.__dlpack__(copy=True))                           # a device copy (r80b)
    assert copied.shape == (8, 4) and copied.data != view.ptr
    del copied
    with pytest.raises(TypeError, match="copy must be"):
        view.__dlpack__(copy=1)
    with pytest.raises(TypeError, match="max_version"):
        view.__dlpack__(max_version=1)
    view.__dlpack__(stream=-1)
    view.__dlpack__(stream=accel.Stream(0))             # an accel stream of any device
    if sim_backend == "cuda":
        view.__dlpack__(stream=2)
        with pytest.raises(ValueError, match="disallowed"):
            view.__dlpack__(stream=0)
    else:
        with pytest.raises(ValueError, match="-1"):
            view.__dlpack__(stream=2)
    cap = view.__dlpack__(max_version=(1, 0))
    got = accel.from_dlpack(cap)
    assert got.ptr == view.ptr and got.device_index == last
    with pytest.raises(BufferError, match="already consumed"):
        accel.from_dlpack(cap)
    assert (got.as_array(np.float32, (8, 4), strides=(32, 8)).to_numpy() == view.to_numpy()).all()
    other = accel.Buffer(256, device=0)
    late = other.__dlpack__()
    other.close()                                       # the capsule keeps the memory
    with pytest.raises(RuntimeError, match="closed"):
        other.__dlpack__()
    kept = accel.from_dlpack(late)
    kept.fill_(3)
    assert (kept.to_numpy() == 3).all()
    closed_view = accel.Buffer(64).as_array(np.uint8)
    closed_view._buffer.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed_view.__dlpack__()
    del got, cap, kept, late, closed_view
    gc.collect()
    assert _dlpack.live_exports() == base
    del view, buf, other
    settle()
    assert allocated() == tuple(0 for _ in _devices())


# -- 6. events across devices and after their stream went (passing program) --------------------
def test_events_across_devices_and_dropped_streams(sim_backend):
    """A pipeline records on device 1 and waits on device 0; times with events; drops streams
    before their events: elapsed_time refuses mixed devices, unrecorded and non-timing events
    with torch's words; an event of a dropped stream still queries and synchronizes."""
    devs = _devices()
    last = devs[-1]
    a, b = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    with pytest.raises(ValueError, match="recorded"):
        a.elapsed_time(b)
    a.record()
    b.record()
    b.synchronize()
    assert a.elapsed_time(b) >= 0 and a.elapsed_time(a) == 0
    plain = accel.Event()
    plain.record()
    with pytest.raises(ValueError, match="enable_timing"):
        a.elapsed_time(plain)
    s = accel.Stream(last)
    work = accel.Buffer(1 << 16, device=last)
    with s:
        work.fill_(7)
    done = s.record_event()
    del s
    gc.collect()
    if len(devs) > 1:
        t1 = accel.Event(enable_timing=True)
        t1.record(accel.Stream(1))
        t1.synchronize()
        with pytest.raises(accel.InvalidDeviceError, match="one device"):
            a.elapsed_time(t1)
        s0 = accel.Stream(0)
        s0.wait_event(done)
        with pytest.raises(accel.InvalidDeviceError, match="device 1"):
            done.record(s0)
        mirror = accel.Buffer(1 << 16, device=0)
        with s0:
            mirror.copy_from(work, non_blocking=True)
        s0.synchronize()
        assert (mirror.to_numpy() == 7).all()
        del mirror, s0
    done.synchronize()
    assert done.query()
    closed = accel.Stream(last)
    ev = accel.Event()
    ev.record(closed)
    closed.close()
    assert ev.query()
    with pytest.raises(RuntimeError, match="closed"):
        ev.record(closed)
    del work
    settle()


# -- 7. visible devices and allocator options in fresh interpreters (passing program) ----------
_ENV_PROGRAM = r'''
import os, accel
kind = accel.current_accelerator().type
print("count", accel.device_count())
print("uuids", ",".join(str(accel.get_device_properties(i).uuid) for i in range(accel.device_count())))
try:
    accel.Buffer(1 << 20)
    print("alloc ok")
except RuntimeError as exc:        # torch raises RuntimeError for a bad PYTORCH_CUDA_ALLOC_CONF
    print("alloc error", type(exc).__name__, exc)
    os.environ["ACCEL_ALLOC_CONF"] = "max_split_size_mb:64"      # fixed: the next allocation reads it
    accel.Buffer(1 << 20, device=accel.device_count() - 1).fill_(1)
    print("fixed ok")
'''


def _fresh(env: dict) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "ZE_", "PYTORCH_"))}
    base.update(ACCEL_SIM_DEVICES="2", **env)
    done = subprocess.run([sys.executable, "-c", _ENV_PROGRAM], env=base, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def test_visible_devices_and_alloc_conf_in_fresh_interpreters():
    """A launcher starts workers with CUDA_VISIBLE_DEVICES=1,0 / ZE_AFFINITY_MASK=1 and a typo in
    ACCEL_ALLOC_CONF: the devices come in the order (and number) asked for, the bad option is
    named in the error, and the process goes on once the variable is fixed."""
    both = _fresh({"ACCEL_SIM": "cuda"})["uuids"].split(",")
    swapped = _fresh({"ACCEL_SIM": "cuda", "CUDA_VISIBLE_DEVICES": "1,0",
                      "ACCEL_ALLOC_CONF": "max_split_size_mb:lots"})
    assert swapped["uuids"].split(",") == both[::-1]
    assert "max_split_size_mb" in swapped["alloc"] and "lots" in swapped["alloc"]
    assert swapped["fixed"] == "ok"
    xpu = _fresh({"ACCEL_SIM": "xpu", "ZE_AFFINITY_MASK": "1", "ACCEL_ALLOC_CONF": "expandable_segments:maybe"})
    assert xpu["count"] == "1" and "expandable_segments" in xpu["alloc"] and xpu["fixed"] == "ok"


# -- 8. one kernel per device, launched from threads and into a capture (passing program) ------
def test_kernels_built_once_used_from_threads_and_captures(sim_backend):
    """A module loaded once per device, its kernel launched from several threads on their own
    streams of both devices, a bad launch (wrong argument count, zero grid) refused without
    queuing anything, and the kernel captured on the non-current device and replayed."""
    from accel import sim
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    try:
        image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy")}[sim_backend]
        sig = None if sim_backend == "cuda" else "f32, ptr, ptr, u64"
        devs = _devices()
        kernels = [accel.Module(image, device=d).function("saxpy", sig) for d in devs]
        n = 1000
        x, y = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
        results, errors = [], []

        def worker(d):
            try:
                bx = accel.Buffer(4 * n, device=d).copy_from(x)
                by = accel.Buffer(4 * n, device=d).copy_from(y)
                s = accel.Stream(d)
                for _ in range(5):
                    accel.launch(kernels[d], (n + 255) // 256, 256, 1.0, bx, by, n, stream=s)
                s.synchronize()
                results.append(by.to_numpy(np.float32))
            except BaseException as exc:     # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(d,)) for d in devs for _ in range(3)]
        for t in threads:
            t.start()
        join_all(threads)
        assert not errors, errors[0]
        assert len(results) == 3 * len(devs) and all((r == y + 5 * x).all() for r in results)
        last = devs[-1]
        bx = accel.Buffer(4 * n, device=last).copy_from(x)
        by = accel.Buffer(4 * n, device=last).copy_from(y)
        with pytest.raises(TypeError, match="4 argument"):
            accel.launch(kernels[last], 4, 256, 2.0, bx, by)
        with pytest.raises(ValueError, match="grid"):
            accel.launch(kernels[last], 0, 256, 2.0, bx, by, n)
        if sim_backend != "mps":
            s, g = accel.Stream(last), accel.Graph()
            with s, g:
                with pytest.raises(TypeError, match="4 argument"):
                    accel.launch(kernels[last], 4, 256, 2.0, bx, by)
                accel.launch(kernels[last], (n + 255) // 256, 256, 2.0, bx, by, n)
            assert accel.current_device_index() == 0
            for _ in range(3):
                g.replay()
            accel.synchronize(last)
            assert (by.to_numpy(np.float32) == y + 6 * x).all()
            del g, s
        kernels.clear()
        del bx, by
        settle()
    finally:
        sim.unregister_kernel("saxpy")
