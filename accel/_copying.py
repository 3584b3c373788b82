"""Copying and pickling of objects that own device state (r15).

A plain ``copy.copy`` of a Buffer, Stream, Event, Graph or MemPool would duplicate its slots,
handle and pointer included: two owners, two releases, and the second release frees what the
driver or the allocator has meanwhile handed to someone else (two live Buffers then share
memory).  Pickling would send a handle that means nothing in another process.  So these objects
refuse both with a TypeError naming what to do instead, as ``torch.Stream`` and ``torch.Event``
refuse them; a Buffer's ``copy.deepcopy`` is a real device copy (torch's deepcopy of a tensor),
see :meth:`accel.Buffer.__deepcopy__`.
"""

from __future__ import annotations


def refuse(obj, how: str, instead: str):
    """The TypeError for ``how`` ("copy", "deepcopy", "pickle") of ``obj``."""
    name = type(obj).__name__
    return TypeError(f"cannot {how} 'accel.{name}' object: it owns a device handle of this process, and a "
                     f"copy would release it a second time; {instead}")


def refuse_copies(instead: str):
    """Class decorator: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` of instances raise
    :func:`refuse`'s TypeError, ending with ``instead`` (what to do)."""
    def decorate(cls):
        def __copy__(self):
            raise refuse(self, "copy", instead)

        def __deepcopy__(self, memo):
            raise refuse(self, "deepcopy", instead)

        def __reduce_ex__(self, protocol):
            raise refuse(self, "pickle", instead)

        cls.__copy__, cls.__deepcopy__, cls.__reduce_ex__ = __copy__, __deepcopy__, __reduce_ex__
        return cls
    return decorate
