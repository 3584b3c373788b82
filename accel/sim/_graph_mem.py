"""Graph memory nodes of the simulated CUDA runtime: the state behind cudart/graph_memory.py's
cudaMallocAsync / cudaFreeAsync on a capturing stream, the relaunch rule, and
cudaDeviceGraphMemTrim / cudaDevice{Get,Set}GraphMemAttribute.

What the documents say, and how it is modelled (the error codes are cudart/state.py's):

* CUDA Runtime API, cudaMallocAsync: "During stream capture, this function results in the
  creation of an allocation node.  In this case, the allocation is owned by the graph instead
  of the memory pool.  The memory pool's properties are used to set the node's creation
  parameters."  So the allocation gets the address now (a :class:`GraphAllocation`, kept in
  the runtime's memory table so captured copies and memsets can name it) and the peer access
  the stream's default pool grants now (Programming Guide, Graph Memory Nodes, "Peer Access
  with Stream Capture": a later cudaMemPoolSetAccess does not change it).
* cudaGraphAddMemAllocNode: "The allocation's address remains fixed across instantiations and
  launches."  The address stays reserved while the graph, its executable graph, or a live
  allocation of a launch exists (an allocation a graph does not free outlives the graph until
  it is freed).
* Lifetime (Programming Guide, Graph Memory Nodes, "API Fundamentals"): from the moment GPU
  execution reaches the allocation node until it reaches a free node, a cudaFreeAsync in
  stream order, or an (immediate) cudaFree.  Outside it the allocation's ``live`` flag is False
  and every copy, memset or kernel that touches it faults (cudaErrorIllegalAddress).
* Physical memory: mapped for an executable graph's allocations when it is launched, counted
  against the device (cudaMemGetInfo, out of memory), kept by the graph allocator after the
  allocation ends (cached), and returned by cudaDeviceGraphMemTrim: "Blocks which are not in
  use by a graph that is either currently executing or scheduled to execute are freed back to
  the operating system."  A graph allocation's bytes never come from (or show in) the device's
  default pool.  ``used`` is the memory mapped for graph allocations, ``reserved`` that plus
  the cache (cudaGraphMemAttrUsedMemCurrent / ReservedMemCurrent).  Stricter than the
  hardware: allocations of one graph never share physical memory (CUDA may alias those whose
  lifetimes do not overlap), so the simulator needs at least as much memory as a GPU.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from . import _memory

__all__ = ["GraphAllocation", "ExecMem", "Space"]


class GraphAllocation(_memory.Allocation):
    """The fixed address of one allocation node (``live`` only during its lifetime)."""

    __slots__ = ("n", "access", "capture", "node", "freed_in_graph", "refs", "exec", "outstanding",
                 "mapped", "pending")

    def __init__(self, a: _memory.Allocation, access: Dict[int, int], capture):
        super().__init__(a.base, a.size, a.kind, a.device, a.buf)
        self.live = False
        self.n = (a.size + _memory.ALIGN - 1) & ~(_memory.ALIGN - 1)   # bytes of physical memory
        self.access = access            # peer device -> cudaMemAccessFlags, fixed at capture
        self.capture = capture          # the capture its node is in, until that capture ends
        self.node = -1                  # the allocation node's id in that capture
        self.freed_in_graph = False     # a free node of the same graph ends every lifetime
        self.refs = 0                   # graphs and executable graphs that hold the node
        self.exec: Optional["ExecMem"] = None   # the one executable graph of its graph
        self.outstanding = False        # allocated by a launch, no free issued yet (host view)
        self.mapped = False             # physical memory mapped for it
        self.pending = None             # (queue, seq) of the cudaFreeAsync that ends it


class ExecMem:
    """The memory side of one executable graph with allocation nodes."""

    __slots__ = ("allocs", "unfreed", "auto_free", "last")

    def __init__(self, allocs: List[GraphAllocation], auto_free: bool):
        self.allocs = allocs
        self.unfreed = [ga for ga in allocs if not ga.freed_in_graph]
        self.auto_free = auto_free      # cudaGraphInstantiateFlagAutoFreeOnLaunch
        self.last: Optional[Tuple[object, int]] = None   # the point its last launch ends at


class _Device:
    __slots__ = ("mapped", "cached", "used_high", "reserved_high")

    def __init__(self):
        self.mapped = self.cached = self.used_high = self.reserved_high = 0


class Space:
    """Every graph allocation of one simulated runtime and each device's graph memory.

    The methods that change accounting take the runtime ``R`` (its ``mlock``, ``devices``,
    ``cfg`` and memory table ``mem``) and are called with ``R.mlock`` held unless said."""

    def __init__(self):
        self.allocs: Dict[int, GraphAllocation] = {}     # base -> allocation whose address is held
        self.execs: Dict[object, ExecMem] = {}           # GraphExec -> its memory side
        self._devices: Dict[int, _Device] = {}

    def device(self, index: int) -> _Device:
        d = self._devices.get(index)
        if d is None:
            d = self._devices[index] = _Device()
        return d

    # -- physical memory ------------------------------------------------------------------
    def map(self, R, allocs: List[GraphAllocation]) -> Optional[List[GraphAllocation]]:
        """Map physical memory for every unmapped allocation of ``allocs`` (the cache first,
        then the device): the list mapped now, or None (nothing changed) when a device has
        no room.  ``R.mlock`` held."""
        need: Dict[int, int] = {}
        todo = [ga for ga in allocs if not ga.mapped]
        for ga in todo:
            need[ga.device] = need.get(ga.device, 0) + ga.n
        for index, n in need.items():
            dev = R.devices[index]
            grow = n - min(n, self.device(index).cached)
            if dev.used + grow > R.cfg.memory - dev.reserved:
                return None
        for index, n in need.items():
            d, dev = self.device(index), R.devices[index]
            take = min(n, d.cached)
            d.cached -= take
            dev.used += n - take
            dev.peak = max(dev.peak, dev.used)
            d.mapped += n
            d.used_high = max(d.used_high, d.mapped)
            d.reserved_high = max(d.reserved_high, d.mapped + d.cached)
        for ga in todo:
            ga.mapped = True
        return todo

    def unmap(self, ga: GraphAllocation) -> None:
        """Its physical memory goes back to the graph allocator's cache.  ``R.mlock`` held."""
        if ga.mapped:
            ga.mapped = False
            d = self.device(ga.device)
            d.mapped -= ga.n
            d.cached += ga.n

    def trim(self, R, index: int) -> None:
        """cudaDeviceGraphMemTrim: unmap what no graph uses and no launch will, then give
        the cache back to the device.  ``R.mlock`` held."""
        for ga in list(self.allocs.values()):
            if ga.device == index and ga.mapped and self._idle(ga):
                self.unmap(ga)
        d = self.device(index)
        R.devices[index].used -= d.cached
        d.cached = 0

    @staticmethod
    def _idle(ga: GraphAllocation) -> bool:
        if ga.outstanding or ga.live:
            return False
        last = ga.exec.last if ga.exec is not None else None
        return last is None or last[0].done >= last[1]

    def attribute(self, index: int, which: str) -> int:
        d = self.device(index)
        return {"used": d.mapped, "used_high": d.used_high, "reserved": d.mapped + d.cached,
                "reserved_high": d.reserved_high}[which]

    def reset_high(self, index: int, which: str) -> None:
        """A high-water mark set to 0: the driver takes it as "reset to the current value"
        (as the pools' cudaMemPoolAttr*High)."""
        d = self.device(index)
        if which == "used_high":
            d.used_high = d.mapped
        else:
            d.reserved_high = d.mapped + d.cached

    # -- addresses ------------------------------------------------------------------------
    def release_if_unused(self, R, ga: GraphAllocation) -> None:
        """Give the address back once no graph, executable graph or live allocation holds it
        (its physical memory stays cached).  Takes ``R.mlock``.

        (r64a) Nor while the allocation is alive on the GPU (``live``): a ``cudaFreeAsync`` issued
        (``outstanding`` already cleared) whose stream has not reached it yet.  CUDA Programming
        Guide, "Graph Memory Nodes": a graph allocation's lifetime "ends when ... GPU execution
        reaches the freeing cudaFreeAsync() stream call", and "Graph destruction does not
        automatically free any live graph-allocated memory, even though it ends the lifetime of
        the allocation node".  The free's own step releases it when it runs.  (Before, destroying
        the graph or its executable in that window gave the address back at once, and work the
        program had ordered before the free faulted with cudaErrorIllegalAddress.)"""
        with R.mlock:
            if ga.refs > 0 or ga.outstanding or ga.live or self.allocs.get(ga.base) is not ga:
                return
            del self.allocs[ga.base]
            self.unmap(ga)
        R.mem.remove(ga)

    def forget_device(self, index: int) -> None:
        """cudaDeviceReset dropped the device's memory (and its accounting) wholesale."""
        for base, ga in list(self.allocs.items()):
            if ga.device == index:
                ga.mapped = False
                del self.allocs[base]
        self._devices.pop(index, None)
