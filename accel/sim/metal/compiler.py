"""The simulated MSL compiler: libraries, functions, compute pipelines.

``newLibraryWithSource:options:error:`` reads the Metal Shading Language text as far as the
simulator needs: comments are blanked (MSL is C++14), ``#error``, ``double`` (MSL has none),
unbalanced brackets and a kernel defined twice fail the compile with
``MTLLibraryErrorCompileFailure``; each ``kernel void NAME(`` is a function of the library,
with its ``[[max_total_threads_per_threadgroup(N)]]`` and the ``threadgroup`` variables its body
declares (the pipeline's ``staticThreadgroupMemoryLength``).
``newComputePipelineStateWithFunction:error:`` binds the function to the numpy reference
registered under its name in :mod:`accel.sim.kernels` (refused when there is none, or when it
takes an ``f64``).  Both messages are MTLDevice's, made here by the :class:`_DeviceCompiler`
mixin; :class:`MTLCompileOptions`, :class:`MTLLibrary`, :class:`MTLFunction` and
:class:`MTLComputePipelineState` are the objects they use and answer.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from .. import core, kernels
from .objects import NSString, SimObject
from .rules import _MAX_THREADS_PER_GROUP, _as


class MTLCompileOptions(SimObject):
    cls_name = "MTLCompileOptions"

    def __init__(self, rt):
        super().__init__(rt)
        self.fast_math = True  # Metal's default

    def m_init(self):
        return self

    def m_setFastMathEnabled_(self, flag):
        self.fast_math = bool(flag)


class MTLFunction(SimObject):
    cls_name = "MTLFunction"

    def __init__(self, rt, library: "MTLLibrary", name: str):
        super().__init__(rt)
        self.library = rt.retain(library)
        self.name = name

    def dealloc(self):
        self.rt.release(self.library)


class MTLLibrary(SimObject):
    cls_name = "MTLLibrary"

    def __init__(self, rt, names: List[str], thread_limits: Optional[Dict[str, int]] = None,
                 static_tg: Optional[Dict[str, object]] = None):
        super().__init__(rt)
        self.names = names
        self.thread_limits = thread_limits or {}    # [[max_total_threads_per_threadgroup(N)]] per kernel
        self.static_tg = static_tg or {}    # kernel -> bytes of threadgroup variables, or why unsized

    def m_newFunctionWithName_(self, name):
        text = _as(self.rt, name, NSString).text
        if text not in self.names:
            return None
        return MTLFunction(self.rt, self, text)


class MTLComputePipelineState(SimObject):
    cls_name = "MTLComputePipelineState"

    def __init__(self, rt, function: MTLFunction, reference):
        super().__init__(rt)
        self.function = rt.retain(function)
        self.reference = reference  # (argtypes, fn) from accel.sim.kernels

    def dealloc(self):
        self.rt.release(self.function)

    def m_maxTotalThreadsPerThreadgroup(self):
        # MTLComputePipelineState.maxTotalThreadsPerThreadgroup: "may be different for different
        # pipeline objects"; MTLComputePipelineDescriptor.maxTotalThreadsPerThreadgroup: "Your
        # shader can also configure the maximum number of threads per threadgroup with the
        # [[max_total_threads_per_threadgroup]] attribute".
        limit = self.function.library.thread_limits.get(self.function.name)
        return _MAX_THREADS_PER_GROUP if limit is None else min(limit, _MAX_THREADS_PER_GROUP)

    def m_threadExecutionWidth(self):
        return 32

    def m_staticThreadgroupMemoryLength(self):
        # MTLComputePipelineState.staticThreadgroupMemoryLength: "The length in bytes of threadgroup
        # memory that is statically allocated" (the kernel's threadgroup variables: _msl_static_tg).
        return self.function.library.static_tg.get(self.function.name, 0)


class _DeviceCompiler:
    """MTLDevice's messages that compile (a mixin of :class:`accel.sim.metal.device.MTLDevice`)."""

    def m_newLibraryWithSource_options_error_(self, source, options, error):
        text = _as(self.rt, source, NSString).text
        if options is not None:
            _as(self.rt, options, MTLCompileOptions)
        m = re.search(r"^\s*#\s*error\s+(.*)$", text, re.M)
        fault = core.take_fault("newLibraryWithSource:options:error:")
        if m or fault:
            msg = m.group(1) if m else f"injected fault {fault}"
            self.rt.set_error(error, 3, f"program_source: error: {msg}")  # MTLLibraryErrorCompileFailure
            return None
        code = _MSL_COMMENT.sub(lambda c: re.sub(r"[^\n]", " ", c.group()), text)
        m = _MSL_DOUBLE.search(code)
        if m:
            # Metal Shading Language Specification, 2.1 "Scalar Data Types": there is no double
            # (nor long double, nor doubleN vectors); Apple's compiler rejects the source.
            line = code.count("\n", 0, m.start()) + 1
            self.rt.set_error(error, 3, f"program_source:{line}: error: '{m.group()}' is not supported in Metal")
            return None
        problem = _msl_syntax_error(code)
        if problem:
            self.rt.set_error(error, 3, f"program_source:{problem[0]}: error: {problem[1]}")
            return None
        # Metal Shading Language Specification 1.5 ("Metal and C++14"): comments are C++ comments,
        # so a kernel written inside one is no function of the library (newFunctionWithName: nil).
        names = _MSL_KERNEL.findall(code)
        return MTLLibrary(self.rt, names, _msl_thread_limits(code), _msl_static_tg(code))

    def m_newComputePipelineStateWithFunction_error_(self, function, error):
        function = _as(self.rt, function, MTLFunction)
        reference = kernels.lookup(function.name)
        if reference is None:
            self.rt.set_error(error, 1, f"the accel simulator has no Python reference for kernel "
                                        f"{function.name!r}; register one: accel.sim.register_kernel("
                                        f"{function.name!r}, fn, 'ptr, u64, ...')")
            return None
        if "f64" in reference.argtypes:
            # No Metal kernel declares a double parameter (MSL Specification, 2.1), so this
            # reference would decode bytes no launch passes: refused, as a missing reference is.
            self.rt.set_error(error, 1, f"the accel simulator's reference for kernel {function.name!r} takes an "
                                        f"f64 argument, and Metal has no double (a Metal kernel cannot declare one); "
                                        f"register it with f32")
            return None
        unsized = function.library.static_tg.get(function.name)
        if isinstance(unsized, str):
            # The simulator must count a kernel's threadgroup variables against the device's limit
            # (see MTLComputeCommandEncoder._dispatch); one it cannot size is refused.
            self.rt.set_error(error, 1, f"the accel simulator cannot size kernel {function.name!r}'s "
                                        f"threadgroup variable {unsized!r} (it sizes scalars, vectors and "
                                        f"arrays of them)")
            return None
        return MTLComputePipelineState(self.rt, function, reference)


