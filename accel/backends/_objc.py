"""Objective-C message sending over libobjc through cffi.

Apple's runtime calls every method through ``objc_msgSend``, a trampoline
that jumps to the method's implementation with the caller's registers left
as they are.  It therefore has no prototype of its own: each call site must
call it through a function pointer of the *exact* C type of the method.  On
arm64 calling it variadically is wrong (variadic arguments go on the stack,
the implementation reads registers), so :class:`Runtime` never does that: a
:class:`Message` names a selector with its return and argument types, and
the runtime casts ``objc_msgSend`` once per distinct signature and caches
the cast pointer and the registered selector.

Ownership follows Cocoa's rules: methods of the ``alloc``/``new``/``copy``/
``mutableCopy`` families return an object the caller owns (+1) and must
release; every other method returns an object it does not own (+0,
autoreleased or owned by the receiver), which must be retained to be kept
past the enclosing autorelease pool.  :attr:`Message.returns_retained` says
which.  Callers wrap work that creates autoreleased objects in
:meth:`Runtime.pool`.

The runtime object wrapped here is the cffi library from ``accel._ffi``
(``open_library("objc")``) or, under ``ACCEL_SIM=mps``, the simulated one
from ``accel.sim.metal``; both expose the same functions and take the same
cffi arguments.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any, Dict, Iterator, Tuple

from .._locks import _call, _consume

__all__ = ["Message", "Runtime", "C_TYPES", "returns_retained"]

# Objective-C / Foundation / Metal scalar typedefs -> the C type the ABI sees.
# BOOL is ``bool`` on arm64 and ``signed char`` on x86_64 (objc/objc.h,
# OBJC_BOOL_IS_BOOL); both are one byte in the first return/argument register.
_BOOL = "_Bool" if os.uname().machine in ("arm64", "aarch64") else "signed char"
C_TYPES: Dict[str, str] = {
    "void": "void",
    "id": "void *",          # any object (receiver, argument or result)
    "Class": "void *",
    "SEL": "void *",
    "id *": "void **",       # NSError ** out-arguments
    "BOOL": _BOOL,
    "NSUInteger": "unsigned long",
    "NSInteger": "long",
    "uint64_t": "uint64_t",
    "CFTimeInterval": "double",
    "const char *": "const char *",
    "const void *": "const void *",
    "void *": "void *",
    "MTLSize": "MTLSize",    # struct {NSUInteger width, height, depth}, passed by value
    "NSRange": "NSRange",    # struct {NSUInteger location, length}, passed by value
    "uint8_t": "uint8_t",
}

_FAMILY = re.compile(r"^_*(alloc|new|copy|mutableCopy)(?![a-z])")


def returns_retained(selector: str) -> bool:
    """True when ``selector`` belongs to a method family that returns +1 objects.

    Cocoa naming convention (clang "method families"): the selector's first
    camel-case word is ``alloc``, ``new``, ``copy`` or ``mutableCopy``;
    ``newBufferWithLength:options:`` is, ``newline`` or ``copyright`` would not be.
    """
    return bool(_FAMILY.match(selector))


class Message:
    """One Objective-C method signature: selector, return type, argument types.

    Types are Objective-C names from :data:`C_TYPES` (``"id"``, ``"NSUInteger"``,
    ``"MTLSize"``...).  The receiver and selector arguments are implicit.
    """

    __slots__ = ("selector", "restype", "argtypes", "ctype", "returns_retained")

    def __init__(self, selector: str, restype: str = "id", *argtypes: str):
        if selector.count(":") != len(argtypes):
            raise ValueError(f"selector {selector!r} takes {selector.count(':')} arguments, "
                             f"{len(argtypes)} types given")
        for t in (restype,) + argtypes:
            if t not in C_TYPES:
                raise ValueError(f"unknown Objective-C type {t!r} in {selector!r}; "
                                 f"add it to accel.backends._objc.C_TYPES")
        self.selector = selector
        self.restype = restype
        self.argtypes = argtypes
        args = ", ".join(["void *", "void *"] + [C_TYPES[t] for t in argtypes])
        self.ctype = f"{C_TYPES[restype]} (*)({args})"
        self.returns_retained = returns_retained(selector)

    def __repr__(self) -> str:
        return f"Message({self.selector!r}: {self.ctype})"


STRING_WITH_UTF8 = Message("stringWithUTF8String:", "id", "const char *")
UTF8_STRING = Message("UTF8String", "const char *")
LOCALIZED_DESCRIPTION = Message("localizedDescription", "id")
ERROR_CODE = Message("code", "NSInteger")


class Runtime:
    """libobjc: classes, cached selectors, typed message sends, ownership.

    ``ffi``/``lib`` are the cffi FFI and library for libobjc (with
    ``objc_msgSend`` declared as ``void objc_msgSend(void)``).  Objects are
    cffi ``void *`` values; ``ffi.NULL`` is nil.  Thread-safe.
    """

    def __init__(self, ffi: Any, lib: Any):
        self.ffi = ffi
        self.lib = lib
        self.nil = ffi.NULL
        self._lock = threading.Lock()
        self._selectors: Dict[str, Any] = {}
        self._classes: Dict[str, Any] = {}
        self._senders: Dict[str, Any] = {}

    # -- lookups -------------------------------------------------------------
    def selector(self, name: str) -> Any:
        """The registered SEL for ``name`` (registered once, then cached)."""
        sel = self._selectors.get(name)
        if sel is None:
            sel = self.lib.sel_registerName(name.encode())
            with self._lock:
                self._selectors[name] = sel
        return sel

    def cls(self, name: str) -> Any:
        """The class object named ``name``; LookupError when the runtime has no such class."""
        c = self._classes.get(name)
        if c is None:
            c = self.lib.objc_getClass(name.encode())
            if c == self.ffi.NULL:
                raise LookupError(f"Objective-C class {name} is not loaded (objc_getClass returned nil)")
            with self._lock:
                self._classes[name] = c
        return c

    def _sender(self, msg: Message) -> Any:
        fn = self._senders.get(msg.ctype)
        if fn is None:
            # One cast per C signature, never a variadic call (arm64 ABI).
            fn = self.ffi.cast(msg.ctype, self.lib.objc_msgSend)
            with self._lock:
                self._senders[msg.ctype] = fn
        return fn

    # -- sending -------------------------------------------------------------
    def send(self, receiver: Any, msg: Message, *args: Any) -> Any:
        """``[receiver selector args...]`` through ``objc_msgSend`` cast to ``msg``'s type.

        Returns what the method returns (a ``void *`` cdata for objects).
        Ownership is the caller's business: see :attr:`Message.returns_retained`.
        """
        if receiver == self.nil:
            raise ValueError(f"message {msg.selector!r} sent to nil")
        return self._sender(msg)(receiver, self.selector(msg.selector), *args)

    def send_class(self, class_name: str, msg: Message, *args: Any) -> Any:
        """``[ClassName selector args...]``."""
        return self.send(self.cls(class_name), msg, *args)

    # -- ownership -----------------------------------------------------------
    def retain(self, obj: Any) -> Any:
        """+1 on ``obj`` (keeps a +0 result alive past its autorelease pool); returns it."""
        if obj is not None and obj != self.nil:
            self.lib.objc_retain(obj)
        return obj

    def release(self, obj: Any) -> None:
        """-1 on ``obj``; nil (or None) is ignored."""
        if obj is not None and obj != self.nil:
            self.lib.objc_release(obj)

    def owned(self, msg: Message, obj: Any) -> Any:
        """Make the result of ``msg`` owned by the caller (+1) whatever its family."""
        return obj if msg.returns_retained else self.retain(obj)

    @contextlib.contextmanager
    def pool(self) -> Iterator[None]:
        """An autorelease pool around a block of sends; +0 objects die at exit."""
        tokens: list = []
        try:
            # the push and the token's store in one C step: a KeyboardInterrupt as the push returned
            # left a pool pushed that nobody popped (r70i)
            _consume(map(tokens.append, map(_call, (self.lib.objc_autoreleasePoolPush,))))
            yield
        finally:
            if tokens:
                self.lib.objc_autoreleasePoolPop(tokens[0])

    # -- conversions -----------------------------------------------------------
    def ns_string(self, text: str) -> Any:
        """A +0 (autoreleased) NSString holding ``text``; call inside :meth:`pool`."""
        return self.send_class("NSString", STRING_WITH_UTF8, text.encode())

    def string(self, ns_string: Any) -> str:
        """The text of an NSString (nil reads as "")."""
        if ns_string == self.nil:
            return ""
        p = self.send(ns_string, UTF8_STRING)
        return self.ffi.string(p).decode("utf-8", "replace") if p != self.nil else ""

    def error_text(self, ns_error: Any) -> Tuple[int, str]:
        """(code, localizedDescription) of an NSError; (0, "") for nil."""
        if ns_error == self.nil:
            return 0, ""
        return (int(self.send(ns_error, ERROR_CODE)),
                self.string(self.send(ns_error, LOCALIZED_DESCRIPTION)))

    def class_name(self, obj: Any) -> str:
        return self.ffi.string(self.lib.object_getClassName(obj)).decode()

    def address(self, ptr: Any) -> int:
        """A ``void *`` as a Python int (0 for nil)."""
        return int(self.ffi.cast("uintptr_t", ptr))


