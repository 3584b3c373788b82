"""The simulated Objective-C runtime's state: objects, retain counts, zombies, autorelease pools.

One :class:`_State` per opened simulator holds every live object by address, with the
addresses of deallocated ones (the last ``ZOMBIES_KEPT``, as NSZombie reports them), the
selectors ``sel_registerName`` interned, each thread's autorelease pools, the engine whose
queues run the command buffers (:mod:`accel.sim._engine`), the memory table kernels
range-check against (:mod:`accel.sim._memory`), the classes ``objc_getClass`` finds and the
system device.  Retain and release follow Apple's memory management policy (an over-release
is refused where a Mac crashes).  After ``fork`` the state stays usable only when Metal was
never started in the parent; otherwise every message to an inherited Metal object fails.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .. import _engine, _memory
from .compiler import MTLCompileOptions
from .objects import NSError, NSString, SimClass, SimObject
from .rules import ZOMBIES_KEPT, MetalValidationError, _METAL_PREFIXES, _forked

if TYPE_CHECKING:
    from .device import MTLDevice


class _State:
    """One simulated Objective-C runtime + Metal: objects, retain counts, pools, queues."""

    def __init__(self, ffi) -> None:
        self.ffi = ffi
        self.lock = threading.RLock()
        self.engine = _engine.Engine(self._engine_error)
        self.table = _memory.MemoryTable()
        self.objects: Dict[int, SimObject] = {}
        self.zombies: "collections.OrderedDict[int, str]" = collections.OrderedDict()
        self.forked = False   # set in a forked child: inherited Metal objects fail there
        self.next_addr = 0x7F5100000000
        self.selectors: Dict[int, str] = {}
        self.selector_addr: Dict[str, int] = {}
        self.selector_names: Dict[str, Any] = {}
        self.tls = threading.local()
        self.leaked_autoreleases = 0
        self.runtime_initialized = False
        self.engine_errors: List[str] = []
        self.device: Optional[MTLDevice] = None
        self.classes: Dict[str, SimClass] = {}
        self._define_classes()

    def after_fork(self) -> bool:
        """In a forked child: True when this state stays usable (Metal was never started in the
        parent, only libobjc and the framework loaded), else mark it forked and answer False."""
        if self.runtime_initialized:
            self.forked = True
            return False
        # No device, so no Metal object, queue or buffer exists; the parent's threads and locks
        # do not exist here: fresh ones.
        self.lock = threading.RLock()
        self.engine = _engine.Engine(self._engine_error)
        self.tls = threading.local()
        _memory.forget(self.table)
        self.table = _memory.MemoryTable()
        return True

    def _engine_error(self, queue, exc: BaseException) -> None:
        self.engine_errors.append(f"{queue.label}: {type(exc).__name__}: {exc}")

    def _define_classes(self) -> None:
        def string_with_utf8(ptr):
            # Apple, NSString init(utf8String:): "A NULL-terminated C array of bytes in UTF-8 encoding.
            # This value must not be NULL" (a Mac raises NSInvalidArgumentException), and the
            # initializer is failable ("convenience init?"): bytes that are not UTF-8 give nil.
            # r69e: the bytes after a NUL were kept, a char[] cdata, NULL and non-UTF-8 bytes raised
            # Python errors out of objc_msgSend.
            if not ptr:
                raise MetalValidationError("+[NSString stringWithUTF8String:]: NULL cString (NSString "
                                           "init(utf8String:): \"This value must not be NULL\"; a Mac raises "
                                           "NSInvalidArgumentException)")
            raw = self.ffi.string(self.ffi.cast("char *", ptr))     # C reads up to the first NUL
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                return None
            return self.autorelease(NSString(self, text))

        for name, factory, methods in (
                ("NSObject", None, {}),
                ("NSString", None, {"stringWithUTF8String:": string_with_utf8}),
                ("MTLCompileOptions", MTLCompileOptions, {})):
            self.classes[name] = SimClass(self, name, factory, methods)

    def close(self) -> None:
        self.engine.shutdown()
        self.table.close()

    # -- registry -------------------------------------------------------------
    def _address(self) -> int:
        with self.lock:
            addr = self.next_addr
            self.next_addr += 0x40
        return addr

    def register(self, obj: SimObject) -> int:
        with self.lock:
            addr = self._address()
            self.objects[addr] = obj
        return addr

    def get(self, addr: int) -> SimObject:
        obj = self.objects.get(addr)
        if obj is None:
            if addr in self.zombies:
                raise MetalValidationError(f"message sent to deallocated instance {addr:#x} "
                                           f"({self.zombies[addr]})")
            raise MetalValidationError(f"{addr:#x} is not an Objective-C object (or one deallocated "
                                       f"long ago)")
        if self.forked and obj.cls_name.startswith(_METAL_PREFIXES):
            _forked(f"message to {obj.cls_name} {addr:#x}")
        return obj

    def retain(self, obj: SimObject) -> SimObject:
        with self.lock:
            if obj.rc <= 0:
                raise MetalValidationError(f"retain of deallocated {obj.cls_name} {obj.addr:#x}")
            obj.rc += 1
        return obj

    def release(self, obj: SimObject) -> None:
        # Apple, "Advanced Memory Management Programming Guide" (Memory Management Policy): "You own
        # any object you create" (alloc/new/copy/mutableCopy), "You must not relinquish ownership of
        # an object you do not own": a release the caller did not own shows up here as the pool's
        # (or the owner's) later release of a deallocated object, refused, where a Mac crashes.
        with self.lock:
            if obj.rc <= 0:
                raise MetalValidationError(f"over-release of {obj.cls_name} {obj.addr:#x}")
            obj.rc -= 1
            if obj.rc == 0:
                del self.objects[obj.addr]
                zombies = self.zombies
                zombies[obj.addr] = obj.cls_name
                if len(zombies) > ZOMBIES_KEPT:
                    zombies.popitem(last=False)
                obj.dealloc()

    def autorelease(self, obj: SimObject) -> SimObject:
        pools = getattr(self.tls, "pools", None)
        if not pools:
            self.leaked_autoreleases += 1  # "autoreleased with no pool in place - just leaking"
        else:
            pools[-1][1].append(obj)
        return obj

    def pool_push(self) -> int:
        pools = getattr(self.tls, "pools", None)
        if pools is None:
            pools = self.tls.pools = []
        token = self._address()
        pools.append((token, []))
        return token

    def pool_pop(self, token: int) -> None:
        pools = getattr(self.tls, "pools", None) or []
        if token not in [t for t, _ in pools]:
            raise MetalValidationError(f"objc_autoreleasePoolPop({token:#x}): not a pool of this thread")
        failure = None
        while pools:
            t, objs = pools.pop()
            for obj in objs:
                try:
                    self.release(obj)
                except MetalValidationError as exc:   # drain the rest all the same, report the first
                    failure = failure or exc
            if t == token:
                break
        if failure is not None:
            raise failure

    def set_error(self, out, code: int, text: str) -> None:
        if out is not None:
            out[0] = self.ffi.cast("void *", self.autorelease(NSError(self, code, text)).addr)

    def live(self) -> List[SimObject]:
        """Objects not yet deallocated (classes excluded)."""
        with self.lock:
            return [o for o in self.objects.values() if not isinstance(o, SimClass)]

    def live_counts(self) -> Dict[str, int]:
        """{class name: live instances}."""
        counts: Dict[str, int] = {}
        for o in self.live():
            counts[o.cls_name] = counts.get(o.cls_name, 0) + 1
        return counts
