"""Races found by rerunning timing-sensitive test files under load (r63g), made deterministic.

tests/test_pressure_programs_r62l.py::test_two_threads_train_on_two_devices[xpu-default] failed
about 1 run in 10 with the GIL switched every 10 us (sys.setswitchinterval(1e-5)):
``IndexError: list index out of range`` from a worker thread's ``grad.copy_from(...)`` on device 0,
raised in XpuBackend._vmm_mapped_at (accel/backends/xpu/vmm.py) while the other thread's
allocator unmapped an expandable segment of device 1.

The Level Zero backend's table of mapped virtual memory (``_vmm_state["bases"]``, a sorted list
shared by every device) is changed under the backend's lock (vmm_map, vmm_unmap,
_vmm_forget_mapping), but its two readers, ``_vmm_mapped_at`` (every copy: memcpy_async ->
_usm) and ``_vmm_device_at`` (pointer_location), read it without the lock: a bisect, then
``bases[i]``.  When another thread removes a mapping between the two, ``i`` can be past the
end of the shorter list (IndexError out of a valid copy), or name a different mapping.

The tests below replay that interleaving deterministically: the reader's bisect is wrapped so
that, for the one pointer the test watches, another thread closes a device-1 buffer and
empties the cache (the allocator unmaps its segment, under the backend's lock, as in the
pressure test) before the reader goes on.  They were strict xfails (IndexError) until commit
41351cc made both readers take the lock; a reader holding the lock cannot see the unmap there,
so the replay then only checks that the copy and the location are right.
"""

from __future__ import annotations

import sys
import threading
import types

import numpy as np

import accel
from accel import _lazy, memory

from conftest import use_sim

MiB = 1 << 20


def _unmap_between_bisect_and_index(monkeypatch, reader: str, ptr: int, unmap) -> list:
    """Wrap the bisect the XPU VMM table's ``reader`` makes: on the main thread's first call for
    ``ptr``, run ``unmap`` in another thread to its end, then return the index computed
    before.  Returns the list the other thread's exceptions go to."""
    from accel.backends.xpu import vmm
    real = vmm.bisect
    main = threading.get_ident()
    fired, errors = [], []

    def bisect_right(seq, x, *args, **kw):
        i = real.bisect_right(seq, x, *args, **kw)
        if (not fired and x == ptr and threading.get_ident() == main
                and reader in (sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name)):
            # (the reader, or the lookup it calls: _vmm_mapping_at)
            lock = _lazy.lazy_init()._lock
            if lock._is_owned():
                # a reader that holds the lock (a fix) cannot see an unmap here: nothing to replay
                fired.append("reader holds the lock")
                return i
            fired.append("replayed")

            def other():
                try:
                    unmap()
                except BaseException as exc:   # reported by the test
                    errors.append(exc)
            t = threading.Thread(target=other)
            t.start()
            t.join(30)
            assert not t.is_alive(), "the unmapping thread hung"
        return i

    shim = types.SimpleNamespace(**{name: getattr(real, name) for name in dir(real) if not name.startswith("__")})
    shim.bisect_right = bisect_right
    monkeypatch.setattr(vmm, "bisect", shim)
    return errors, fired


def _two_segments():
    """A buffer on device 0 whose mapping is the table's last (highest base) and one on device 1
    below it; each is its own expandable segment."""
    a = accel.Buffer(MiB, device=0)
    b = accel.Buffer(MiB, device=1)
    t = _lazy.lazy_init().__dict__.get("_vmm_state")
    assert t is not None and len(t["bases"]) >= 2, "the XPU simulator's default allocator maps virtual memory"
    if t["bases"][-1] > a._ptr:          # the layout this replay needs: a in the highest mapping
        a, b = b, a
    assert t["bases"][-1] <= a._ptr and b._ptr < t["bases"][-1]
    return a, b


def _close_and_empty(buf):
    def unmap():
        buf.close()
        memory.empty_cache()             # the allocator unmaps the freed segment (backend lock held)
    return unmap


def test_a_copy_while_another_thread_unmaps_a_segment(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=2)
    a, b = _two_segments()
    errors, fired = _unmap_between_bisect_and_index(monkeypatch, "_vmm_mapped_at", a._ptr, _close_and_empty(b))
    data = np.arange(MiB // 4, dtype=np.float32)
    a.copy_from(data)                    # a's own mapping stays mapped throughout
    assert fired and not errors, errors
    assert a.to_numpy(np.float32).tobytes() == data.tobytes()
    a.close()
    memory.empty_cache()


def test_pointer_location_while_another_thread_unmaps_a_segment(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=2)
    a, b = _two_segments()
    be = _lazy.lazy_init()
    errors, fired = _unmap_between_bisect_and_index(monkeypatch, "_vmm_device_at", a._ptr, _close_and_empty(b))
    assert be.pointer_location(a._ptr) == ("device", a.device_index)
    assert fired and not errors, errors
    a.close()
    memory.empty_cache()


def test_the_replay_changes_nothing_when_no_thread_unmaps(monkeypatch):
    """The same wrapped bisect with an ``unmap`` that does nothing: the copy and the location
    are right (the two tests above differ only by the other thread's unmap)."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=2)
    a, b = _two_segments()
    be = _lazy.lazy_init()
    errors, fired = _unmap_between_bisect_and_index(monkeypatch, "_vmm_mapped_at", a._ptr, lambda: None)
    data = np.arange(MiB // 4, dtype=np.float32)
    a.copy_from(data)
    assert fired and not errors
    assert a.to_numpy(np.float32).tobytes() == data.tobytes()
    assert be.pointer_location(a._ptr) == ("device", a.device_index)
    a.close()
    b.close()
    memory.empty_cache()
