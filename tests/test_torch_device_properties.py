"""torch's device-property tests, ported to accel (issue 16, second bullet): torch's field
names on accel.get_device_properties, for both simulated devices (the non-current one too)."""

import uuid

import pytest

import accel


def test_cuda__test_cuda_get_device_properties(sim_backend):
    # test/test_cuda.py::TestCuda::test_get_device_properties (and test_accelerator.py's
    # get_device_properties checks): torch.cuda's field names and types, on every device.
    for index in range(accel.device_count()):
        p = accel.get_device_properties(index)
        assert p == accel.get_device_properties(accel.device(sim_backend, index))
        assert isinstance(p.name, str) and p.name
        assert (p.major, p.minor) == p.compute_capability
        assert isinstance(p.total_memory, int) and p.total_memory > 0
        assert isinstance(p.multi_processor_count, int)
        assert p.is_integrated in (0, 1) and p.is_integrated == int(p.unified_memory)
        for name in ("L2_cache_size", "warp_size", "max_threads_per_multi_processor", "pci_bus_id",
                     "pci_device_id", "pci_domain_id", "gcnArchName"):
            assert hasattr(p, name), name            # None where the backend does not report it
        assert p.uuid is None or isinstance(p.uuid, uuid.UUID)
    assert accel.current_device_index() == 0


def test_cuda__test_device_properties_cuda_values(sim_cuda):
    # test/test_cuda.py::TestCuda::test_cuda_get_device_properties_fields: the CUDA values
    # come from cudaDeviceProp (the simulator's H200).
    from accel import sim
    seen = set()
    for index in range(accel.device_count()):
        p = accel.get_device_properties(index)
        R = sim.cudart._R
        a = sim.cudart.devices._attributes(R, index)
        assert p.warp_size == a[10] == 32
        assert p.L2_cache_size == a[38] > 0
        assert p.max_threads_per_multi_processor == a[39] > 0
        assert p.pci_bus_id == a[33]
        assert (p.pci_device_id, p.pci_domain_id) == (0, 0)
        assert p.is_integrated == 0 and p.gcnArchName is None    # gcnArchName: ROCm builds only
        assert isinstance(p.uuid, uuid.UUID) and len(str(p.uuid)) == 36
        assert p.uuid.bytes == sim.core.uuid_bytes(R.devices[index].physical)
        seen.add(p.uuid)
        # the names accel had before stay readable
        assert p.extra["l2_cache_size"] == p.L2_cache_size and p.extra["warp_size"] == p.warp_size
        assert p.extra["pci_bus_id"] == p.pci_bus_id
    assert len(seen) == accel.device_count() == 2


def test_xpu__test_device_properties_xpu_names(monkeypatch):
    # test/test_xpu.py::TestXpu::test_get_device_properties: torch.xpu's names where Level Zero
    # gives them (max_work_group_size, sub_group_sizes, device_id), the common ones too.
    from conftest import use_sim
    use_sim(monkeypatch, "xpu")
    for index in range(accel.device_count()):
        p = accel.get_device_properties(index)
        assert isinstance(p.uuid, uuid.UUID)
        assert p.max_work_group_size > 0 and p.sub_group_sizes
        assert p.pci_device_id == p.device_id == p.extra["device_id"]
        assert p.warp_size is None                    # Level Zero has sub-group sizes instead
        with pytest.raises(AttributeError, match="no_such_field"):
            p.no_such_field


def test_mps__test_device_properties_mps(monkeypatch):
    # Metal has no UUID or PCI numbers: None, and the registry id stays under extra.
    from conftest import use_sim
    use_sim(monkeypatch, "mps")
    p = accel.get_device_properties(0)
    assert p.uuid is None and p.pci_bus_id is None
    assert p.is_integrated in (0, 1)
    assert isinstance(p.registry_id, int)
