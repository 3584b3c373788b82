"""Fixes of session 30 (2026-12-06), each test seen failing on the code before its fix."""

import struct
import subprocess
import sys

import pytest

from accel import _cuda_containers
from accel.kernels import _module
from accel.sim import _cuda_images

_TRUNCATED_ENTRY = struct.pack("<IHHQ", _cuda_containers.FATBIN_MAGIC, 1, 16, 20) + bytes(20)


@pytest.mark.parametrize("image", [struct.pack("<I", _cuda_containers.FATBIN_MAGIC) + bytes(4), _TRUNCATED_ENTRY],
                         ids=["short-header", "short-entry-header"])
def test_a_truncated_fatbin_is_a_container_error_not_a_struct_error(image):
    # Before: struct.error out of accel.kernels' entry reader (a Module on a real device) and out of
    # the simulated driver's cudaLibraryLoadData instead of cudaErrorInvalidKernelImage.
    with pytest.raises(_cuda_containers.ContainerError, match="truncated fatbin"):
        _cuda_containers.fatbin_entries(image)
    assert _module._image_info(image, "fatbin") == ({}, {})
    with pytest.raises(_cuda_images.ImageError) as e:
        _cuda_images.load(image, (9, 0), 13000)
    assert e.value.code == _cuda_images.INVALID_KERNEL_IMAGE


def test_reading_a_kernel_image_does_not_import_the_simulators():
    # accel.kernels read fatbin/cubin layouts from accel.sim._cuda_images, so a Module on real
    # hardware imported the whole CUDA simulator; the layouts live in accel._cuda_containers now.
    code = ("import sys, struct, accel.kernels._module as m\n"
            f"m._image_info({_TRUNCATED_ENTRY!r}, 'fatbin')\n"
            "m._image_info(b'\\x7fELF' + bytes(60), 'cubin')\n"
            "print('accel.sim' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if not k.startswith("ACCEL_SIM")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_module_locks_are_fresh_in_a_forked_child():
    # r70a (minor): streams._close_lock/_foreign_lock, random._device._lock, kernels._launch._limits_lock
    # and _dlpack._take_lock were plain module locks with no at-fork renewal: one held by another
    # thread of the parent at the fork stayed held in the child for good.
    import os
    import threading

    from accel import _dlpack, streams
    from accel.kernels import _launch
    from accel.random import _device
    places = [(streams, "_close_lock"), (streams, "_foreign_lock"), (_device, "_lock"),
              (_launch, "_limits_lock"), (_dlpack.importing, "_take_lock")]
    taken, release = threading.Event(), threading.Event()

    def hold():
        for module, name in places:
            getattr(module, name).acquire()
        taken.set()
        release.wait(30)
        for module, name in places:
            getattr(module, name).release()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(30)
    try:
        pid = os.fork()
        if pid == 0:
            code = 0 if all(not getattr(m, n).locked() for m, n in places) else 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        t.join(30)
    assert os.waitstatus_to_exitcode(status) == 0
