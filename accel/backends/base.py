"""The Backend protocol: the only runtime surface the layers above may use.

Streams, events, graphs, the caching allocator and the RNG are written once
against this class; each vendor runtime (the ``cuda`` package, the ``xpu`` package, the ``mps`` package)
implements it over its own library.  Everything here speaks plain Python
values: device pointers, streams, events, graphs and kernels are ``int``
handles, sizes are ``int`` bytes.  Vendor failures become
:class:`accel.AcceleratorError` (``OutOfMemoryError`` for allocation failures)
naming the library, the call, and the vendor error name and code.

Device-scoped calls (allocation, stream and event creation, mem_info,
synchronize) act on the calling thread's *current device*, as the CUDA runtime
does; callers switch with :meth:`set_device` first (``accel.streams.on_device``).
Created stream and event handles remember their device, so queries, syncs,
event records and copies on them work from any current device.  Two kinds of
call need the stream's device current, and the layers above make it so:

* :meth:`launch` and :meth:`graph_launch`, always (CUDA: a launch into a stream
  of another device is ``cudaErrorInvalidResourceHandle``);
* every call on a default stream when :attr:`Backend.shared_default_stream` is
  True (CUDA's legacy stream, handle 0, is the *current* device's default
  stream, so ``default_stream(i)`` only means device ``i`` while ``i`` is current).

Rules every implementation keeps:

* Nothing opens a library or initializes a runtime at import.
* :meth:`count` and :meth:`report` never initialize the runtime (they must be
  safe before ``fork``); they return 0 / a reason instead of raising when the
  library or the driver is missing.
* :meth:`init` may be called once per process; every other runtime method is
  only called after it (the lazy-init layer guarantees that).
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Optional, Sequence, Tuple

from .._errors import AcceleratorError

def _drop(args) -> None:
    """Nothing: ``args`` dies with the call (:meth:`Backend._run_after_captures`)."""


class LaunchNote(threading.local):
    """Whether this thread's last ``graph_launch`` queued the replay: ``Graph.replay`` clears
    ``queued`` before the call and a backend sets it right after the vendor call that queued the
    work, with signals deferred in between (accel.backends._signals), so a KeyboardInterrupt
    around the call leaves it exact.  The replay then tells the allocators of a launch that
    happened, and of none that did not (r83a: a cudaMallocAsync graph counted a launch that never
    ran, and its reset freed memory no launch had allocated)."""
    queued = False


#: The process's :class:`LaunchNote`.
launch_note = LaunchNote()


class DeviceProperties:
    """What :meth:`Backend.properties` returns for one device (immutable).

    torch's field names (``torch.cuda.get_device_properties``): ``name``, ``major``,
    ``minor``, ``total_memory``, ``multi_processor_count``, ``is_integrated`` (0/1),
    ``L2_cache_size``, ``warp_size``, ``max_threads_per_multi_processor``, ``pci_bus_id``,
    ``pci_device_id``, ``pci_domain_id``, ``gcnArchName`` and ``uuid`` (a :class:`uuid.UUID`:
    36-character ``str()``, ``.bytes``); a field the backend does not report is None.
    accel's own: ``index``, ``compute_capability`` ((major, minor), (0, 0) where the vendor
    has none), ``supported_dtypes`` (numpy dtype names), ``unified_memory`` and ``extra``
    (the backend's other values, e.g. XPU's ``max_work_group_size``), whose keys read as
    attributes too.

    A plain class rather than a dataclass: ``dataclasses`` pulls ``inspect``
    and ``ast`` into ``import accel``, several milliseconds of start-up.
    """

    __slots__ = ("index", "name", "total_memory", "compute_capability", "multi_processor_count",
                 "supported_dtypes", "uuid", "unified_memory", "major", "minor", "is_integrated",
                 "L2_cache_size", "warp_size", "max_threads_per_multi_processor", "pci_bus_id",
                 "pci_device_id", "pci_domain_id", "gcnArchName", "extra")

    def __init__(self, index: int, name: str, total_memory: int, compute_capability: Tuple[int, int],
                 multi_processor_count: int, supported_dtypes: frozenset, uuid: Any = None,
                 unified_memory: bool = False, extra: Optional[dict] = None, *,
                 L2_cache_size: Optional[int] = None, warp_size: Optional[int] = None,
                 max_threads_per_multi_processor: Optional[int] = None, pci_bus_id: Optional[int] = None,
                 pci_device_id: Optional[int] = None, pci_domain_id: Optional[int] = None,
                 gcnArchName: Optional[str] = None):
        cc = tuple(compute_capability)
        values = (index, name, total_memory, cc, multi_processor_count, frozenset(supported_dtypes),
                  _as_uuid(uuid), unified_memory, cc[0], cc[1], int(bool(unified_memory)), L2_cache_size,
                  warp_size, max_threads_per_multi_processor, pci_bus_id, pci_device_id, pci_domain_id,
                  gcnArchName, dict(extra or {}))
        for slot, value in zip(self.__slots__, values):
            object.__setattr__(self, slot, value)

    def __setattr__(self, name, value):
        raise AttributeError("DeviceProperties is immutable")

    def __getattr__(self, name):
        # Only reached for names that are no slot: the backend's extra values.
        extra = object.__getattribute__(self, "extra") if name != "extra" else None
        if extra is not None and not name.startswith("__") and name in extra:
            return extra[name]
        raise AttributeError(f"'DeviceProperties' object has no attribute {name!r} (fields: "
                             f"{', '.join(self.__slots__)}; backend values: {', '.join(extra or ())})")

    def _key(self):
        return tuple(getattr(self, slot) for slot in self.__slots__[:-1])  # extra is not compared

    def __eq__(self, other):
        if isinstance(other, DeviceProperties):
            return self._key() == other._key()
        return NotImplemented

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        fields = ", ".join(f"{slot}={getattr(self, slot)!r}" for slot in self.__slots__)
        return f"DeviceProperties({fields})"


def _as_uuid(value: Any):
    """A device UUID as :class:`uuid.UUID` (torch's ``props.uuid``: ``str()`` is 36 characters,
    ``.bytes`` 16): from a UUID, 16 raw bytes, or text with a vendor prefix ("GPU-...",
    nvidia-smi's form); None stays None."""
    if value is None or value == "":
        return None
    import uuid as _uuid    # not at import: `import accel` stays small
    if isinstance(value, _uuid.UUID):
        return value
    if isinstance(value, (bytes, bytearray)):
        return _uuid.UUID(bytes=bytes(value))
    text = str(value)
    if text[:4] in ("GPU-", "MIG-"):
        text = text[4:]
    return _uuid.UUID(text)


# What a kernel argument list looks like: (C type, value) pairs, C types from
# this fixed set so every backend can marshal them the same way.
KERNEL_ARG_TYPES = ("ptr", "u32", "i32", "u64", "i64", "f32", "f64")
KernelArgs = Sequence[Tuple[str, Any]]


class _NoGate:
    """The capture gate of a backend where no call made outside a capture invalidates one."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


class Backend(abc.ABC):
    """One vendor runtime.  Subclasses set ``name`` (``"cuda"``, ``"xpu"``, ``"mps"``)."""

    name: str = ""
    #: Kind of kernel source :meth:`module_load` accepts: "ptx", "msl", or None
    #: when the backend has no kernel path (callers then use the host path + copy).
    kernel_language: Optional[str] = None
    #: True when the backend implements stream capture (capture_* / graph_*).
    supports_graphs: bool = False
    #: True when :meth:`default_stream` returns one handle for every device, which
    #: the runtime resolves against the calling thread's current device (CUDA's
    #: legacy stream 0): calls on it must run with its device current.
    shared_default_stream: bool = False
    #: True once this process has started the vendor driver: by :meth:`init`, or by
    #: a count only the runtime could give (CUDA without NVML, or MIG UUIDs).  A
    #: child forked afterwards cannot use the driver; ``accel._lazy`` refuses it.
    driver_started: bool = False
    #: True when the backend implements the virtual-memory calls (vmm_*), which the
    #: caching allocator's expandable segments use.  Whether they work on a device
    #: may still depend on the driver: check :meth:`vmm_supported` after init.
    supports_vmm: bool = False
    #: The vendor call that grants a device access to mapped memory (named in messages).
    vmm_access_call: str = "the virtual-memory access call"
    #: True when the backend implements stream-ordered allocation from each device's default
    #: memory pool (mem_alloc_async, mem_free_async, mem_pool_*), which the allocator's
    #: ``backend:cudaMallocAsync`` uses.  Whether a device has pools may still depend on the
    #: driver: check :meth:`async_alloc_supported` after init.
    supports_async_alloc: bool = False
    #: True when pinned host memory (:meth:`host_alloc`) and device memory (:meth:`mem_alloc`) come
    #: from one pool of the driver (Metal: shared MTLBuffers under one recommendedMaxWorkingSetSize),
    #: so that either caching allocator's out-of-memory retry frees the other's cache too, as
    #: torch's MPS allocator frees every cached pool (release_cached_buffers).  Not on CUDA or
    #: Level Zero, whose pinned memory is host RAM beside the device's own.
    pinned_shares_device_memory: bool = False

    #: True when an event can be recorded on (waited on by) a capturing stream, so another stream
    #: can join the capture (CUDA).  Level Zero's capture into a command list cannot: there the
    #: record raises CaptureError and invalidates the capture, so callers refuse ahead.
    records_events_in_capture: bool = True

    #: True when :meth:`event_record` and :meth:`stream_wait_event` take ``external=True``:
    #: during stream capture the record (wait) becomes an event record (wait) node of the graph,
    #: which every replay records (waits for) again, instead of a dependency inside the capture
    #: (CUDA: cudaEventRecordExternal / cudaEventWaitExternal).  Outside capture the flag
    #: changes nothing.  torch.cuda.Event(external=True) times parts of a graph this way.
    supports_external_events: bool = False

    #: True when the backend reads device telemetry from the vendor management library (NVML,
    #: Level Zero Sysman) without initializing the runtime: the smi_* methods, which torch.cuda's
    #: utilization / temperature / power_draw / clock_rate / list_gpu_processes mirror.
    supports_smi: bool = False

    #: Held (``with be.capture_gate:``) from a "no capture underway" check (:meth:`captures_underway`)
    #: through the vendor calls that check allows, and by :meth:`capture_begin` around its count and
    #: call, so that no capture begins in between.  CUDA needs it: a query, synchronize, malloc or
    #: free by one thread while another thread's global-mode capture is underway invalidates that
    #: capture (CUDA Runtime API, cudaStreamBeginCapture), so an allocator that checks and then
    #: queries could invalidate a capture begun between the two.  It is a reentrant lock there,
    #: taken after an allocator's lock, never before one.  Elsewhere it does nothing: Level Zero captures
    #: record one command list and Metal has none.
    capture_gate = _NoGate()

    @property
    def no_smi_reason(self) -> str:
        """What the smi_* methods of a backend without a management library raise."""
        return (f"{self.name} has no management library to read utilization, temperature, power, "
                f"clocks or processes from")

    @property
    def no_capture_reason(self) -> str:
        """What the graph methods of a backend without stream capture raise."""
        return f"{self.name} has no stream capture"

    @property
    def no_external_events_reason(self) -> str:
        """Why ``Event(external=True)`` is refused on a backend without external events."""
        if not self.supports_graphs:
            return (f"{self.name} has no stream capture, so there is no graph whose replays an external "
                    f"event could time; time the work with events recorded around it instead")
        return (f"{self.name}'s graph capture records no event nodes (events recorded or waited on "
                f"inside a capture are refused there), so a replay cannot record an external event; "
                f"time a replay with events recorded around graph.replay() instead")

    @property
    def no_vmm_reason(self) -> str:
        """What the vmm_* methods of a backend without virtual memory raise."""
        return f"{self.name} has no virtual memory management (expandable segments)"

    @property
    def no_async_alloc_reason(self) -> str:
        """What the stream-ordered allocation methods of a backend without them raise."""
        return f"{self.name} has no stream-ordered memory pool (cudaMallocAsync)"

    # -- discovery: fork-safe, never initializes the runtime ------------------
    def fresh_locks_in_child(self) -> None:
        """In a forked child: replace the locks counting and library loading take (the first
        call) with free ones.  Another thread of the parent may have held one when a thread
        forked (r68f: a child forked while the main thread's ``device_count()`` counted waited
        for good on the count lock at its own first call); only this thread exists in the
        child, so none is held there.  Called by an at-fork hook: attributes only."""

    @abc.abstractmethod
    def count(self) -> int:
        """Number of visible devices, without initializing the runtime; 0 when unavailable."""

    def loads(self) -> bool:
        """True when the vendor library can be opened, device or not; never initializes.

        When no backend reports a device, the first one that loads is still the
        process's accelerator *type* (as a CUDA build of torch on a machine
        without a GPU), so device use fails with that runtime's own error.
        """
        return self.count() > 0

    @abc.abstractmethod
    def report(self) -> dict:
        """Facts for ``python -m accel``: library paths and versions, how the count
        was obtained, visible-device environment, and ``reason`` when count() is 0.
        Never initializes the runtime and never raises."""

    # -- runtime ---------------------------------------------------------------
    @abc.abstractmethod
    def init(self) -> None:
        """Initialize the runtime; raises AcceleratorError when that is impossible.

        Sets :attr:`driver_started`.  From then on :meth:`count` is the runtime's
        own count (when it disagrees with the fork-safe one, init warns)."""

    def clear_error(self) -> None:
        """Forget the runtime's per-thread "last error" (CUDA: ``cudaGetLastError``).

        Every error a backend method raises is already cleared; call this after
        handling a vendor error code that did not raise, so another library in the
        process (torch) does not report it at its next check.  No-op where the
        runtime keeps no such slot.  Sticky errors (a faulted context) stay."""

    @abc.abstractmethod
    def properties(self, index: int) -> DeviceProperties: ...

    @abc.abstractmethod
    def set_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device."""

    @abc.abstractmethod
    def get_device(self) -> int: ...

    def restore_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device again as a device scope ends
        (``accel.streams.on_device``).  CUDA defers it when the device has no primary context
        yet, so leaving a scope creates none (torch's c10::cuda::MaybeSetDevice); elsewhere
        :meth:`set_device`."""
        self.set_device(index)

    def device_deferred(self) -> bool:
        """Whether :meth:`get_device` names a device that :meth:`restore_device` has not made
        current in the runtime yet (the next scope on it does); False where nothing is deferred."""
        return False

    @abc.abstractmethod
    def device_synchronize(self) -> None:
        """Wait for all work on the current device (all its streams)."""

    @abc.abstractmethod
    def mem_info(self) -> Tuple[int, int]:
        """(free, total) bytes of the current device."""

    # -- memory ----------------------------------------------------------------
    @abc.abstractmethod
    def mem_alloc(self, nbytes: int) -> int:
        """Allocate device memory on the current device; OutOfMemoryError on failure."""

    @abc.abstractmethod
    def mem_free(self, ptr: int) -> None: ...

    def dlpack_data(self, ptr: int) -> Tuple[int, int]:
        """``(DLTensor.data, byte_offset)`` describing device address ``ptr`` in a DLPack capsule:
        the pointer itself (Metal: the MTLBuffer and the offset into it)."""
        return ptr, 0

    def dlpack_address(self, data: int, byte_offset: int) -> int:
        """The device address a capsule's ``data`` and ``byte_offset`` describe (the inverse of
        :meth:`dlpack_data`): their sum (Metal: inside the MTLBuffer ``data`` names)."""
        return data + byte_offset

    def pointer_location(self, ptr: int) -> Optional[Tuple[str, int]]:
        """What memory ``ptr`` points into, as the runtime knows it: ``("device", index)``,
        ``("managed", index)``, ``("host", index)`` (pinned; index -1 when not tied to a device)
        or ``("unknown", -1)`` (memory the runtime does not know: freed, pageable, past an
        allocation's end).  None when this backend cannot tell (foreign pointers are then
        taken on the caller's word).  Used to check foreign memory (Buffer.from_ptr)."""
        return None

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> int:
        """Allocate pinned (page-locked) host memory; OutOfMemoryError on failure."""

    @abc.abstractmethod
    def host_free(self, ptr: int) -> None: ...

    # -- streams ---------------------------------------------------------------
    @abc.abstractmethod
    def stream_create(self, priority: int = 0) -> int:
        """A new non-blocking stream on the current device."""

    @abc.abstractmethod
    def stream_destroy(self, stream: int) -> None: ...

    @abc.abstractmethod
    def default_stream(self, index: int) -> int:
        """Handle of device ``index``'s default stream (CUDA: 0, the legacy stream)."""

    @abc.abstractmethod
    def stream_synchronize(self, stream: int) -> None: ...

    @abc.abstractmethod
    def stream_query(self, stream: int) -> bool:
        """True when all work queued on ``stream`` has completed."""

    def stream_idle(self, stream: int) -> bool:
        """True when all work queued on ``stream`` has ended, asked without reporting a failure
        of that work (it stays for the stream's or the device's synchronize to report): the
        allocators ask it of a stream being destroyed.  The same as :meth:`stream_query` where a
        query reports nothing that a later synchronize would not report again."""
        return self.stream_query(stream)

    @abc.abstractmethod
    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` after this call waits for ``event``'s recorded work.

        Where :attr:`supports_external_events`, ``external=True`` (keyword) makes the wait an
        event wait node while ``stream`` captures: each replay waits for the event's record
        current at that replay (CUDA: cudaEventWaitExternal); outside capture it changes nothing."""

    def stream_priority_range(self) -> Tuple[int, int]:
        """(least, greatest) priority; numerically lower is higher priority, as CUDA."""
        return (0, 0)

    def foreign_stream(self, stream: int) -> Tuple[int, Optional[int]]:
        """``(handle, device index)`` of a stream handle accel may not have created (for
        ``Stream.from_handle``): the handle as accel keys it (a runtime alias of the default
        stream becomes :meth:`default_stream`'s value) and the stream's device, or None when
        the runtime cannot tell (the default stream: the caller's device).  Raises ValueError
        when the handle is not a live stream this backend can use."""
        return stream, None

    # -- events ----------------------------------------------------------------
    @abc.abstractmethod
    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int: ...

    @abc.abstractmethod
    def event_destroy(self, event: int) -> None: ...

    @abc.abstractmethod
    def event_record(self, event: int, stream: int) -> None:
        """Record ``event`` at the current end of ``stream`` (same device).

        Where :attr:`supports_external_events`, ``external=True`` (keyword) makes the record an
        event record node while ``stream`` captures: the event itself is left as it was, and
        each replay records it when it reaches the node, timestamp included (CUDA:
        cudaEventRecordExternal); outside capture it changes nothing."""

    @abc.abstractmethod
    def event_synchronize(self, event: int) -> None: ...

    @abc.abstractmethod
    def event_query(self, event: int) -> bool: ...

    @abc.abstractmethod
    def event_elapsed_ms(self, start: int, end: int) -> float: ...

    # -- copies ----------------------------------------------------------------
    @abc.abstractmethod
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy between any two addresses the runtime knows (device or pinned/pageable
        host); ordered on ``stream``.  Pageable host sources may be copied before the
        call returns (as cudaMemcpyAsync does)."""

    def memcpy_peer_async(self, dst: int, dst_index: int, src: int, src_index: int, nbytes: int,
                          stream: int) -> None:
        """Copy ``nbytes`` from device ``src_index``'s memory to device ``dst_index``'s, ordered on
        ``stream`` (of ``dst_index``), between devices that cannot access each other's memory
        (``can_access_peer`` False).  This default is :meth:`memcpy_async`, for a backend whose
        copies reach any device's memory."""
        self.memcpy_async(dst, src, nbytes, stream)

    @abc.abstractmethod
    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None: ...

    # -- graphs (only when supports_graphs) -----------------------------------
    def capture_begin(self, stream: int, mode: str) -> None:
        """Start capturing ``stream``; mode is "global", "thread_local" or "relaxed"."""
        raise NotImplementedError(self.no_capture_reason)

    def capture_end(self, stream: int) -> int:
        """End capture and return the graph handle; AcceleratorError if the capture was invalidated."""
        raise NotImplementedError(self.no_capture_reason)

    def stream_is_capturing(self, stream: int) -> bool:
        return False

    def capture_id(self, stream: int) -> Optional[int]:
        """The id of the capture ``stream`` takes part in (its own, or one it joined by
        waiting on a captured event); None when it is not capturing."""
        return None

    def captures_underway(self) -> int:
        """How many stream captures this process has begun through the backend and not
        ended (a capture begun by another library in the process is not counted)."""
        return 0

    def host_wait_refused(self, stream: int) -> Optional[str]:
        """Why a host wait for ``stream`` (not itself capturing) now would invalidate a capture
        underway, or None.  The default is conservative: any capture."""
        return "a stream capture is underway" if self.captures_underway() else None

    #: Releases queued while a capture is underway (:meth:`_after_captures`): a deque where the
    #: backend refuses calls during a capture (CUDA, XPU), None where it has no captures.
    _after_capture = None

    def _after_captures(self, fn, *args) -> bool:
        """Queue ``fn(*args)`` for when no stream capture is underway in this process and return
        True; False (nothing queued) when none is.  For releases a driver refuses during a capture
        (900, the capture invalidated): module unloads, graph and executable graph destroys,
        synchronizes before a foreign buffer's release.  The thread that ends the last capture
        runs the queue, the gate held (:meth:`_run_after_captures`)."""
        queue = self._after_capture
        if queue is None:
            return False
        with self.capture_gate:
            if not self.captures_underway():
                return False
            queue.append((fn, args))
            return True

    def _now_or_after_captures(self, fn, *args) -> None:
        """``fn(*args)`` now, with no capture beginning meanwhile (:attr:`capture_gate`), or queued
        for the end of the last capture while one is underway (:meth:`_after_captures`)."""
        with self.capture_gate:
            if not self._after_captures(fn, *args):
                fn(*args)

    def _run_after_captures(self) -> None:
        """Run the releases queued during captures, with no capture beginning meanwhile;
        capture_end calls it once the last capture ended.  One whose vendor call fails is tried
        once more at the next safe point (after the captures then underway), as a finalizer's
        (accel._finalize: a second failure is reported; r67d: it was dropped, and the handle
        leaked unreported).  What the releases hand back to their owners (a DLPack deleter, a
        ``from_ptr`` owner, the queued arguments themselves) is dropped only once this thread
        holds the gate no more (:meth:`after_gate`)."""
        queue = self._after_capture
        if not queue:
            return
        from .. import _finalize
        with self.capture_gate:     # (the queue changes only under it: _after_captures appends)
            while queue and not self.captures_underway():
                fn, args = queue.popleft()
                try:
                    fn(*args)
                except AcceleratorError:
                    # (again past any capture then underway: a release would invalidate it)
                    _finalize.pending.append((self._now_or_after_captures, (fn,) + args))
                finally:
                    self.after_gate(_drop, args)     # (args may hold the last reference to an owner)
                    args = None

    def after_gate(self, fn, *args) -> None:
        """``fn(*args)`` now (errors propagating), or, while this thread holds :attr:`capture_gate`,
        deferred to the next safe point (accel._finalize.defer: the next entry of the API in any
        thread, e.g. the end of Graph.capture_end once the capture's pool routing ended; r70a: a
        list of this thread's own, run only where a capture ended, kept a deleter for good when the
        hold ended elsewhere; r70m: draining where the hold ended ran user code inside the
        signal-deferred capture end, before the pool stopped routing, and under a graph's launch
        lock), as a finalizer's release (errors swallowed, a failed vendor call tried once more).
        For what must not run under the gate: a user's DLPack deleter or ``from_ptr`` owner may free an accel Buffer,
        which takes the allocator's lock and then the gate; another thread holding that lock and
        waiting for the gate would deadlock with it (r69a)."""
        owned = getattr(self.capture_gate, "_is_owned", None)
        if owned is None or not owned():
            fn(*args)
            return
        from .. import _finalize
        _finalize.defer(fn, *args)

    def graph_instantiate(self, graph: int) -> int:
        raise NotImplementedError(self.no_capture_reason)

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        """Replay ``graph_exec`` on ``stream``, whose device must be current.  Sets
        ``launch_note.queued`` once the vendor call queued the replay (see :class:`LaunchNote`)."""
        raise NotImplementedError(self.no_capture_reason)

    def graph_destroy(self, graph: int) -> None:
        raise NotImplementedError(self.no_capture_reason)

    def graph_exec_destroy(self, graph_exec: int) -> None:
        raise NotImplementedError(self.no_capture_reason)

    def graph_debug_dot(self, graph: int, path: str) -> None:
        raise NotImplementedError(self.no_capture_reason)

    def graph_node_count(self, graph: int) -> Optional[int]:
        """Operations the captured ``graph`` holds (cudaGraphGetNodes), or None when the
        backend cannot tell."""
        return None

    # -- virtual memory (only when supports_vmm) --------------------------------
    # The shape is the driver's (CUDA cuMem*, Level Zero zeVirtualMem*/zePhysicalMem*):
    # reserve a range of addresses, create physical pages, map pages into the range,
    # grant the device access, unmap, release.  Sizes and addresses are multiples of
    # vmm_granularity(); unmapping does not wait for queued work (the caller
    # synchronizes the streams that used the range first).
    def vmm_supported(self, index: int) -> bool:
        """True when device ``index`` can map physical pages into reserved ranges
        (CUDA: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)."""
        return False

    def vmm_granularity(self, index: int) -> int:
        """The page size (bytes) of physical allocations on device ``index``."""
        raise NotImplementedError(self.no_vmm_reason)

    def vmm_reserve(self, index: int, nbytes: int) -> int:
        """Reserve ``nbytes`` of device address space for device ``index``; the base address."""
        raise NotImplementedError(self.no_vmm_reason)

    def vmm_free(self, va: int, nbytes: int) -> None:
        """Return a reservation (nothing may be mapped in it any more)."""
        raise NotImplementedError(self.no_vmm_reason)

    def vmm_create(self, index: int, nbytes: int) -> int:
        """Create ``nbytes`` of physical memory on device ``index``; a handle.
        Raises :class:`accel.OutOfMemoryError` when the device has no room."""
        raise NotImplementedError(self.no_vmm_reason)

    def vmm_release(self, handle: int) -> None:
        """Release physical memory (once no mapping of it is left)."""
        raise NotImplementedError(self.no_vmm_reason)

    def vmm_map(self, va: int, nbytes: int, handle: int, index: int) -> None:
        """Map all of ``handle`` at ``va`` (inside a reservation) and grant device
        ``index`` read-write access to it."""
        raise NotImplementedError(self.no_vmm_reason)

    def vmm_set_access(self, va: int, nbytes: int, index: int) -> None:
        """Grant device ``index`` read-write access to mapped ``[va, va + nbytes)`` as well
        (another device copying from or running kernels on the memory: its peer)."""
        raise NotImplementedError(self.no_vmm_reason)

    def vmm_unmap(self, va: int, nbytes: int) -> None:
        """Unmap ``[va, va + nbytes)``; the physical memory stays until released."""
        raise NotImplementedError(self.no_vmm_reason)

    # -- stream-ordered allocation (only when supports_async_alloc) ------------------
    # CUDA's cudaMallocAsync/cudaFreeAsync from the device's default pool: an allocation is
    # usable in stream order after the alloc, and goes back to the pool when the stream
    # reaches the free; the pool keeps freed memory up to its release threshold and gives it
    # back on trim.  Pool attributes by name: reuse_follow_event_dependencies,
    # reuse_allow_opportunistic, reuse_allow_internal_dependencies, release_threshold,
    # reserved_current, reserved_high, used_current, used_high.
    def async_alloc_supported(self, index: int) -> bool:
        """True when device ``index`` has a stream-ordered memory pool
        (CUDA: cudaDevAttrMemoryPoolsSupported)."""
        return False

    def mem_alloc_async(self, nbytes: int, stream: int) -> int:
        """Allocate ``nbytes`` in stream order on ``stream`` from its device's default pool;
        OutOfMemoryError when the pool cannot grow."""
        raise NotImplementedError(self.no_async_alloc_reason)

    def mem_free_async(self, ptr: int, stream: int) -> None:
        """Return ``ptr`` (from :meth:`mem_alloc_async`) to its pool when ``stream`` reaches this point."""
        raise NotImplementedError(self.no_async_alloc_reason)

    def mem_pool_get(self, index: int, name: str) -> int:
        """An attribute of device ``index``'s default pool (names above)."""
        raise NotImplementedError(self.no_async_alloc_reason)

    def mem_pool_set(self, index: int, name: str, value: int) -> None:
        """Set an attribute of device ``index``'s default pool (a high-water mark only to 0,
        which resets it to the current value)."""
        raise NotImplementedError(self.no_async_alloc_reason)

    def mem_pool_trim(self, index: int, keep: int = 0) -> None:
        """Release unused memory of device ``index``'s default pool down to ``keep`` bytes."""
        raise NotImplementedError(self.no_async_alloc_reason)

    def mem_pool_set_access(self, index: int, peer: int) -> None:
        """Let device ``peer`` read and write the memory of device ``index``'s default pool
        (pool memory is not reached through peer access alone)."""
        raise NotImplementedError(self.no_async_alloc_reason)

    # Allocations made on a capturing stream belong to the graph (allocation/free nodes), not
    # the pool: the graph allocator's memory, by name: used_current, used_high,
    # reserved_current, reserved_high.
    def graph_mem_get(self, index: int, name: str) -> int:
        """An attribute of device ``index``'s graph memory (names above)."""
        raise NotImplementedError(self.no_async_alloc_reason)

    def graph_mem_trim(self, index: int) -> None:
        """Give device ``index``'s graph memory that no graph uses back to the device."""
        raise NotImplementedError(self.no_async_alloc_reason)

    # -- kernels (only when kernel_language is not None) -----------------------
    def module_load(self, source: bytes) -> int:
        """Load kernel source in ``kernel_language`` (JIT-compiled by the runtime)."""
        raise NotImplementedError(f"{self.name} has no kernel path")

    def module_unload(self, module: int) -> None:
        raise NotImplementedError(f"{self.name} has no kernel path")

    def module_function(self, module: int, name: str) -> int:
        raise NotImplementedError(f"{self.name} has no kernel path")

    def function_live(self, module: int, function: int) -> bool:
        """Whether ``function`` (from module_function) is still a live kernel of ``module``.
        After a failed module_unload: a backend that destroys kernels before the module (Level
        Zero) may have destroyed it; elsewhere a failed unload destroys nothing."""
        return True

    # -- management-library readings (only when supports_smi) ----------------------------------
    # ``index`` is a visible device index; none of these initializes the runtime (they must be
    # safe before fork, as counting is).  Failures raise AcceleratorError naming the call.
    def smi_index(self, index: int) -> int:
        """The management library's own number for visible device ``index`` (NVML index)."""
        raise NotImplementedError(self.no_smi_reason)

    def smi_utilization(self, index: int) -> Tuple[int, int]:
        """(percent of the last sample period a kernel ran, percent memory was read or written)."""
        raise NotImplementedError(self.no_smi_reason)

    def smi_gpu_utilization(self, index: int) -> int:
        """The first of :meth:`smi_utilization` alone (a backend that samples each counter
        separately, as Level Zero Sysman, overrides it so one reading does not consume the other's)."""
        return self.smi_utilization(index)[0]

    def smi_memory_usage(self, index: int) -> int:
        """The second of :meth:`smi_utilization` alone (see :meth:`smi_gpu_utilization`)."""
        return self.smi_utilization(index)[1]

    def smi_temperature(self, index: int) -> int:
        """The GPU die temperature in degrees C."""
        raise NotImplementedError(self.no_smi_reason)

    def smi_power_draw(self, index: int) -> int:
        """The average power draw in milliwatts."""
        raise NotImplementedError(self.no_smi_reason)

    def smi_clock_rate(self, index: int) -> int:
        """The current SM (compute) clock in MHz."""
        raise NotImplementedError(self.no_smi_reason)

    def smi_memory_used(self, index: int) -> int:
        """Device memory in use by every process, in bytes (nvidia-smi's "used")."""
        raise NotImplementedError(self.no_smi_reason)

    def smi_processes(self, index: int) -> Sequence[Tuple[int, Optional[int]]]:
        """(pid, device bytes used or None when unknown) of each process with a context on it."""
        raise NotImplementedError(self.no_smi_reason)

    def can_access_peer(self, index: int, peer: int) -> bool:
        """Whether device ``index`` can access ``peer``'s memory directly (initialized runtime).
        This default suits a backend with one device: no device is its own peer."""
        return False

    def launch(self, function: int, grid: Tuple[int, int, int], block: Tuple[int, int, int],
               args: KernelArgs, shared_mem: int, stream: int) -> None:
        """Queue ``function`` on ``stream``, whose device must be current.  A kernel the
        device cannot run (no image for it, PTX the driver cannot JIT) raises
        :class:`accel.KernelImageError`, at load or at this first launch."""
        raise NotImplementedError(f"{self.name} has no kernel path")

    # -- user kernels (accel.kernels): limits, attributes, occupancy ---------------------------
    # Each raises NotImplementedError (with the reason) on a backend that cannot tell.
    def launch_limits(self, index: int) -> dict:
        """Launch limits of device ``index``: ``max_grid`` and ``max_block`` ((x, y, z)),
        ``max_threads_per_block``, ``max_shared_per_block`` (dynamic shared memory without an
        opt-in) and ``max_shared_per_block_optin`` (the most a kernel may opt in to)."""
        raise NotImplementedError(f"{self.name} has no kernel path")

    def function_attributes(self, function: int) -> dict:
        """Attributes of a kernel on the current device: ``max_threads_per_block``,
        ``num_regs``, ``shared_size_bytes`` (static), ``max_dynamic_shared_size_bytes``."""
        raise NotImplementedError(f"{self.name} cannot read kernel attributes")

    def function_set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        """Let the kernel use up to ``nbytes`` of dynamic shared memory on the current device
        (CUDA: cudaFuncAttributeMaxDynamicSharedMemorySize, needed above 48 KiB)."""
        raise NotImplementedError(f"{self.name} cannot set kernel attributes")

    def occupancy_max_active_blocks(self, function: int, block_size: int, dynamic_smem: int) -> int:
        """Blocks of ``block_size`` threads of the kernel that fit on one multiprocessor of the
        current device at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor)."""
        raise NotImplementedError(f"{self.name} has no occupancy calculator")
