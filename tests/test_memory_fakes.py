"""A tiny in-memory Backend for allocator tests (no simulator, no device).

Device memory is an address space with a capacity; events complete only
when the test says so (``complete_events``) unless ``auto_complete`` is set,
so stream-ordered reuse can be checked deterministically.  ``fail_allocs``
makes the next N ``mem_alloc`` calls raise OutOfMemoryError.
"""

from __future__ import annotations

import itertools
import random
import threading

from accel._errors import OutOfMemoryError
from accel.backends.base import Backend, DeviceProperties


class FakeBackend(Backend):
    name = "cuda"

    def __init__(self, capacity=1 << 34, devices=2):
        self.capacity = capacity
        self.devices = devices
        self.live = {}              # ptr -> size
        self.host_live = {}
        self.used = 0
        self._next = itertools.count(0x7F0000000000, 1 << 30)  # segments never adjacent
        self._ids = itertools.count(1)
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.events = {}            # event -> completed?
        self.auto_complete = False
        self.fail_allocs = 0
        self.alloc_calls = 0
        self.free_calls = 0
        self.event_syncs = 0

    # discovery
    def count(self):
        return self.devices

    def report(self):
        return {"fake": True}

    def init(self):
        pass

    def properties(self, index):
        return DeviceProperties(index, "fake", self.capacity, (9, 0), 1, frozenset({"float32"}))

    def set_device(self, index):
        self._tls.device = index

    def get_device(self):
        return getattr(self._tls, "device", 0)

    def device_synchronize(self):
        self.complete_events()

    def mem_info(self):
        return self.capacity - self.used, self.capacity

    # memory
    def mem_alloc(self, nbytes):
        with self._lock:
            self.alloc_calls += 1
            if self.fail_allocs:
                self.fail_allocs -= 1
                raise OutOfMemoryError("fake: injected OOM")
            if self.used + nbytes > self.capacity:
                raise OutOfMemoryError(f"fake: out of memory allocating {nbytes}")
            ptr = next(self._next)
            self.live[ptr] = nbytes
            self.used += nbytes
            return ptr

    def mem_free(self, ptr):
        with self._lock:
            self.free_calls += 1
            self.used -= self.live.pop(ptr)

    def host_alloc(self, nbytes):
        ptr = next(self._next)
        self.host_live[ptr] = nbytes
        return ptr

    def host_free(self, ptr):
        del self.host_live[ptr]

    # streams and events
    def stream_create(self, priority=0):
        return next(self._ids)

    def stream_destroy(self, stream):
        pass

    def default_stream(self, index):
        return 0

    def stream_synchronize(self, stream):
        self.complete_events()

    def stream_query(self, stream):
        # The fake queues no work: a test's stream is taken to have work in flight (what the
        # allocator must then wait for through events) unless events complete by themselves
        return self.auto_complete

    def stream_wait_event(self, stream, event):
        pass

    def event_create(self, enable_timing=False, blocking=False):
        event = next(self._ids)
        self.events[event] = True
        return event

    def event_destroy(self, event):
        del self.events[event]

    def event_record(self, event, stream):
        self.events[event] = self.auto_complete

    def event_synchronize(self, event):
        self.event_syncs += 1
        self.events[event] = True

    def event_query(self, event):
        return self.events[event]

    def event_elapsed_ms(self, start, end):
        return 0.0

    def complete_events(self):
        for event in self.events:
            self.events[event] = True

    def memcpy_async(self, dst, src, nbytes, stream):
        pass

    def memset_async(self, ptr, value, nbytes, stream):
        pass


def hammer(alloc, sizes, stream_for, steps, threads=8):
    """``threads`` threads each do ``steps`` random malloc/free on ``alloc`` and free what
    they hold; returns the exceptions raised (the test asserts there are none)."""
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(steps):
                if mine and rng.random() < 0.5:
                    alloc.free(mine.pop(rng.randrange(len(mine))))
                else:
                    mine.append(alloc.malloc(rng.choice(sizes), stream_for(seed)))
            for ptr in mine:
                alloc.free(ptr)
        except Exception as exc:
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    if any(t.is_alive() for t in workers):
        errors.append(TimeoutError("a hammering thread is still running after 60 s"))
    return errors
