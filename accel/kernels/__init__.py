"""Your own kernels: :class:`Module` loads an image (CUDA PTX/cubin/fatbin, Metal MSL, Level Zero
SPIR-V) on one device, :meth:`Module.function` gives a :class:`Kernel` that knows its parameter
list, and :func:`launch` checks and queues it.  On a simulator the kernel's Python reference runs
(:func:`accel.sim.register_kernel`), so the same script runs without a device::

    mod = accel.Module(ptx)                      # e.g. accel.compile(src).ptx, or nvcc -ptx
    saxpy = mod.function("saxpy")                # parameters from the PTX .entry
    accel.launch(saxpy, blocks, 256, 2.0, x, y, n)
"""

from ._launch import launch
from ._module import Kernel, Module

__all__ = ["Module", "Kernel", "launch"]
