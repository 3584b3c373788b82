"""Model-based ORDERING fuzz (r65m) of accel's interop paths: DLPack and CUDA Array Interface
exchanges between an accel producer and consumers, on the simulators (CUDA and XPU with two
devices, Metal with one), through the public API only.

It reuses r65a's approach (tests/test_data_ordering_fuzz_r65a.py): seeded random programs, a
host model of every buffer's bytes with vector clocks that counts only DOCUMENTED ordering, and
a generator that avoids races (orders an access explicitly when the model says it is not yet
ordered) so that every read is determined and checked.  The simulated streams run with a
per-op delay, so an ordering the protocol promises but accel does not make shows as wrong bytes.

The documented ordering this file counts (and nothing else):

* ``__dlpack__(stream=...)`` (array API standard, ``array.__dlpack__``, data-apis.org): the
  consumer passes its stream and "the producer [must] ensure that operations can safely be
  performed on the array (e.g. by inserting a dependency between streams via 'wait for
  event')"; CUDA: None "producer must assume the legacy default stream", 1 the legacy default
  stream, 2 the per-thread default stream, > 2 a stream pointer; -1 "producer must not perform
  any synchronization"; 0 disallowed.  accel's rule (Buffer.__dlpack__, _dlpack.sync_for_consumer):
  the consumer stream waits for an event recorded on the buffer's ``last_stream``; an accel
  consumer stream becomes the new ``last_stream``; off CUDA, None waits on the host and an
  accel.Stream waits for an event, ints are refused.  So the model joins the consumer stream's
  clock with ``last_stream``'s at the export (the host's for a host wait), and nothing for -1
  and 2 (per-thread: no accel stream the model can use).
* ``accel.from_dlpack(obj, stream=)``: passes its stream (default: accel's current stream of
  the producer's device on CUDA) to ``obj.__dlpack__``: the foreign producer here forwards it to
  an accel buffer's ``__dlpack__`` and records what it got.
* ``__cuda_array_interface__`` v3 (numba-cuda docs, "CUDA Array Interface (Version 3)",
  Synchronization): ``stream`` is the stream on which the data may be used; a consumer
  synchronizes on it at the point of consumption; absent/None: no synchronization.  accel's
  consumer (``Buffer.copy_from``) makes its stream wait for an event on the producer's stream.
* a blocking copy's return orders the host after it; explicit waits/synchronizes as r65a's.

Lifetimes (DLPack deleter semantics, dlpack.h: the producer's memory stays valid until the
consumer calls the deleter): a producer Buffer closed while an import of it lives keeps its
bytes (checked by reading through the import) and its memory (no new allocation overlaps it);
capsules dropped unconsumed or consumed twice (BufferError, nothing changed); read-only imports
(writes refused with ValueError, legacy re-export with BufferError).  Host memory: numpy and torch
CPU consumers of ``accel.empty_pinned`` arrays after non-blocking device-to-host copies (read only
once the model orders the host after the copy); accel.from_dlpack of host memory is refused.
At the end: every import and buffer closed, ``memory_allocated`` back to its start on each
device, no live export (``_dlpack.live_exports``), no registered capsule, no live Buffer.

R65M_SEEDS (default 3 per simulator), R65M_OPS (50) and R65M_BASE (0, added to the first seed)
set the sweep.  Written with sweeps of 25 seeds x 70 ops, 20 x 70 and 20 x 80 (R65M_BASE=1000)
per simulator: all passed.  The model was checked against mutations of accel (each caught within
4 seeds): the handshake's stream wait removed (last_stream still moved), the CAI consumer's
wait_for_producer removed, and the export pin removed (close() freed exported memory).
A targeted probe found one accel bug (fixed; the test failed before), shrunk to
test_from_dlpack_orders_the_producer_before_another_devices_default_stream below: accel.from_dlpack
(obj, stream=<device 1's default stream>) for a producer on device 0 passes the DLPack value 1,
which the producer can only read as its own device's legacy stream.  The sweep's cross-device
consumers (peer copies) do not show it: accel's cross-device copy barrier orders them anyway.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import pytest

import accel
from accel import _dlpack, memory

from conftest import use_sim
from test_data_ordering_fuzz_r65a import Mismatch, hb, join

SEEDS = int(os.environ.get("R65M_SEEDS", "3"))
OPS = int(os.environ.get("R65M_OPS", "50"))
DELAY_US = 150
SIZES = (64, 4096, 65536 + 64)
REFUSALS = (ValueError, RuntimeError, TypeError, BufferError)


@dataclass
class SM:
    obj: accel.Stream
    dev: int
    sid: int
    vc: Dict[int, int] = field(default_factory=dict)
    seq: int = 0


@dataclass
class BM:
    """A producer buffer: its bytes, last write and reads since (whole-buffer granularity)."""
    key: int
    obj: Optional[accel.Buffer]
    dev: int
    n: int
    value: np.ndarray
    lw: tuple = (0, 0)
    reads: List[tuple] = field(default_factory=list)
    closed: bool = False
    via_import: bool = False    # last written through an import: the producer Buffer never saw it


@dataclass
class IM:
    """An import (accel.from_dlpack) of bytes [off, off + m) of a producer buffer."""
    obj: accel.Buffer
    base: BM
    off: int
    m: int
    readonly: bool


class ForeignDLPack:
    """A minimal foreign DLPack producer over an accel buffer (or view): forwards the stream it
    is asked for and records it.  ``readonly`` sets DLPACK_FLAG_BITMASK_READ_ONLY in the versioned
    capsule it hands on (a producer exporting read-only memory)."""

    def __init__(self, src, readonly=False):
        self.src, self.readonly, self.asked = src, readonly, []

    def __dlpack_device__(self):
        return self.src.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.asked.append(stream)
        cap = self.src.__dlpack__(stream=stream, max_version=max_version)
        if self.readonly:
            assert max_version is not None and max_version[0] >= 1
            ptr = _dlpack._PyCapsule_GetPointer(cap, _dlpack.NAME_VERSIONED)
            _dlpack.DLManagedTensorVersioned.from_address(ptr).flags |= _dlpack.FLAG_READ_ONLY
        return cap


class ForeignCAI:
    """A minimal foreign __cuda_array_interface__ v3 producer (with or without "stream")."""

    def __init__(self, ptr, m, stream):
        self.__cuda_array_interface__ = {"shape": (m,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}
        if stream is not None:
            self.__cuda_array_interface__["stream"] = stream


class Program:
    def __init__(self, kind: str, seed: int):
        self.kind, self.seed = kind, seed
        self.cuda = kind == "cuda"
        self.devs = list(range(accel.device_count()))
        self.log: List[str] = []
        self.step = 0
        self.host: Dict[int, int] = {}
        self.streams: Dict[tuple, SM] = {}
        self.by_sid: Dict[int, SM] = {}
        self.bufs: List[BM] = []
        self.imports: List[IM] = []
        self.pinned: list = []
        self.counts: Dict[str, int] = {}
        self.next_key = 1
        self.rng = random.Random(seed)
        for d in self.devs:
            self.sm(accel.default_stream(d))
            for _ in range(2):
                self.sm(accel.Stream(d))

    # ------------------------------------------------------------------ model plumbing
    def note(self, what: str) -> None:
        self.log.append(f"{self.step}: {what}")
        name = what.split()[0]
        self.counts[name] = self.counts.get(name, 0) + 1

    def fail(self, msg: str) -> None:
        raise Mismatch(f"[{self.kind} seed={self.seed} step={self.step}] {msg}\nlast ops:\n" +
                       "\n".join(self.log[-14:]))

    def sm(self, stream: accel.Stream) -> SM:
        key = (stream.device_index, stream.handle)
        s = self.streams.get(key)
        if s is None:
            s = SM(stream, stream.device_index, len(self.by_sid) + 1)
            self.streams[key] = s
            self.by_sid[s.sid] = s
        return s

    def pick_stream(self, d: int) -> SM:
        return self.rng.choice([s for s in self.streams.values() if s.dev == d])

    def issue(self, s: SM) -> tuple:
        s.seq += 1
        s.vc = join(s.vc, self.host)
        s.vc[s.sid] = s.seq
        return (s.sid, s.seq)

    def order(self, s: SM, preds) -> None:
        for p in preds:
            if hb(p, join(s.vc, self.host)):
                continue
            src = self.by_sid[p[0]]
            how = self.rng.choice(["wait_stream", "event", "sync"])
            self.note(f"order {how} sid{src.sid}->sid{s.sid}")
            if how == "wait_stream":
                s.obj.wait_stream(src.obj)
                self.issue(src)
                s.vc = join(s.vc, src.vc)
                self.issue(s)
            elif how == "event":
                ev = accel.Event()
                ev.record(src.obj)
                self.issue(src)
                s.obj.wait_event(ev)
                s.vc = join(s.vc, src.vc)
                self.issue(s)
            else:
                src.obj.synchronize()
                self.host = join(self.host, src.vc)

    def host_order(self, preds) -> None:
        for p in preds:
            if not hb(p, self.host):
                src = self.by_sid[p[0]]
                self.note(f"host_order sid{src.sid}")
                src.obj.synchronize()
                self.host = join(self.host, src.vc)

    def compare(self, got, want, what: str) -> None:
        got = np.asarray(got).view(np.uint8).reshape(-1)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            self.fail(f"{what}: byte {bad} is {got[bad]}, the model says {want[bad]}")

    def census(self):
        return (_dlpack.live_exports(), len(_dlpack._capsules))

    def refuse(self, what: str, fn, exc=REFUSALS) -> None:
        before = (self.census(), {d: memory.memory_allocated(d) for d in self.devs})
        try:
            fn()
        except exc:
            pass
        except Exception as e:      # noqa: BLE001
            self.fail(f"refusal {what} raised {type(e).__name__}: {e}")
        else:
            self.fail(f"{what} was not refused")
        gc.collect()
        after = (self.census(), {d: memory.memory_allocated(d) for d in self.devs})
        if after != before:
            self.fail(f"refusal {what} changed state: {before} -> {after}")

    # ------------------------------------------------------------------ operations
    def live(self) -> List[BM]:
        return [b for b in self.bufs if not b.closed]

    def op_alloc(self) -> None:
        if len(self.live()) >= 6:
            return self.op_close_producer()
        d = self.rng.choice(self.devs)
        n = self.rng.choice(SIZES)
        s = self.pick_stream(d)
        obj = accel.Buffer(n, device=d, stream=s.obj)
        v = self.rng.randrange(256)
        self.note(f"alloc #{self.next_key} dev{d} n={n} sid{s.sid} fill={v}")
        obj.fill_(v, stream=s.obj)
        b = BM(self.next_key, obj, d, n, np.full(n, v, np.uint8), lw=self.issue(s))
        self.next_key += 1
        self.bufs.append(b)
        # DLPack deleter semantics: memory an import still holds is never handed out again
        for im in self.imports:
            if im.base.closed and im.base.dev == d:
                lo, hi = im.obj.ptr, im.obj.ptr + im.m
                if obj.ptr < hi and lo < obj.ptr + n:
                    self.fail(f"new buffer at {obj.ptr:#x}+{n} overlaps a closed producer's memory an import "
                              f"still holds ({lo:#x}+{im.m})")

    def pick_buf(self) -> Optional[BM]:
        c = self.live()
        return self.rng.choice(c) if c else None

    def op_write(self, b: Optional[BM] = None) -> None:
        """A producer-side write (fill_, or a host upload) on a random stream of its device."""
        b = b or self.pick_buf()
        if b is None:
            return self.op_alloc()
        s = self.pick_stream(b.dev)
        self.order(s, [b.lw] + b.reads)
        if self.rng.random() < 0.5:
            v = self.rng.randrange(256)
            self.note(f"fill #{b.key} v={v} sid{s.sid}")
            b.obj.fill_(v, stream=s.obj)
            b.value = np.full(b.n, v, np.uint8)
        else:
            data = np.frombuffer(self.rng.randbytes(b.n), np.uint8).copy()
            self.note(f"upload #{b.key} sid{s.sid}")
            b.obj.copy_from(data, stream=s.obj, non_blocking=True)
            b.value = data.copy()
            data[:] = 0xEE
        b.lw, b.reads, b.via_import = self.issue(s), [], False

    def source(self, b: BM):
        """The exported object: the buffer, or a uint8 view with an offset."""
        if self.rng.random() < 0.5:
            return b.obj, 0, b.n
        off = self.rng.randrange(0, b.n // 2)
        m = self.rng.randrange(1, b.n - off + 1)
        return b.obj.as_array(np.uint8, (m,), offset=off), off, m

    def consumer(self, b: BM):
        """(argument for __dlpack__(stream=), SM the model orders or None, 'host' for a host wait)."""
        if self.cuda:
            how = self.rng.choice(["obj", "obj_other", "handle", "none", "legacy", "minus1", "ptds"])
            if how == "obj_other":
                t = self.pick_stream(self.rng.choice(self.devs))
                return how, t.obj, t
            t = self.pick_stream(b.dev)
            if how == "obj":
                return how, t.obj, t
            if how == "handle":
                return how, (t.obj.handle or 1), t
            dflt = self.sm(accel.default_stream(b.dev))
            if how in ("none", "legacy"):
                return how, (None if how == "none" else 1), dflt
            return how, (-1 if how == "minus1" else 2), None
        how = self.rng.choice(["obj", "none", "minus1"])
        if how == "obj":
            t = self.pick_stream(self.rng.choice(self.devs))
            return how, t.obj, t
        return how, (None if how == "none" else -1), ("host" if how == "none" else None)

    def protocol_join(self, b: BM, last: SM, target) -> None:
        """What the __dlpack__ handshake orders (see the module docstring)."""
        if target == "host":
            self.host = join(self.host, last.vc)
        elif target is not None and target is not last:
            self.issue(last)                   # the event record marker
            target.vc = join(target.vc, last.vc)
            self.issue(target)                 # the wait

    def op_exchange(self) -> None:
        """Export with a consumer stream, import back with accel.from_dlpack, use it on the
        consumer stream: the read must see the producer's last write without any other wait."""
        b = self.pick_buf()
        if b is None:
            return self.op_alloc()
        if self.rng.random() < 0.7:
            self.op_write(b)        # pending producer work the handshake must order
        src, off, m = self.source(b)
        how, arg, target = self.consumer(b)
        last = self.sm(b.obj.last_stream)
        if not b.via_import and not hb(b.lw, join(last.vc, self.host)):
            self.fail(f"#{b.key}: last_stream sid{last.sid} is not ordered after the buffer's last write {b.lw}")
        foreign = self.rng.random() < 0.35 and how in ("obj", "obj_other", "none")
        versioned = foreign or self.rng.random() < 0.6
        self.note(f"exchange #{b.key} view={src is not b.obj} off={off} m={m} stream={how} "
                  f"{'foreign' if foreign else 'capsule'} v={versioned} last=sid{last.sid}")
        if foreign:
            prod = ForeignDLPack(src)
            if how == "none" and self.cuda:
                # from_dlpack's default: accel's current stream of the producer's device
                target = self.sm(accel.current_stream(b.dev))
                imp = accel.from_dlpack(prod)
                want = target.obj.handle or 1
                if prod.asked != [want]:
                    self.fail(f"from_dlpack passed stream {prod.asked} to the producer, not {want}")
            else:
                imp = accel.from_dlpack(prod, stream=arg)
        else:
            cap = src.__dlpack__(stream=arg, max_version=(1, 0) if versioned else None)
            imp = accel.from_dlpack(cap)
            del cap
        if isinstance(target, SM) and not hb(b.lw, join(target.vc, self.host)):
            self.note("exchange_needs_protocol")
        self.protocol_join(b, last, target)
        if isinstance(target, SM) and target.dev == b.dev and b.obj.last_stream != target.obj:
            self.fail(f"after an export to sid{target.sid}, last_stream is {b.obj.last_stream!r}")
        if imp.nbytes != m or imp.owns_memory or imp.device_index != b.dev:
            self.fail(f"import: {imp!r} owns={imp.owns_memory}, expected {m} bytes on dev{b.dev}")
        im = IM(imp, b, off, m, False)
        self.imports.append(im)
        if isinstance(target, SM) and target.dev != b.dev:
            self.peer_read(im, target)
        else:
            self.use_import(im, target if isinstance(target, SM) else None)

    def peer_read(self, im: IM, t: SM) -> None:
        """The consumer on another device's stream ``t`` copies the import into its own memory."""
        b = im.base
        dst = accel.Buffer(im.m, device=t.dev, stream=t.obj)
        self.order(t, [b.lw])
        self.note(f"peer_read #{b.key}[{im.off}:{im.off + im.m}] sid{t.sid}(dev{t.dev})")
        dst.copy_from(im.obj, stream=t.obj, non_blocking=True)
        op = self.issue(t)
        b.reads.append(op)
        got = dst.to_numpy(stream=t.obj)
        self.issue(t)
        self.host = join(self.host, t.vc)
        dst.close()
        self.compare(got, b.value[im.off:im.off + im.m], f"peer copy of an import of #{b.key} on sid{t.sid}")

    def op_reexport(self) -> None:
        """An import exported again (a consumer that is a producer in turn) and imported back:
        the chain keeps the first producer's memory alive until its last link goes."""
        if not self.imports:
            return self.op_exchange()
        im = self.rng.choice(self.imports)
        b = im.base
        if im.readonly:
            return self.use_import(im, None)
        how, arg, target = self.consumer(b)
        if isinstance(target, SM) and target.dev != b.dev:
            arg, target = -1, None
        last = self.sm(im.obj.last_stream)
        self.note(f"reexport of an import of #{b.key} stream={how} last=sid{last.sid}")
        cap = im.obj.__dlpack__(stream=arg, max_version=(1, 0))
        imp = accel.from_dlpack(cap)
        del cap
        # the handshake orders after the IMPORT's last-use stream; the producer's writes the import
        # never saw are ordered by the generator (use_import)
        self.protocol_join(b, last, target)
        if self.rng.random() < 0.5:
            old = self.imports.pop(self.imports.index(im))
            self.note("  and the first import closed")
            old.obj.close()
        new = IM(imp, b, im.off, im.m, False)
        self.imports.append(new)
        self.use_import(new, target if isinstance(target, SM) else None)

    def use_import(self, im: IM, t: Optional[SM]) -> None:
        """Read (or write) the import on the consumer stream ``t`` (no extra ordering when the
        handshake made it), else on a random stream after explicit ordering."""
        b = im.base
        if t is None:
            t = self.pick_stream(b.dev)
        write = not im.readonly and self.rng.random() < 0.35
        if write:
            self.order(t, [b.lw] + b.reads)
            v = self.rng.randrange(256)
            self.note(f"import_fill #{b.key}[{im.off}:{im.off + im.m}] v={v} sid{t.sid}")
            im.obj.fill_(v, stream=t.obj)
            b.value = b.value.copy()
            b.value[im.off:im.off + im.m] = v
            b.lw, b.reads, b.via_import = self.issue(t), [], True
        else:
            if not hb(b.lw, join(t.vc, self.host)):
                self.note("import_read_ordered_by_us")
            self.order(t, [b.lw])
            self.note(f"import_read #{b.key}[{im.off}:{im.off + im.m}] sid{t.sid}")
            got = im.obj.to_numpy(stream=t.obj)
            op = self.issue(t)
            b.reads.append(op)
            self.host = join(self.host, t.vc)
            self.compare(got, b.value[im.off:im.off + im.m], f"import of #{b.key} read on sid{t.sid}")

    def op_reuse_import(self) -> None:
        if not self.imports:
            return self.op_exchange()
        im = self.rng.choice(self.imports)
        self.use_import(im, None)

    def op_close_import(self) -> None:
        if not self.imports:
            return self.op_exchange()
        im = self.imports.pop(self.rng.randrange(len(self.imports)))
        self.note(f"close_import of #{im.base.key} ({'close' if self.rng.random() < 0.5 else 'drop'})")
        if self.rng.random() < 0.5:
            im.obj.close()
        else:
            del im.obj
            gc.collect()
        self.reap()

    def reap(self) -> None:
        for b in self.bufs:
            if b.closed and b.obj is not None and not any(i.base is b for i in self.imports):
                b.obj = None

    def op_close_producer(self) -> None:
        """Close the producer while imports may hold its memory: reads through them still see its
        bytes, and no new allocation gets the memory until the last import goes."""
        b = self.pick_buf()
        if b is None:
            return self.op_alloc()
        held = sum(i.base is b for i in self.imports)
        self.note(f"close_producer #{b.key} imports={held}")
        # no extra ordering: the caching allocator waits for the streams the buffer was used on,
        # an import's release waits for its own uses (Buffer.close, accel.from_dlpack)
        b.obj.close()
        b.closed = True
        self.reap()
        if held and self.rng.random() < 0.7:
            self.op_alloc()

    def op_cai(self) -> None:
        """A foreign __cuda_array_interface__ v3 producer over a buffer's bytes, with the buffer's
        last-use stream as "stream" (or without "stream"), copied into a new buffer."""
        if not self.cuda:
            return self.op_exchange()
        b = self.pick_buf()
        if b is None:
            return self.op_alloc()
        if self.rng.random() < 0.7:
            self.op_write(b)
        with_stream = self.rng.random() < 0.6
        cai = b.obj.__cuda_array_interface__
        last = self.sm(b.obj.last_stream)
        off = self.rng.randrange(0, b.n // 2)
        m = b.n - off
        prod = ForeignCAI(b.obj.ptr + off, m, cai["stream"] if with_stream else None)
        dst = accel.Buffer(m, device=b.dev)
        u = self.pick_stream(b.dev)
        alloc = self.sm(dst.stream)
        self.order(u, [self.issue(alloc)])
        self.note(f"cai #{b.key} off={off} stream={'last sid%d' % last.sid if with_stream else 'absent'} sid{u.sid}")
        if with_stream:
            if not hb(b.lw, join(u.vc, self.host)):
                self.note("cai_needs_protocol")
            self.protocol_join(b, last, u)
        self.order(u, [b.lw])
        dst.copy_from(prod, stream=u.obj, non_blocking=True)
        op = self.issue(u)
        b.reads.append(op)
        got = dst.to_numpy(stream=u.obj)
        self.issue(u)
        self.host = join(self.host, u.vc)
        dst.close()
        self.compare(got, b.value[off:], f"copy of a CAI producer over #{b.key}")

    def op_copy_foreign(self) -> None:
        """Buffer.copy_from / ArrayView.copy_from of a foreign DLPack producer over a buffer on
        the same device: on CUDA the producer is asked with the copy's stream (it waits for the
        producer's last-use stream), elsewhere with None (a host wait)."""
        b = self.pick_buf()
        if b is None:
            return self.op_alloc()
        if self.rng.random() < 0.7:
            self.op_write(b)
        last = self.sm(b.obj.last_stream)
        u = self.pick_stream(b.dev)
        dst = accel.Buffer(b.n, device=b.dev, stream=u.obj)
        self.issue(u)
        as_view = self.rng.random() < 0.5
        prod = ForeignDLPack(b.obj if not as_view else b.obj.as_array(np.uint8))
        self.note(f"copy_foreign #{b.key} into a {'view' if as_view else 'buffer'} sid{u.sid} last=sid{last.sid}")
        if not hb(b.lw, join(u.vc, self.host)):
            self.note("copy_foreign_needs_protocol")
        self.protocol_join(b, last, u if self.cuda else "host")
        self.order(u, [b.lw])
        if as_view:
            dst.as_array(np.uint8).copy_from(prod, stream=u.obj)
        else:
            dst.copy_from(prod, stream=u.obj, non_blocking=True)
        op = self.issue(u)
        b.reads.append(op)
        want = (u.obj.handle or 1) if self.cuda else None
        if not as_view and prod.asked != [want]:
            self.fail(f"copy_from asked the producer with stream {prod.asked}, not {want}")
        got = dst.to_numpy(stream=u.obj)
        self.issue(u)
        self.host = join(self.host, u.vc)
        dst.close()
        self.compare(got, b.value, f"copy_from a foreign DLPack producer over #{b.key}")

    def op_pinned(self) -> None:
        """Device to pinned host memory without blocking; host consumers (numpy.from_dlpack,
        torch.from_dlpack) read it once the host is ordered after the copy."""
        b = self.pick_buf()
        if b is None:
            return self.op_alloc()
        s = self.pick_stream(b.dev)
        self.order(s, [b.lw])
        arr = accel.empty_pinned(b.n, "uint8")
        self.note(f"pinned #{b.key} sid{s.sid}")
        b.obj.copy_to(arr, stream=s.obj, non_blocking=True)
        op = self.issue(s)
        b.reads.append(op)
        self.host_order([op])
        want = b.value.copy()
        self.compare(np.from_dlpack(arr), want, f"numpy.from_dlpack of a pinned copy of #{b.key}")
        torch = sys.modules.get("torch")
        if torch is not None:
            self.compare(torch.from_dlpack(arr).numpy(), want, f"torch.from_dlpack of a pinned copy of #{b.key}")
        self.refuse("from_dlpack(pinned)", lambda: accel.from_dlpack(arr), BufferError)
        # a consumer's view keeps the pinned block: drop the array, take new ones, write them
        view = np.from_dlpack(arr) if torch is None or self.rng.random() < 0.5 else torch.from_dlpack(arr)
        self.pinned.append((view, want))
        del arr
        gc.collect()
        for _ in range(2):
            other = accel.empty_pinned(b.n, "uint8")
            s2 = self.pick_stream(b.dev)
            self.order(s2, [b.lw])
            b.obj.copy_to(other, stream=s2.obj, non_blocking=True)
            b.reads.append(self.issue(s2))
            other[:0] = 0
            del other
        for v, w in self.pinned:
            self.compare(np.asarray(v), w, "a host consumer's view of a dropped pinned array")
        if len(self.pinned) > 3:
            self.pinned.pop(0)

    def op_capsule_misuse(self) -> None:
        """A capsule never consumed, or consumed twice, or a read-only import written."""
        b = self.pick_buf()
        if b is None:
            return self.op_alloc()
        what = self.rng.choice(["drop", "twice", "readonly", "bad_stream"])
        self.note(f"misuse {what} #{b.key}")
        start = self.census()
        if what == "drop":
            cap = b.obj.__dlpack__(stream=-1)
            del cap
        elif what == "twice":
            cap = b.obj.__dlpack__(stream=-1, max_version=(1, 0))
            imp = accel.from_dlpack(cap)
            self.refuse("second from_dlpack of one capsule", lambda: accel.from_dlpack(cap), BufferError)
            imp.close()
            del cap, imp
        elif what == "readonly":
            prod = ForeignDLPack(b.obj, readonly=True)
            imp = accel.from_dlpack(prod, stream=-1)
            if not imp.readonly:
                self.fail("an import of a read-only capsule is writable")
            self.refuse("fill_ of a read-only import", lambda: imp.fill_(1), ValueError)
            self.refuse("copy_from into a read-only import", lambda: imp.copy_from(np.zeros(b.n, np.uint8)), ValueError)
            self.refuse("legacy re-export of a read-only import", lambda: imp.__dlpack__(stream=-1), BufferError)
            im = IM(imp, b, 0, b.n, True)
            self.imports.append(im)
            self.use_import(im, None)
            return
        else:
            bad = [0, -2, 1.5, "x"] if self.cuda else [1, 0, 1.5]
            arg = self.rng.choice(bad)
            last = b.obj.last_stream
            self.refuse(f"__dlpack__(stream={arg!r})", lambda: b.obj.__dlpack__(stream=arg))
            if b.obj.last_stream != last:
                self.fail(f"a refused __dlpack__(stream={arg!r}) moved last_stream to {b.obj.last_stream!r}")
        gc.collect()
        if self.census() != start:
            self.fail(f"capsule {what}: live exports/capsules {start} -> {self.census()}")

    OPS = [("alloc", 2), ("write", 4), ("exchange", 8), ("reuse_import", 3), ("close_import", 3),
           ("close_producer", 2), ("cai", 3), ("pinned", 2), ("capsule_misuse", 2),
           ("reexport", 2), ("copy_foreign", 2)]

    def plan(self, ops: int):
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        return [(self.rng.choices(names, weights)[0], self.rng.getrandbits(32)) for _ in range(ops)]

    def run(self, plan) -> None:
        try:
            for self.step, (name, sub) in enumerate(plan):
                self.rng = random.Random(sub)
                getattr(self, "op_" + name)()
            self.step = len(plan)
            self.teardown()
        except Mismatch:
            raise
        except Exception as exc:     # noqa: BLE001
            self.fail(f"{type(exc).__name__}: {exc}")

    def teardown(self) -> None:
        self.note("teardown")
        self.rng = random.Random(self.seed ^ 0x5EED)
        for im in list(self.imports):
            self.use_import(im, None)
        for b in self.bufs:
            if not b.closed:
                self.host_order([b.lw] + b.reads)
                self.compare(b.obj.to_numpy(), b.value, f"#{b.key} at the end")
        for im in self.imports:
            im.obj.close()
        self.imports.clear()
        self.pinned.clear()
        for b in self.bufs:
            if not b.closed:
                b.obj.close()
            b.obj = None
        for d in self.devs:
            accel.synchronize(d)
        for s in self.streams.values():
            if s.obj != accel.default_stream(s.dev):
                s.obj.close()


def start(monkeypatch, kind: str):
    env = {"ACCEL_SIM_DELAY_US": DELAY_US}
    if kind != "mps":
        env["ACCEL_SIM_DEVICES"] = 2
    use_sim(monkeypatch, kind, **env)
    for d in range(accel.device_count()):
        accel.Buffer(4, device=d).close()
        accel.synchronize(d)
    gc.collect()
    return {d: memory.memory_allocated(d) for d in range(accel.device_count())}


def live_buffers() -> int:
    return sum(type(o) is accel.Buffer for o in gc.get_objects())


def run_program(monkeypatch, kind: str, seed: int, ops: int = OPS, plan=None) -> Program:
    base = start(monkeypatch, kind)
    census = (_dlpack.live_exports(), len(_dlpack._capsules), live_buffers())
    prog = Program(kind, seed)
    plan = prog.plan(ops) if plan is None else plan
    faulthandler.dump_traceback_later(120, exit=True, file=sys.stderr)
    try:
        prog.run(plan)
    finally:
        faulthandler.cancel_dump_traceback_later()
    prog.streams.clear()
    prog.by_sid.clear()
    gc.collect()
    for d in prog.devs:
        accel.synchronize(d)
        if memory.memory_allocated(d) != base[d]:
            prog.fail(f"dev{d}: memory_allocated {memory.memory_allocated(d)} at the end, {base[d]} at the start")
    now = (_dlpack.live_exports(), len(_dlpack._capsules), live_buffers())
    if now != census:
        prog.fail(f"live exports/capsules/Buffers {census} at the start, {now} at the end")
    return prog


BASE_SEED = {"cuda": 0, "xpu": 100000, "mps": 200000}


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_interop_ordering_fuzz(monkeypatch, kind):
    try:
        import torch  # noqa: F401  (a CPU consumer of pinned memory)
    except ImportError:
        pass
    counts: Dict[str, int] = {}
    first = BASE_SEED[kind] + int(os.environ.get("R65M_BASE", "0"))
    for seed in range(first, first + SEEDS):
        prog = run_program(monkeypatch, kind, seed)
        for k, v in prog.counts.items():
            counts[k] = counts.get(k, 0) + v
        accel._lazy._reset_for_tests()
    assert counts.get("exchange", 0) > 0 and counts.get("import_read", 0) > 0


# ------------------------------------------------- named cases (shrunk from / leaned on by the sweep)
def _gated(monkeypatch):
    """A CUDA buffer of device 0 whose last-use stream holds a fill of 7 behind a host gate."""
    from torch_port_util import hold
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50, ACCEL_SIM_DEVICES=2)
    producer = accel.Stream(0)
    buf = accel.Buffer(4096, device=0, stream=producer)
    buf.fill_(1, stream=producer)
    producer.synchronize()
    gate = hold(producer)
    buf.fill_(7, stream=producer)
    return buf, producer, gate


