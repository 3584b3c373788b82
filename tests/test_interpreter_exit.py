"""A user's ``__del__`` that closes accel objects at interpreter exit.

At exit CPython empties ``sys.modules`` and sets ``sys.meta_path`` to None before the last
objects of ``__main__`` go, so an ``import`` statement inside a function fails then even for a
module loaded long ago.  A program whose objects tidy up in ``__del__`` (closing buffers and
streams, synchronizing, reading memory stats) must not get ImportError from accel, nor a device
fault from the simulator, on the way out."""

import os
import subprocess
import sys

import pytest

PROGRAM = r'''
import sys, traceback
import accel

two = accel.device_count() > 1
dev = 1 if two else 0


class Holder:
    """Everything a training script keeps in a global and tidies up in __del__."""

    def __init__(self):
        self.s = accel.Stream(dev)
        self.b = accel.Buffer(1 << 20, device=dev, stream=self.s)
        self.b.fill_(0, self.s)
        self.b.to_numpy()
        self.e = accel.Event()
        self.g = accel.Graph()

    def __del__(self):
        steps = [
            ("fill", lambda: self.b.fill_(1, self.s)),
            ("record", lambda: self.e.record(self.s)),
            ("event sync", lambda: self.e.synchronize()),
            ("to_numpy", lambda: self.b.to_numpy()),
            ("stream sync", lambda: self.s.synchronize()),
            ("close buffer", lambda: self.b.close()),
            ("graph reset", lambda: self.g.reset()),
            ("close stream", lambda: self.s.close()),
            ("new buffer", lambda: accel.Buffer(64, device=dev).close()),
            ("empty_cache", lambda: accel.memory.empty_cache()),
            ("memory_allocated", lambda: accel.memory.memory_allocated(dev)),
            ("memory_stats", lambda: accel.memory.memory_stats(dev)),
            ("synchronize", lambda: accel.synchronize()),
        ]
        for name, step in steps:
            try:
                step()
                print("ok", name, flush=True)
            except BaseException as exc:
                frames = traceback.extract_tb(exc.__traceback__)[-3:]
                where = ", ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames)
                print("FAIL", name, type(exc).__name__, exc, where, flush=True)


h = Holder()
'''


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_user_del_at_interpreter_exit_closes_everything(kind):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "ZE_"))}
    env.update(ACCEL_SIM=kind, ACCEL_SIM_DEVICES="2")
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "FAIL" not in out and "Exception ignored" not in out and "fault" not in out, out
    assert out.count("ok ") == 13, out
