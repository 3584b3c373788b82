"""Every public function, method and property of accel's public surface has a docstring
("docstrings on public API"): the names exported by accel, accel.memory and accel.random,
and the public members of the classes users make."""

import inspect

import accel
import accel.memory
import accel.random

from conftest import use_sim

CLASSES = ("Stream", "Event", "Buffer", "ArrayView", "Graph", "Module", "Kernel")


def _undocumented():
    missing = []
    for module in (accel, accel.memory, accel.random):
        for name in getattr(module, "__all__", None) or dir(module):
            if name.startswith("_"):
                continue
            value = getattr(module, name, None)
            if inspect.isfunction(value) or inspect.isclass(value):
                if not inspect.getdoc(value):
                    missing.append(f"{module.__name__}.{name}")
    classes = [getattr(accel, n) for n in CLASSES] + [accel.random.Generator, accel.memory.MemPool]
    for cls in classes:
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(fn) and not inspect.getdoc(fn):
                missing.append(f"{cls.__name__}.{name}")
    return missing


def test_public_api_has_docstrings(monkeypatch):
    use_sim(monkeypatch, "cuda")
    assert _undocumented() == []