def _waits(stream) -> bool:
    """The simulated ``stream`` still has work queued (it waits for the gate)."""
    from accel import streams as _streams
    backend = accel._lazy.lazy_init()
    with _streams.on_device(backend, stream.device_index):
        return not backend.stream_query(stream.handle)


def test_from_dlpack_orders_the_producer_before_a_stream_of_another_device(monkeypatch):
    """accel.from_dlpack(obj, stream=s): "the producer orders its pending work before accel's"
    stream.  With s a created stream of device 1 and the producer on device 0, the producer gets
    s's handle (a cudaStream_t names one stream whatever the current device) and s waits."""
    buf, producer, gate = _gated(monkeypatch)
    try:
        s = accel.Stream(1)
        prod = ForeignDLPack(buf)
        imp = accel.from_dlpack(prod, stream=s)
        assert prod.asked == [s.handle]
        assert _waits(s)
    finally:
        gate.set()
    accel.synchronize(0)
    accel.synchronize(1)
    assert (imp.to_numpy() == 7).all()
    imp.close()
    buf.close()


def test_from_dlpack_orders_the_producer_before_another_devices_default_stream(monkeypatch):
    """The same with s = device 1's default (legacy) stream: _ask passes the DLPack value 1
    ("the legacy default stream"), which a producer on device 0 can only read as device 0's
    legacy stream (accel's own producer does: _consumer_handle maps 1 to the buffer's device; so
    would torch).  Device 1's default stream is left unordered: work the consumer queues there
    reads the buffer before the producer's pending fill of 7 ran."""
    buf, producer, gate = _gated(monkeypatch)
    try:
        s = accel.default_stream(1)
        imp = accel.from_dlpack(ForeignDLPack(buf), stream=s)
        ordered = _waits(s)
    finally:
        gate.set()
    accel.synchronize(0)
    accel.synchronize(1)
    imp.close()
    buf.close()
    assert ordered, "device 1's default stream does not wait for the producer's pending work"


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_import_outlives_its_closed_producer_and_its_memory_is_not_reused(monkeypatch, kind):
    """DLPack deleter semantics (dlpack.h: the producer's memory stays until the consumer calls the
    deleter): a producer closed while its import lives keeps its bytes and its memory; the memory
    goes back (memory_allocated) only when the import goes, once."""
    use_sim(monkeypatch, kind)
    base = memory.memory_allocated(0)
    buf = accel.Buffer(4096)
    buf.fill_(9)
    view = buf.as_array(np.uint8, (1000,), offset=96)
    imp = accel.from_dlpack(view.__dlpack__(max_version=(1, 0)))
    del view
    buf.close()
    others = [accel.Buffer(4096) for _ in range(3)]
    for o in others:
        o.fill_(3)
        assert not (o.ptr < imp.ptr + imp.nbytes and imp.ptr < o.ptr + o.nbytes)
    assert (imp.to_numpy() == 9).all()
    for o in others:
        o.close()
    assert memory.memory_allocated(0) == base + 4096
    imp.close()
    gc.collect()
    assert memory.memory_allocated(0) == base
    assert _dlpack.live_exports() == 0


def test_pinned_memory_held_by_a_torch_view_is_not_handed_out_again(monkeypatch):
    """A torch CPU tensor over an accel.empty_pinned array (torch.from_dlpack) keeps the pinned
    block after the array is dropped ("the memory returns to the cache when the array and every
    view of it are gone"): new pinned arrays written by the device do not change it."""
    torch = pytest.importorskip("torch")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    buf = accel.Buffer(4096).fill_(5)
    arr = accel.empty_pinned(4096, "uint8")
    buf.copy_to(arr, non_blocking=True)
    accel.current_stream().synchronize()
    t = torch.from_dlpack(arr)
    del arr
    gc.collect()
    buf.fill_(6)
    for _ in range(3):
        other = accel.empty_pinned(4096, "uint8")
        buf.copy_to(other, non_blocking=True)
    accel.synchronize()
    assert (t.numpy() == 5).all()
    buf.close()
