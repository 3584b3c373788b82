"""What an out-of-memory does beyond the allocator that hit it: the process-wide hooks.

Shared by the device caching allocator (``_caching``: both hooks), the cudaMallocAsync one
(``_async``: the observers) and the pinned one (``_host``: the unified-memory release only; it
calls no observer).  Both hooks are module state that exists once, here:
``_oom_observers`` is changed in place (``accel.memory.attach_out_of_memory_observer`` and its
detach; emptied by ``accel.memory``'s reset), ``_release_unified`` is rebound by ``accel.memory``
when it is imported; so every reader looks them up through this module at use time
(``_oom_hooks._oom_observers``), never with a ``from`` import that would keep the value of the
moment.  An allocator calls the observers only once its lock is released (``_notify_oom``), as
torch does.
"""

from __future__ import annotations

from typing import List

from .._errors import OutOfMemoryError

#: Out-of-memory observers (accel.memory.attach_out_of_memory_observer), process-wide as torch's
#: oom_observers_ are per allocator for every device: each is called as ``fn(device, bytes tried,
#: allowed bytes (the fraction's cap) or the device's total, free bytes)`` once the allocator's
#: lock is released, before the OutOfMemoryError propagates.
_oom_observers: List = []


#: accel.memory._release_unified(backend, caller), set there: on a backend whose pinned memory is
#: device memory (Backend.pinned_shares_device_memory) an out-of-memory retry frees the other
#: caching allocators' caches of that backend too, never waiting for their locks.
_release_unified = None


def _notify_oom(exc: OutOfMemoryError) -> None:
    """Call the observers with ``exc``'s arguments; an observer's error propagates (the
    OutOfMemoryError is its ``__context__``)."""
    for fn in list(_oom_observers):
        fn(*exc.observer_args)

