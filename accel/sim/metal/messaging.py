"""libobjc: ``objc_msgSend`` cast to each method's C type, and the runtime's C functions.

The simulated ``objc_msgSend`` (:class:`_MsgSendSymbol`) can only be used through
``ffi.cast`` (a variadic call is undefined on arm64): :class:`SimFFI` is the real objc FFI
whose ``cast`` of it yields a :class:`_Sender`.  The sender checks the cast C type against the
selector's declaration (:mod:`.signatures`), converts the arguments as cffi would, counts and
faults the messages of :data:`COUNTED`, and dispatches to the receiver's ``m_<name>`` method
under the runtime lock (``waitUntilCompleted`` outside it, since it blocks).
:class:`SimObjCLibrary` is libobjc's C functions (classes, selectors, retain/release,
autorelease pools) over the runtime state of :mod:`.runtime`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from .. import core
from .objects import SimClass, SimObject
from .rules import COUNTED, NIL_ON_FAULT, MetalValidationError
from .runtime import _State
from .signatures import DECLARED


class _MsgSendSymbol:
    """The simulated ``objc_msgSend``: only usable through ``ffi.cast`` (as on arm64)."""

    def __call__(self, *args):
        raise MetalValidationError("objc_msgSend called without a cast to the method's exact type "
                                   "(variadic call: undefined behaviour on arm64)")


def _type_key(ffi, ctype) -> Tuple:
    """How the ABI sees a C type: (kind, size, signedness/name)."""
    if ctype.kind == "pointer":
        return ("pointer",)
    if ctype.kind == "struct":
        return ("struct", ctype.cname.replace("struct ", "").lstrip("_"))
    if ctype.kind == "void":
        return ("void",)
    if ctype.kind == "primitive":
        size = ffi.sizeof(ctype)
        if ctype.cname in ("float", "double", "long double"):
            return ("float", size)
        signed = int(ffi.cast(ctype, -1)) < 0 if ctype.cname != "_Bool" else False
        return ("int", size, signed, ctype.cname == "_Bool")
    return (ctype.kind, ctype.cname)


class _Sender:
    """``objc_msgSend`` cast to one C function type."""

    def __init__(self, rt: _State, ctype):
        self.rt = rt
        self.ctype = ctype
        self.checked: Dict[str, bool] = {}

    def _check_signature(self, selector: str) -> None:
        if selector in self.checked:
            return
        from accel.backends._objc import C_TYPES
        ffi = self.rt.ffi
        declared = DECLARED.get(selector)
        if declared is None:
            raise MetalValidationError(f"the Metal simulator does not implement {selector!r}; "
                                       f"add its declaration to accel.sim.metal.DECLARED")
        restype, argtypes = declared
        want = [_type_key(ffi, ffi.typeof(C_TYPES[t])) for t in (restype,) + argtypes]
        got = [_type_key(ffi, self.ctype.result)] + [_type_key(ffi, a) for a in self.ctype.args[2:]]
        fixed = [_type_key(ffi, a) for a in self.ctype.args[:2]]
        if fixed != [("pointer",), ("pointer",)] or want != got:
            raise MetalValidationError(
                f"objc_msgSend cast to {self.ctype.cname} for {selector!r}, declared as "
                f"{restype} ({', '.join(('id', 'SEL') + argtypes)}): the ABI would not match")
        self.checked[selector] = True

    def _arg(self, ctype, value):
        """Convert one argument as a cffi call would (and validate it)."""
        ffi = self.rt.ffi
        if ctype.kind == "pointer":
            if value is None:
                raise TypeError(f"initializer for ctype '{ctype.cname}' must be a cdata pointer, not None")
            if isinstance(value, bytes) and ctype.item.cname in ("char", "void"):
                return value
            if not isinstance(value, ffi.CData):
                raise TypeError(f"initializer for ctype '{ctype.cname}' must be a cdata pointer, "
                                f"not {type(value).__name__}")
            return value
        if ctype.kind == "struct":
            if not isinstance(value, ffi.CData) or ffi.typeof(value) is not ctype:
                raise TypeError(f"expected a {ctype.cname} struct by value, got {value!r}")
            return value
        return ffi.new(ctype.cname + " *", value)[0]

    def _object(self, value) -> Optional[SimObject]:
        addr = int(self.rt.ffi.cast("uintptr_t", value))
        return None if addr == 0 else self.rt.get(addr)

    @core.deferred      # atomic for Python signal handlers, as a C call (core)
    def __call__(self, receiver, sel, *args):
        rt, ffi = self.rt, self.rt.ffi
        selector = rt.selectors.get(int(ffi.cast("uintptr_t", sel)))
        if selector is None:
            raise MetalValidationError("objc_msgSend with a SEL that sel_registerName did not return")
        self._check_signature(selector)
        declared_args = DECLARED[selector][1]
        argc = len(self.ctype.args) - 2
        if len(args) != argc:
            raise TypeError(f"{selector}: expected {argc} arguments, got {len(args)}")
        target = self._object(receiver)
        if target is None:
            return self._result(None)  # messages to nil return zero
        if selector in COUNTED:
            next(core.counter_box(selector)[0])
            if selector in NIL_ON_FAULT and core.take_fault(selector):
                return self._result(None)
        values = []
        keep = []   # bytes arguments' copies, alive for the call
        for objc_type, ctype, value in zip(declared_args, self.ctype.args[2:], args):
            value = self._arg(ctype, value)
            if objc_type == "id":
                value = self._object(value)
            elif objc_type == "id *":
                value = None if value == ffi.NULL else ffi.cast("void **", value)
            elif ctype.kind == "pointer":
                if isinstance(value, bytes):
                    # cffi passes a bytes object to a char * / void * parameter as a pointer to its
                    # data (NUL-terminated, as CPython keeps it): the method sees an address, as on a
                    # Mac (r69e: newBufferWithBytes:/setBytes: raised TypeError for bytes).
                    keep.append(ffi.new("char[]", value))
                    value = keep[-1]
                value = int(ffi.cast("uintptr_t", value))
            values.append(value)
        fn = target.method(selector)
        if selector != "waitUntilCompleted":
            with rt.lock:
                result = fn(*values)
        else:
            result = fn(*values)  # blocks: must not hold the lock the workers need
        return self._result(result)

    def _result(self, value):
        ffi, res = self.rt.ffi, self.ctype.result
        if res.kind == "void":
            return None
        if res.kind == "pointer":
            if value is None:
                return ffi.cast(res, 0)
            if isinstance(value, SimObject):
                return ffi.cast(res, value.addr)
            if isinstance(value, ffi.CData):
                return ffi.cast(res, value)
            return ffi.cast(res, value)
        if res.kind == "struct":
            return value
        return ffi.new(res.cname + " *", 0 if value is None else value)[0]


class SimFFI:
    """The real objc FFI, except ``cast`` of the simulated ``objc_msgSend``."""

    def __init__(self, ffi, rt: _State, symbol: _MsgSendSymbol):
        self._ffi = ffi
        self._rt = rt
        self._symbol = symbol

    def cast(self, ctype, value):
        if value is self._symbol:
            t = self._ffi.typeof(ctype) if isinstance(ctype, str) else ctype
            if t.kind != "function":  # cffi's kind for a pointer-to-function type
                raise TypeError("objc_msgSend must be cast to a function pointer type")
            if t.ellipsis:
                raise MetalValidationError("objc_msgSend cast to a variadic type (wrong on arm64)")
            return _Sender(self._rt, t)
        return self._ffi.cast(ctype, value)

    def __getattr__(self, name):
        return getattr(self._ffi, name)


class SimObjCLibrary:
    """libobjc's functions, over :class:`_State`."""

    def __init__(self, rt: _State):
        self._rt = rt
        self.objc_msgSend = _MsgSendSymbol()

    def _addr(self, p) -> int:
        return int(self._rt.ffi.cast("uintptr_t", p))

    def _name(self, p) -> str:
        return (p if isinstance(p, bytes) else self._rt.ffi.string(p)).decode()

    def objc_getClass(self, name):
        cls = self._rt.classes.get(self._name(name))
        return self._rt.ffi.cast("void *", cls.addr if cls else 0)

    def sel_registerName(self, name):
        rt, text = self._rt, self._name(name)
        with rt.lock:
            addr = rt.selector_addr.get(text)
            if addr is None:
                addr = rt.next_addr
                rt.next_addr += 0x40
                rt.selector_addr[text] = addr
                rt.selectors[addr] = text
                rt.selector_names[text] = rt.ffi.new("char[]", text.encode())
        return rt.ffi.cast("void *", addr)

    def sel_getName(self, sel):
        return self._rt.selector_names[self._rt.selectors[self._addr(sel)]]

    @core.deferred
    def objc_retain(self, obj):
        addr = self._addr(obj)
        if addr:
            self._rt.retain(self._rt.get(addr))
        return obj

    @core.deferred
    def objc_release(self, obj):
        addr = self._addr(obj)
        if addr:
            self._rt.release(self._rt.get(addr))

    @core.deferred
    def objc_autorelease(self, obj):
        addr = self._addr(obj)
        if addr:
            self._rt.autorelease(self._rt.get(addr))
        return obj

    @core.deferred
    def objc_autoreleasePoolPush(self):
        return self._rt.ffi.cast("void *", self._rt.pool_push())

    @core.deferred
    def objc_autoreleasePoolPop(self, token):
        self._rt.pool_pop(self._addr(token))

    def object_getClassName(self, obj):
        obj = self._rt.get(self._addr(obj))
        name = obj.name if isinstance(obj, SimClass) else obj.cls_name
        return self._rt.ffi.new("char[]", name.encode())

    def object_getClass(self, obj):
        obj = self._rt.get(self._addr(obj))
        cls = self._rt.classes.get(obj.cls_name)
        return self._rt.ffi.cast("void *", cls.addr if cls else 0)
