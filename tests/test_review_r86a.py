"""Review r86a (partial, started past its deadline): the simulator's per-compute-capability
limits after 50de756 (accel/sim/cudart/state.py, devices.py, modules.py).

Vendor rule used here: CUDA Programming Guide, "Compute Capabilities", table of technical
specifications (maximum resident blocks / threads per SM, shared memory per SM and per block);
the table itself could not be read through the search tool, so the figures are NVIDIA's own
encoding of it in CCCL, libcudacxx include/cuda/__device/arch_traits.h (NVIDIA/cccl), e.g.
``arch_traits<arch_id::sm_86>``: "max_shared_memory_per_multiprocessor = 100 * 1024;
max_blocks_per_multiprocessor = 16; max_threads_per_multiprocessor = 1536;" and
``__common_arch_traits``: "reserved_shared_memory_per_block = (__cc >= compute_capability{80})
? 1024 : 0" -- the same source 50de756 took its shared memory table from.
"""

import pytest

import accel
from accel.sim import kernels as simk
from accel.sim.cudart import state

from conftest import use_sim

#: (per-SM shared KiB, opt-in KiB, reserved bytes, max blocks/SM, max threads/SM) from arch_traits.h
CCCL = {
    (7, 0): (96, 96, 0, 32, 2048), (7, 5): (64, 64, 0, 16, 1024), (8, 0): (164, 163, 1024, 32, 2048),
    (8, 6): (100, 99, 1024, 16, 1536), (8, 7): (164, 163, 1024, 16, 1536),
    (8, 9): (100, 99, 1024, 24, 1536), (9, 0): (228, 227, 1024, 32, 2048),
    (10, 0): (228, 227, 1024, 32, 2048), (11, 0): (228, 227, 1024, 24, 1536),
    (12, 0): (100, 99, 1024, 24, 1536),
}


@pytest.mark.parametrize("cc", sorted(CCCL))
def test_shared_memory_tables_match_cccl_arch_traits(cc):
    per_sm, optin, reserved, _, _ = CCCL[cc]
    assert state.shared_per_sm(cc) == per_sm * 1024
    assert state.shared_per_block_optin(cc) == optin * 1024
    assert state.shared_reserved_per_block(cc) == reserved


def _kernel(cc):
    sm = f"sm_{cc[0]}{cc[1]}".encode()
    return accel.Module(simk.TEST_PTX.replace(b"sm_90", sm)).function("accel_test_fill_u32")


def test_cc_90_threads_per_sm_is_2048(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="9.0")
    assert accel.get_device_properties(0).max_threads_per_multi_processor == 2048


# r86a, fixed in session 40: accel.sim.cudart.devices attribute 39
# (cudaDevAttrMaxThreadsPerMultiProcessor): 2048 (9.0's) for every ACCEL_SIM_CC
@pytest.mark.parametrize("cc", [(7, 5), (8, 6), (8, 9), (12, 0)])
def test_threads_per_sm_follows_the_compute_capability(monkeypatch, cc):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC=f"{cc[0]}.{cc[1]}")
    assert accel.get_device_properties(0).max_threads_per_multi_processor == CCCL[cc][4]


# r86a, fixed in session 40: accel.sim.cudart.modules
# cudaOccupancyMaxActiveBlocksPerMultiprocessor: _MAX_BLOCKS_PER_SM/_MAX_THREADS_PER_SM are 9.0's
# (32, 2048) whatever ACCEL_SIM_CC says
def test_max_potential_block_size_on_86_fills_1536_threads(monkeypatch):
    # sm_86: 1536 threads and 16 blocks per SM; the best block size fills 1536 threads, so 1024
    # (one block, 1024 threads) is not it -- the simulator, believing 2048, answers 1024.
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="8.6")
    k = _kernel((8, 6))
    _, block = k.max_potential_block_size()
    assert block != 1024 and 1536 % block == 0


def test_max_potential_block_size_on_90_is_1024(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="9.0")
    _, block = _kernel((9, 0)).max_potential_block_size()
    assert block == 1024
