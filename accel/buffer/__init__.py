"""``accel.Buffer``: an owned range of device memory, and host↔device copies.

Memory comes from the device's caching allocator and goes back to it when the
buffer is closed or collected; the allocator keeps it unused until the work
queued on the buffer's streams has finished.  Copies are ordered on a stream
(by default the current stream of the buffer's device, as every torch operation);
blocking copies return when the data has arrived, ``non_blocking`` host→device
copies stage through pinned host memory and return at once.

The package, one module per concern, each with its part of the design in its docstring:

* :mod:`.buffer_class`: the :class:`Buffer` class (construction, properties, copies and fills,
  uses and ``record_stream``, interop exports, the copy/pickle refusals, close and ``__del__``),
  the ``_in_use`` wrapper of its methods, and the table of device allocators it reads;
* :mod:`.sources`: what a host or foreign (another library's device array) source is and how it
  is read, and the check of a foreign range wrapped as a Buffer;
* :mod:`.capture`: which host copies a stream capture may hold (pinned, ``non_blocking``), and
  the refusal of the others;
* :mod:`.pins`: the pins a call or a DLPack export holds on a Buffer's memory, and the noting of
  a queued copy's stream uses;
* :mod:`.release`: how the memory goes back (to the allocator, or to a foreign owner after the
  work queued on it).

Why one class and not mixins (as accel/backends/xpu/): the copies, the bulk of it, name the
class itself (``isinstance(src, Buffer)``, ``Buffer._wrap_foreign``, ``__deepcopy__``'s
``Buffer.__init__``; ``_in_use`` pins each ``type(b) is Buffer`` argument), which a mixin module
could only reach by having the class bound into it after it is made; and the copies, fills,
exports and lifetime share one private protocol (``_live``, ``_check_stream``, ``_writable``,
``_record``/``_used``, the pins) that none of them reads without the others.

This module exports the names the rest of accel and its tests take from ``accel.buffer`` (each
the one object its module defines); a monkeypatch must patch the module whose code looks the name
up (Buffer's callees: :mod:`.buffer_class`), and the allocator table ``_allocators``, which
``_memory()`` rebinds, is read from :mod:`.buffer_class`.
"""

from __future__ import annotations

from . import buffer_class, capture, pins, sources

# The names the rest of accel (and its tests) take from accel.buffer.
Buffer = buffer_class.Buffer
_begin_use, _end_use, _call_pinned, _Noting = pins._begin_use, pins._end_use, pins._call_pinned, pins._Noting
_address, _cai_typestr, _check_device_range = sources._address, sources._cai_typestr, sources._check_device_range
_host_view, _numpy_from_dlpack = sources._host_view, sources._numpy_from_dlpack
_refuse_in_capture = capture._refuse_in_capture

__all__ = ["Buffer"]
