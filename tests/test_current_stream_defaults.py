"""Buffer operations default to the *current* stream of the buffer's device, as every torch
operation does, so they are ordered with RNG fills and graph replays (which also use it).

The simulator's ``ACCEL_SIM_DELAY_US`` makes each queued operation slow, so a read that is
not ordered after a write on another stream sees the old bytes.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import accel

from conftest import SIMS, use_sim

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=SIMS)
def slow_sim(request, monkeypatch):
    """Each simulator with every stream operation delayed by 2 ms."""
    return use_sim(monkeypatch, request.param, ACCEL_SIM_DELAY_US=2000)


def _child_env(kind: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "ZE_"))}
    env.update(ACCEL_SIM=kind, ACCEL_SIM_DELAY_US="2000")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def test_copies_and_fills_follow_the_current_stream(slow_sim):
    side = accel.Stream()
    buf = accel.Buffer(1 << 16, stream=side)        # allocated for `side`
    accel.random.manual_seed(1)
    accel.random.uniform_(buf)                        # on the current (default) stream
    values = buf.to_numpy(np.float32)                 # must read after the fill
    assert 0.3 < values.mean() < 0.7, values[:4]
    buf.fill_(7)                                      # current stream again
    assert (buf.to_numpy() == 7).all()
    with side:
        buf.copy_from(np.full(1 << 16, 9, np.uint8))
        assert (buf.to_numpy() == 9).all()
    buf.close()


def test_non_current_device_buffer_uses_that_devices_current_stream(slow_sim):
    if accel.device_count() < 2:
        pytest.skip("needs two simulated devices")
    accel.set_device_index(0)
    side = accel.Stream(1)
    buf = accel.Buffer(4096, device=1, stream=side)
    with accel.Stream(1) as other:                    # makes device 1 current, then restores 0
        buf.fill_(5)                                  # on `other`
        assert (buf.to_numpy() == 5).all()            # on `other` too: ordered after the fill
    other.synchronize()                               # the default stream is current again
    assert accel.current_device_index() == 0
    assert (buf.to_numpy() == 5).all()                # device 1's current stream, from device 0
    with accel.device_index(1):
        accel.random.uniform_(buf)                    # device 1's current stream
    values = buf.to_numpy(np.float32)                 # device 1's current stream, from device 0
    assert 0.3 < values.mean() < 0.7, values[:4]
    assert accel.current_device_index() == 0
    buf.close()


def test_graph_replay_then_read_on_the_current_stream(slow_sim):
    if slow_sim == "mps":
        pytest.skip("Metal has no stream capture")
    s = accel.Stream()
    buf = accel.Buffer(1 << 16, stream=s)
    g = accel.Graph()
    with s, g:
        buf.fill_(3)
    buf.fill_(0)
    g.replay()                                        # current (default) stream
    assert (buf.to_numpy() == 3).all()
    g.reset()
    buf.close()


def test_use_on_another_stream_keeps_memory_from_early_reuse(slow_sim):
    side, other = accel.Stream(), accel.Stream()
    buf = accel.Buffer(1 << 20, stream=side)
    ptr = buf.ptr
    with other:
        buf.fill_(1)                                  # queued on `other`, still running
    buf.close()
    again = accel.Buffer(1 << 20, stream=side)        # must not get memory `other` still writes
    assert again.ptr != ptr or other.query()
    other.synchronize()
    again.close()


@pytest.mark.parametrize("kind", SIMS)
def test_smoke_test_is_correct_with_slow_streams(kind):
    proc = subprocess.run([sys.executable, "-m", "accel", "--json"], env=_child_env(kind), cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    smoke = json.loads(proc.stdout)["smoke"]
    assert smoke["copy round trip (1 MiB)"] is True, smoke
    assert smoke.get("graph replay", True) is True, smoke
    assert 0.45 < smoke["uniform fill mean"] < 0.55, smoke
    assert smoke["event timing (ms)"] >= 0, smoke


def _readme_example() -> str:
    with open(os.path.join(REPO, "README.md")) as fh:
        text = fh.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    return blocks[0]


@pytest.mark.parametrize("kind", SIMS)
def test_readme_example_is_correct_with_slow_streams(kind):
    code = _readme_example() + "\nimport json\nprint('RESULT', json.dumps(buf.to_numpy(np.float32).tolist()))\n"
    proc = subprocess.run([sys.executable, "-c", code], env=_child_env(kind), cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    values = np.array(json.loads(line[len("RESULT "):]), np.float32)
    assert 0.45 < values.mean() < 0.55 and values.min() >= 0 and values.max() <= 1, values[:8]
