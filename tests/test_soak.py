"""Soak (issue 13): Stream/Event/Buffer create/destroy cycles leave nothing behind.

Runs ``tools/soak.py`` in a subprocess (a hang is a failure through the timeout, and RSS is the
soak's own) and asserts structural bounds after every block of 1,000 cycles: open fds and
threads as after the first block; the simulator's live streams, events and allocations, the
allocator's per-stream free lists, blocks, pending and cached events, the pinned allocator's
blocks and the pending finalizer releases within tools/soak.SLACK of the first block; RSS
flat from the first fifth on.  Time per block is reported by the tool, never asserted here.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import SIMS, THOROUGH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import soak  # noqa: E402

#: 25,000 cycles on the CUDA simulator (~0.6 ms each on a 2-core machine), the slower simulators
#: fewer, under ACCEL_TEST_THOROUGH; the default run 3,000 / 1,500 / 1,000 (blocks of 500).  The structural counts
#: catch a leak within a block of 1,000; tools/soak.py runs longer soaks.
CYCLES = ({"cuda": 25_000, "xpu": 10_000, "mps": 5_000} if THOROUGH else
          {"cuda": 3_000, "xpu": 1_500, "mps": 1_000})
#: Cycles per block.  The default run keeps blocks of 500 (6 / 3 / 2 of them): a leak of one
#: object per cycle still grows a count by 500, far past tools/soak.SLACK (r74d trim).
EVERY = 1000 if THOROUGH else 500
#: RSS may move by allocator arenas, not by a leak (one 200-byte object per cycle is 5 MB here).
RSS_SLACK = 4 << 20


@pytest.mark.parametrize("kind", SIMS)
def test_create_destroy_cycles_stay_flat(kind, tmp_path):
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "soak.py"), "--sim", kind,
                           "--cycles", str(CYCLES[kind]), "--every", str(EVERY), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"rc={proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}"
    blocks = json.loads(out.read_text())["blocks"]
    assert len(blocks) == CYCLES[kind] // EVERY
    first = blocks[0]["counts"]
    for n, block in enumerate(blocks[1:], 2):
        assert soak.grown_counts(first, block["counts"]) == {}, (n * EVERY, block["counts"], first)
    assert first["pending_releases"] == 0 and first["dev0_used_on"] == 0
    settled = blocks[len(blocks) // 5]["rss"]
    assert max(b["rss"] for b in blocks[len(blocks) // 5:]) - settled <= RSS_SLACK, \
        [round(b["rss"] / 2**20, 1) for b in blocks]
