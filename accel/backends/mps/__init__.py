"""Apple MPS backend: Metal through the Objective-C runtime (libobjc + cffi, ``accel.backends._objc``).

:class:`MPSBackend` is the Backend protocol for Metal, composed of one mixin per concern, each in
its own module with its part of the model (what the protocol's CUDA-shaped handles mean on Metal):

* :mod:`._library`: libobjc and Metal (real or simulated), the messages sent with their exact C
  signatures, Metal's constants, errors, and the helpers every concern uses (the runtime,
  owned results, encoders, handle numbers);
* :mod:`.discovery`: counting without creating the device, ``report``, init (the one device,
  the system default) and its properties;
* :mod:`.memory`: pointers as ``MTLBuffer`` contents addresses, device and pinned buffers,
  copies and fills, ``mem_info``, DLPack's kDLMetal form;
* :mod:`.streams`: one command queue per stream, its open command buffer, commits, synchronization;
* :mod:`.events`: ``MTLSharedEvent`` records, cross-stream waits, timing from command buffers;
* :mod:`.kernels`: MSL compiled at run time, compute pipelines, launches;
* :mod:`.graphs`: refused (Metal has no stream capture).

Why mixins rather than collaborator objects: every concern works on the same few tables under
one lock (buffers, streams, events, modules), and the calls between concerns go both ways (a
copy opens a stream's command buffer, a device free synchronizes every stream, an event record
commits a stream and fills the scratch buffer).  Collaborators would each need the backend back,
and every call would pass through it; mixins keep each call site as it was and the state in one
place, :meth:`MPSBackend.__init__`, which lists it all.  Each mixin's docstring says what it owns.

Ctrl-C: a Python signal handler can run as any ``objc_msgSend`` returns, so the backend's
short sequences that make and store, or make and end, Metal objects (an encoder and its
``endEncoding``, a command buffer and its retain, an event's signal and the commit) run with
signals deferred in the main thread (``_signals.deferred``, about 1.5 us a call); waits
(``waitUntilCompleted``) are not deferred, and what they hold is given back on every path.

Ownership: objects from ``new…`` methods and ``MTLCreateSystemDefaultDevice``
are owned (+1) and released when their handle is destroyed; autoreleased
results that are kept (command buffers) are retained; every call that makes
autoreleased objects runs inside an autorelease pool.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ... import _locks
from .. import _objc
from .._signals import deferred
from ..base import Backend
from ._library import LibraryMixin
from .discovery import DiscoveryMixin
from .events import EventsMixin
from .graphs import GraphsMixin
from .kernels import KernelsMixin
from .memory import MemoryMixin
from .streams import StreamsMixin, _Stream

if TYPE_CHECKING:
    from ._library import _Libraries
    from .events import _Event
    from .memory import _Buffer

__all__ = ["MPSBackend", "create"]


class MPSBackend(DiscoveryMixin, MemoryMixin, StreamsMixin, EventsMixin, GraphsMixin, KernelsMixin, LibraryMixin,
                 Backend):
    """The Metal runtime behind the Backend protocol (one device: the system default; see the
    module docstring for the design)."""

    name = "mps"
    kernel_language = "msl"
    supports_graphs = False
    pinned_shares_device_memory = True      # host_alloc's buffers are shared MTLBuffers, as mem_alloc's

    def __init__(self) -> None:
        self._lock = _locks.RLock("the Metal backend")
        self._libs: Optional[_Libraries] = None
        self._rt: Optional[_objc.Runtime] = None
        self._device = None
        self._buffers: Dict[int, _Buffer] = {}
        self._bases: List[int] = []
        self._streams: Dict[int, _Stream] = {}
        self._events: Dict[int, _Event] = {}
        self._modules: Dict[int, Tuple[Any, List[int]]] = {}
        self._functions: Dict[int, Tuple[Any, Any, int, int]] = {}
        self._next_handle = 1
        self._scratch: Optional[_Buffer] = None
        self._tls = threading.local()
        # committed command buffers of destroyed streams, still running: device_synchronize waits
        # for them (cudaDeviceSynchronize waits for a destroyed stream's work too)
        self._orphans = _Stream(0, None)

    def fresh_locks_in_child(self) -> None:
        # loading the libraries (count) takes it; after init the child is refused anyway
        self._lock = _locks.RLock("the Metal backend")

    def close(self) -> None:
        """Release every Metal object this backend owns (tests use it to check for leaks).

        Waits for outstanding work first.  The backend can be initialized again.
        """
        with self._lock:
            if self._device is None:
                return
            rt = self._rt
        try:
            self._sync_streams(list(self._streams.values()))
        finally:
            self._release_everything(rt)

    @deferred
    def _release_everything(self, rt) -> None:
        """close()'s releases, signals deferred: a KeyboardInterrupt between a release and the
        table's emptying made a second close() release the same objects again (r70i)."""
        with self._lock, rt.pool():
            for fn in list(self._functions):
                pipeline, function, _, _ = self._functions.pop(fn)
                rt.release(pipeline)
                rt.release(function)
            for lib, _ in self._modules.values():
                rt.release(lib)
            self._modules.clear()
            # Emptied, not just released (as stream_destroy): a synchronize in another thread
            # that took the stream or event before this close waits outside the lock on its
            # own retains, then releases what is still listed on the stream: a second release
            # of a buffer released here (r43; a Mac crashes).
            for ev in self._events.values():
                self._release_committed(ev.cb)
                ev.cb = None
                rt.release(ev.shared)
            self._events.clear()
            for st in self._streams.values():
                rt.release(st.cb)
                st.cb = None
                for cmd in st.inflight:
                    rt.release(cmd.obj)
                st.inflight = []
                rt.release(st.queue)
            self._streams.clear()
            for cmd in self._orphans.inflight:
                rt.release(cmd.obj)
            self._orphans.inflight = []
            for buf in self._buffers.values():
                rt.release(buf.obj)
            self._buffers.clear()
            self._bases.clear()
            if self._scratch is not None:
                rt.release(self._scratch.obj)
                self._scratch = None
            rt.release(self._device)
            self._device = None


def create() -> MPSBackend:
    """The factory accel.backends calls; constructing opens nothing."""
    return MPSBackend()
