"""Level Zero driver versions and device hierarchy through the public API (issue 14, item 7).

The simulated driver's API version decides which entry points answer (``zesInit`` needs 1.5,
``zeCommandListHostSynchronize`` 1.6, whatever the loader exports), ``zesInit`` can fail, and
the driver's default device hierarchy can differ from the FLAT default the count before init
assumes.  Each case must count, initialize and move data correctly, and say which path it took.
"""

import warnings

import numpy as np
import pytest

import accel
from accel import backends, sim
from accel.sim import ze as sim_ze

from conftest import use_sim

C = sim.core.constants_of("_ze")


def _roundtrip(device: int) -> None:
    """Copy up, fill, copy back on a non-default stream of ``device``."""
    s = accel.Stream(device)
    host = np.arange(4096, dtype=np.uint8)
    with s:
        b = accel.Buffer(host.nbytes, device=device)
        b.copy_from(host, non_blocking=True)
        assert np.array_equal(b.to_numpy(), host)
        b.fill_(7)
        s.synchronize()
        assert (b.to_numpy() == 7).all()
        assert s.query()
    b.close()
    s.close()


@pytest.mark.parametrize("api, count_path, stream_sync", [
    ("1.4", "child-zeInit", "event after the last command"),           # no zesInit: a child counts
    ("1.5", "zesInit", "event after the last command"),                # zesInit, no HostSynchronize
    ("1.6", "zesInit", "zeCommandListHostSynchronize"),
    ("1.9", "zesInit", "zeCommandListHostSynchronize"),
])
def test_driver_api_version_picks_the_paths(monkeypatch, api, count_path, stream_sync):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_API=api)
    assert accel.device_count() == 2
    be = backends.get("xpu")
    assert be.report()["count_path"] == count_path
    assert not accel._lazy.is_initialized()
    sim.reset_call_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the counts agree: no reconcile warning
        for dev in range(accel.device_count()):
            _roundtrip(dev)
    report = be.report()
    assert report["api_version"] == api and report["stream_sync"] == stream_sync
    # Only the calls the driver's API answers: never an UNSUPPORTED_FEATURE retry.
    used_host_sync = sim.calls("zeCommandListHostSynchronize") > 0
    assert used_host_sync == (stream_sync == "zeCommandListHostSynchronize")
    assert accel.device_count() == 2


def test_failing_zes_init_falls_back_to_a_child_count(monkeypatch):
    use_sim(monkeypatch, "xpu")
    sim.inject_error("zesInit", C.ZE_RESULT_ERROR_DEPENDENCY_UNAVAILABLE, times=-1)
    try:
        assert accel.device_count() == 2
        info = backends.get("xpu").report()
        assert info["count_path"] == "child-zeInit"
        assert not accel._lazy.is_initialized()
        _roundtrip(1)
        assert backends.get("xpu").mem_info()[1] > 0   # legacy Sysman (ZES_ENABLE_SYSMAN at zeInit)
    finally:
        sim.clear_faults()


def test_failing_zes_init_with_no_device_names_the_failure(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=0)
    assert accel.device_count() == 0
    reason = backends.get("xpu").report()["reason"]
    assert "zesInit failed with ZE_RESULT_ERROR_UNINITIALIZED" in reason and "child process" in reason


def test_composite_default_driver_reconciles_after_init(monkeypatch):
    """2 cards x 2 tiles on a driver whose default is COMPOSITE: the count before init (Sysman,
    FLAT rules) says 4, the initialized driver 2.  One RuntimeWarning naming both numbers and
    the mode; from then on the driver's count."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_TILES=2, ACCEL_SIM_ZE_HIERARCHY="COMPOSITE")
    assert accel.device_count() == 4
    with pytest.warns(RuntimeWarning) as got:
        s = accel.Stream(1)
    texts = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1
    msg = texts[0]
    assert "found 4 XPU device(s)" in msg and "reports 2" in msg and "using 2" in msg
    assert "ZE_FLAT_DEVICE_HIERARCHY unset" in msg and "FLAT" in msg
    assert accel.device_count() == 2
    report = backends.get("xpu").report()
    assert report["count"] == 2 and report["count_before_init"] == 4
    assert report["count_path"].startswith("zeDeviceGet after init")
    with pytest.raises(ValueError, match="out of range"):
        accel.set_device_index(3)
    s.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once: later calls do not warn again
        _roundtrip(1)
        assert accel.device_count() == 2


def test_explicit_hierarchy_agrees_with_the_driver(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_TILES=2, ACCEL_SIM_ZE_HIERARCHY="COMPOSITE",
            ZE_FLAT_DEVICE_HIERARCHY="COMPOSITE")
    assert accel.device_count() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _roundtrip(1)
    assert "count_before_init" not in backends.get("xpu").report()


def test_hierarchy_changed_between_count_and_init(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_TILES=2, ZE_FLAT_DEVICE_HIERARCHY="COMPOSITE")
    assert accel.device_count() == 2
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "FLAT")
    with pytest.warns(RuntimeWarning, match=r"found 2 XPU device\(s\).*reports 4.*"
                                            r"ZE_FLAT_DEVICE_HIERARCHY='FLAT'"):
        accel.Stream(3).close()
    assert accel.device_count() == 4


def test_sim_default_hierarchy_is_validated():
    with pytest.raises(ValueError, match="default_hierarchy must be 'FLAT' or 'COMPOSITE', got 'flat'"):
        sim_ze.configure_ze(default_hierarchy="flat")


def test_sysman_is_used_only_for_drivers_with_api_1_5(monkeypatch):
    """zesInit answered (the loader has a 1.5+ driver) but the devices' driver reports API 1.4
    to zeDriverGetApiVersion: their memory is not read through Sysman handles the driver does
    not know; mem_info falls back to the device properties and says so."""
    use_sim(monkeypatch, "xpu")
    assert accel.device_count() == 2 and backends.get("xpu").report()["count_path"] == "zesInit"
    be = backends.get("xpu")
    lib = be._library()[1]
    real = lib.zeDriverGetApiVersion

    def old_driver(driver, version):
        rc = real(driver, version)
        version[0] = (1 << 16) | 4
        return rc

    monkeypatch.setattr(lib, "zeDriverGetApiVersion", old_driver)
    _roundtrip(0)                      # API 1.4: barriers, event markers (not HostSynchronize)
    assert be.report()["api_version"] == "1.4"
    assert all(d.sysman is None for d in be._devices)
    free, total = be.mem_info()
    assert total > 0 and be.report()["mem_info_path"].startswith("device-properties")
