"""Buffer(nbytes) and close() take a shorter path in the common case (r25: the current stream's
handle read inline, the allocator kept on the buffer, close() freeing straight into the allocator
when no collection runs, nothing is deferred and the runtime is the live one).  Each test here
drives one of the cases that path must hand back to the general one, and checks the guarantee
it keeps: bad input refused with nothing allocated, a closed stream refused, a close during a
collection deferred, a stale runtime's memory never freed into the new one."""

import threading

import numpy as np
import pytest

import accel
from accel import _finalize, _lazy
from accel.memory import memory_allocated
from conftest import pretend_collection, pretend_collection_ends, use_sim

MiB = 1 << 20


@pytest.mark.parametrize("bad, error, words", [
    (True, TypeError, "nbytes must be an int, got bool"),
    (1.5, TypeError, "nbytes must be an int, got float"),
    ("16", TypeError, "nbytes must be an int, got str"),
    (-1, ValueError, "nbytes must be >= 0, got -1"),
])
def test_bad_sizes_are_refused_with_nothing_allocated(sim_backend, bad, error, words):
    with pytest.raises(error, match=words):
        accel.Buffer(bad)
    assert memory_allocated(0) == 0


def test_an_index_integer_size_is_taken(sim_backend):
    with accel.Buffer(np.int64(MiB)) as buf:
        assert buf.nbytes == MiB and memory_allocated(0) == MiB
    assert memory_allocated(0) == 0


@pytest.mark.parametrize("dev, error", [(7, ValueError), (-1, ValueError), ("cpu", ValueError),
                                        (1.0, TypeError), (True, TypeError)])
def test_bad_devices_are_refused_with_nothing_allocated(sim_cuda, dev, error):
    with pytest.raises(error):
        accel.Buffer(MiB, device=dev)
    assert memory_allocated(0) == memory_allocated(1) == 0


def test_a_device_argument_picks_that_devices_current_stream_and_allocator(sim_backend):
    if accel.device_count() < 2:
        pytest.skip(f"{sim_backend} simulates one device")
    assert accel.current_device_index() == 0
    for dev in (1, "%s:1" % sim_backend, accel.device(sim_backend, 1)):
        buf = accel.Buffer(MiB, device=dev)
        assert buf.device_index == 1 and buf.stream is accel.current_stream(1)
        assert memory_allocated(1) == MiB and memory_allocated(0) == 0
        buf.close()
    assert memory_allocated(1) == 0


def test_a_current_stream_another_thread_closed_is_refused(sim_cuda):
    """The handle is read inline; a stream closed by another thread (still this thread's current
    stream) is refused as stream.handle refuses it, with nothing allocated."""
    s = accel.Stream()
    accel.set_stream(s)
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join()
    assert s.closed and accel.current_stream() is s
    with pytest.raises(RuntimeError, match="was closed"):
        accel.Buffer(MiB)
    assert memory_allocated(0) == 0
    accel.Buffer(0).close()     # nothing to allocate: the stream is not used (as before)


def test_a_close_during_a_collection_on_this_thread_waits_for_a_safe_point(sim_cuda, monkeypatch):
    buf = accel.Buffer(MiB)
    pretend_collection(monkeypatch)         # as gc.callbacks "start"
    buf.close()
    assert buf._closed and len(_finalize.pending) == 1
    assert memory_allocated(0) == MiB       # (stats do not drain while a collection runs)
    pretend_collection_ends(monkeypatch)    # "stop"
    other = accel.Buffer(MiB)               # the allocator drains the deferred free first
    assert not _finalize.pending and memory_allocated(0) == MiB
    other.close()
    assert memory_allocated(0) == 0


def test_a_close_while_releases_wait_runs_them_first(sim_cuda, monkeypatch):
    first, second = accel.Buffer(MiB), accel.Buffer(MiB)
    pretend_collection(monkeypatch)
    first.close()
    assert len(_finalize.pending) == 1 and memory_allocated(0) == 2 * MiB
    pretend_collection_ends(monkeypatch)
    second.close()                          # (stats drain too: nothing read before the close)
    assert not _finalize.pending
    assert memory_allocated(0) == 0


def test_a_close_while_another_thread_collects_runs_at_once(sim_cuda, monkeypatch):
    buf = accel.Buffer(MiB)
    pretend_collection(monkeypatch, here=False)     # some other thread's collection
    buf.close()
    assert not _finalize.pending and memory_allocated(0) == 0


@pytest.mark.parametrize("how", ["close", "del"])
def test_a_stale_runtimes_buffer_frees_nothing_in_the_new_one(monkeypatch, how):
    use_sim(monkeypatch, "cuda")
    old = accel.Buffer(MiB)
    old_ptr = old._ptr
    use_sim(monkeypatch, "cuda")            # a new runtime: addresses start over
    new = accel.Buffer(MiB)
    assert new.ptr == old_ptr
    if how == "close":
        old.close()
    else:
        del old
    assert memory_allocated(0) == MiB and not _finalize.pending
    new.fill_(7)
    new.close()
    assert memory_allocated(0) == 0


def test_a_dropped_buffer_goes_back_at_once(sim_backend):
    for _ in range(3):
        accel.Buffer(MiB)
        assert memory_allocated(0) == 0
    buf = accel.Buffer(MiB)
    del buf
    assert memory_allocated(0) == 0 and not _finalize.pending
    assert _lazy.is_initialized()
