"""The Objective-C object model: objects, classes, and the Foundation objects Metal answers with.

:class:`SimObject` is an object with a class name, a retain count, an address registered in
the runtime (:mod:`.runtime`) and its selectors as ``m_<name>`` methods (``:`` becomes
``_``); :meth:`SimObject.dealloc` runs when the count reaches zero.  :class:`SimClass` is
what ``objc_getClass`` answers (class methods, ``new``/``alloc`` through a factory; never
deallocated).  :class:`NSString` and :class:`NSError` are the Foundation objects the Metal
messages take and return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Optional

from .rules import MetalValidationError

if TYPE_CHECKING:
    from .runtime import _State


class SimObject:
    """An Objective-C object: class name, retain count, selector methods (``m_<name>``)."""

    cls_name = "NSObject"

    def __init__(self, rt: "_State"):
        self.rt = rt
        self.rc = 1
        self.addr = rt.register(self)

    def dealloc(self) -> None:
        """Called when the retain count reaches zero (release what this object holds)."""

    def method(self, selector: str) -> Callable:
        fn = getattr(self, "m_" + selector.replace(":", "_"), None)
        if fn is None:
            raise MetalValidationError(
                f"-[{self.cls_name} {selector}]: unrecognized selector sent to instance {self.addr:#x}")
        return fn

    # NSObject
    def m_retain(self):
        self.rt.retain(self)
        return self

    def m_release(self):
        self.rt.release(self)

    def m_autorelease(self):
        return self.rt.autorelease(self)

    def m_retainCount(self):
        return self.rc


class SimClass(SimObject):
    """A class object: ``objc_getClass`` result; class methods are ``c_<name>``."""

    cls_name = "Class"

    def __init__(self, rt: "_State", name: str, factory: Optional[Callable] = None,
                 class_methods: Optional[Dict[str, Callable]] = None):
        super().__init__(rt)
        self.name = name
        self.factory = factory
        self.class_methods = class_methods or {}
        self.rc = 1 << 62  # classes are never deallocated

    def method(self, selector: str) -> Callable:
        if selector in self.class_methods:
            return self.class_methods[selector]
        if selector in ("new", "alloc") and self.factory is not None:
            return lambda: self.factory(self.rt)  # +1
        raise MetalValidationError(f"+[{self.name} {selector}]: unrecognized selector sent to class")


class NSString(SimObject):
    cls_name = "NSString"

    def __init__(self, rt, text: str):
        super().__init__(rt)
        self.text = text
        self._utf8 = rt.ffi.new("char[]", text.encode("utf-8"))

    def m_UTF8String(self):
        return self._utf8

    def m_length(self):
        return len(self.text.encode("utf-16-le")) // 2


class NSError(SimObject):
    cls_name = "NSError"

    def __init__(self, rt, code: int, text: str):
        super().__init__(rt)
        self.code, self.text = code, text

    def m_code(self):
        return self.code

    def m_localizedDescription(self):
        return self.rt.autorelease(NSString(self.rt, self.text))