_MSL_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_MSL_DOUBLE = re.compile(r"\b(?:long\s+)?double\d*\b")
_MSL_KERNEL = re.compile(r"\bkernel\s+void\s+([A-Za-z_]\w*)\s*\(")
_MSL_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
_MSL_CLOSE = {")": "(", "]": "[", "}": "{"}
_MSL_OPEN = {v: k for k, v in _MSL_CLOSE.items()}


_MSL_MAX_THREADS = r"\[\[\s*max_total_threads_per_threadgroup\s*\(\s*(\d+)\s*\)\s*\]\]"
_MSL_MAX_THREADS_BEFORE = re.compile(_MSL_MAX_THREADS + r"\s*kernel\s+void\s+([A-Za-z_]\w*)\s*\(")
_MSL_MAX_THREADS_AFTER = re.compile(r"\s*" + _MSL_MAX_THREADS)


def _msl_thread_limits(code: str) -> Dict[str, int]:
    """{kernel name: N} of the kernels declared with ``[[max_total_threads_per_threadgroup(N)]]``,
    before ``kernel void NAME(`` or after its parameter list (comments blanked)."""
    limits = {name: int(n) for n, name in _MSL_MAX_THREADS_BEFORE.findall(code)}
    for m in _MSL_KERNEL.finditer(code):
        end = _close_paren(code, m.end() - 1)
        after = _MSL_MAX_THREADS_AFTER.match(code, end + 1)
        if after:
            limits[m.group(1)] = int(after.group(1))
    return limits


# Metal Shading Language Specification 2.1 "Scalar Data Types" (sizes) and 2.2 "Vector Data Types":
# "vec<T,n>" / Tn of n = 2, 3, 4 components, a 3-component vector having the size and alignment of a
# 4-component one; atomic_int / atomic_uint / atomic_bool / atomic_float (6.15 "Atomic Functions")
# are 4 bytes.  Threadgroup variables are declared in a kernel function's body (4.4 "threadgroup
# Address Space"); a pointer or reference to threadgroup memory allocates none.
_MSL_SCALAR_SIZES = {"bool": 1, "char": 1, "uchar": 1, "int8_t": 1, "uint8_t": 1, "short": 2, "ushort": 2,
                     "int16_t": 2, "uint16_t": 2, "half": 2, "bfloat": 2, "int": 4, "uint": 4, "int32_t": 4,
                     "uint32_t": 4, "float": 4, "long": 8, "ulong": 8, "int64_t": 8, "uint64_t": 8,
                     "atomic_int": 4, "atomic_uint": 4, "atomic_bool": 4, "atomic_float": 4}
_MSL_TG_DECL = re.compile(r"(?:^|(?<=[;{}]))\s*threadgroup\s+([^;{}]*);")
_MSL_TG_TYPE = re.compile(r"(?:(?:const|volatile)\s+)*(?:metal::)?([A-Za-z_]\w*?)([234]?)(?:\s+|(?=[*&]))(.*)$", re.S)
_MSL_TG_VAR = re.compile(r"([A-Za-z_]\w*)\s*((?:\[\s*\d+\s*\])*)\s*$")


def _msl_static_tg(code: str) -> Dict[str, object]:
    """{kernel name: bytes of the threadgroup variables its body declares, laid out in order at
    their alignments, or the declaration the simulator cannot size (a str)} (comments blanked)."""
    out: Dict[str, object] = {}
    for m in _MSL_KERNEL.finditer(code):
        start = code.find("{", _close_paren(code, m.end() - 1))
        if start < 0:
            continue
        depth, end = 0, start
        while end < len(code):
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                break
            end += 1
        total = 0
        for d in _MSL_TG_DECL.finditer(code, start + 1, end):
            t = _MSL_TG_TYPE.match(d.group(1).strip())
            scalar = _MSL_SCALAR_SIZES.get(t.group(1)) if t else None
            if scalar is None:
                total = " ".join(d.group(1).split())
                break
            lanes = {"": 1, "2": 2, "3": 4, "4": 4}[t.group(2)]
            size = scalar * lanes
            declarators = [v.strip() for v in t.group(3).split(",")]
            if any(v[:1] in "*&" for v in declarators):
                continue        # a pointer or reference to threadgroup memory, no allocation
            for v in declarators:
                var = _MSL_TG_VAR.match(v)
                if var is None:
                    total = " ".join(d.group(1).split())
                    break
                count = 1
                for n in re.findall(r"\d+", var.group(2)):
                    count *= int(n)
                total = -(-total // size) * size + size * count
            if isinstance(total, str):
                break
        out[m.group(1)] = total
    return out


def _close_paren(code: str, j: int) -> int:
    """The index of the ')' closing the '(' at ``code[j]`` (len(code) when it is never closed)."""
    depth = 0
    while j < len(code):
        depth += {"(": 1, ")": -1}.get(code[j], 0)
        if depth == 0:
            return j
        j += 1
    return j


def _msl_syntax_error(code: str):
    """(line, message) of the first error the simulated compiler can see in MSL whose comments
    were blanked, or None.  Metal Shading Language Specification 1.5: MSL is C++14 with
    restrictions, so parentheses, brackets and braces pair up as in any C++ program (an unclosed
    one fails the compile), and 1.5.1 "Overloading": graphics and kernel functions cannot be
    overloaded, so two definitions of one kernel name fail too."""
    code = _MSL_LITERAL.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), code)
    stack = []
    for i, ch in enumerate(code):
        if ch in "([{":
            stack.append((ch, i))
        elif ch in _MSL_CLOSE:
            if not stack or stack[-1][0] != _MSL_CLOSE[ch]:
                return code.count("\n", 0, i) + 1, f"unexpected '{ch}'"
            stack.pop()
    if stack:
        ch, i = stack[-1]
        return code.count("\n", 0, i) + 1, f"'{ch}' is never closed (expected '{_MSL_OPEN[ch]}')"
    defined = {}
    for m in _MSL_KERNEL.finditer(code):
        rest = code[_close_paren(code, m.end() - 1) + 1:].lstrip()
        if rest.startswith("[["):     # an attribute after the parameter list
            rest = rest[rest.find("]]") + 2:].lstrip()
        if rest.startswith("{"):      # a definition, not a declaration
            name = m.group(1)
            line = code.count("\n", 0, m.start()) + 1
            if name in defined:
                return line, (f"redefinition of kernel '{name}' (first defined at line {defined[name]}; kernel "
                              f"functions cannot be overloaded)")
            defined[name] = line
    return None
