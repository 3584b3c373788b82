"""Level Zero: the device count follows ZE_AFFINITY_MASK / ZE_FLAT_DEVICE_HIERARCHY until init.

torch 2.13's ``torch.xpu.device_count()`` caches its answer only once the runtime is initialized,
and accel's CUDA backend recounts when CUDA_VISIBLE_DEVICES changed until the runtime read it.
The Level Zero backend kept its first count (and the masked Sysman list) for good, so a
``ZE_AFFINITY_MASK`` set after a first ``device_count()`` was ignored (r64f).  The driver reads
the two variables once, at the first successful ``zeInit`` (compute-runtime builds its device
list there; ``accel.sim.ze``'s ``zeInit`` does the same, see accel/sim/README.md "Device
hierarchy"), so:

* before init each count applies the variables as they are now; only the Sysman card list (which
  ignores them) is kept, and a count with unchanged variables makes no vendor call at all;
* counting never starts the core driver (fork safety), with Sysman or with the old loader's
  child-process count;
* from zeInit on the count is final: a later change of either variable moves nothing, neither the
  count nor which Sysman card a device index reads (telemetry), even when init failed after zeInit.
"""

from __future__ import annotations

import warnings

import pytest

import accel
from accel import backends
from accel.backends import _ze_count
from accel.sim import ze as sim_ze

from conftest import use_sim, vendor_calls_made_by


def _xpu(monkeypatch, **env):
    use_sim(monkeypatch, "xpu", **env)
    return backends.get("xpu")


def _not_started(be) -> bool:
    return not be.driver_started and not sim_ze.state()["ze_runtime_initialized"]


def test_mask_set_after_a_count_and_changed_twice(monkeypatch):
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    be = _xpu(monkeypatch, ACCEL_SIM_DEVICES=3)
    assert accel.device_count() == 3
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,2")
    assert accel.device_count() == 2
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    assert accel.device_count() == 1
    monkeypatch.delenv("ZE_AFFINITY_MASK")
    assert accel.device_count() == 3
    assert be.report()["count_path"] == "zesInit"
    assert _not_started(be)


def test_mask_selecting_none_then_some_gives_its_reason_only_while_zero(monkeypatch):
    be = _xpu(monkeypatch)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "7")
    report = be.report()
    assert report["count"] == 0
    assert report["reason"] == ("Sysman sees 2 GPU card(s) but ZE_AFFINITY_MASK='7' "
                                "(ZE_FLAT_DEVICE_HIERARCHY=None) selects none")
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    report = be.report()
    assert report["count"] == 1 and "reason" not in report
    assert _not_started(be)


def test_hierarchy_change_with_tiles(monkeypatch):
    """2 cards of 2 tiles: FLAT (the default) shows 4 devices, COMPOSITE 2; the mask's meaning
    follows the hierarchy in force at each count."""
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    monkeypatch.delenv("ZE_FLAT_DEVICE_HIERARCHY", raising=False)
    be = _xpu(monkeypatch, ACCEL_SIM_ZE_TILES=2)
    seen = [be.count()]
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    seen.append(be.count())
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0.1")          # tile 1 of card 0
    seen.append(be.count())
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1,0.1")         # card 1 and tile 1 of card 0
    seen.append(be.count())
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "FLAT")  # X.Y means nothing in FLAT
    seen.append(be.count())
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1,2,3")
    seen.append(be.count())
    assert seen == [4, 2, 1, 2, 1, 3]
    assert _not_started(be)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # agrees with the last count: no warning
        be.init()
    assert len(be._devices) == 3 == be.count()
    assert [d.subdevice_id for d in be._devices] == [1, 0, 1]


def test_init_sees_the_count_last_given(monkeypatch):
    """r64f's case through the public API: count, mask, count, first use: the runtime agrees."""
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    _xpu(monkeypatch)
    assert accel.device_count() == 2
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    assert accel.device_count() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accel.Buffer(64).close()
    assert accel.device_count() == 1
    assert "count_before_init" not in backends.get("xpu").report()


def test_after_init_the_count_is_final(monkeypatch):
    """As CUDA after cuInit: the driver read the mask at zeInit; a later change moves nothing,
    neither the count nor the Sysman card behind a device index."""
    be = _xpu(monkeypatch, ACCEL_SIM_DEVICES=3, ZE_AFFINITY_MASK="2")
    assert be.count() == 1
    be.init()
    assert be.smi_index(0) == 2
    for mask in ("0,1", "0", None):
        if mask is None:
            monkeypatch.delenv("ZE_AFFINITY_MASK")
        else:
            monkeypatch.setenv("ZE_AFFINITY_MASK", mask)
        assert be.count() == 1 == accel.device_count()
        assert be.smi_index(0) == 2                          # still card 2, as zeInit chose
        assert be.report()["count"] == 1
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    assert be.count() == 1


def test_after_a_zeinit_that_found_nothing_the_count_stays_zero(monkeypatch):
    """zeInit succeeded with a mask that selects nothing, so init failed after it: the driver
    still read the mask, and setting a better one afterwards changes nothing in this process."""
    be = _xpu(monkeypatch, ZE_AFFINITY_MASK="9")
    assert be.count() == 0
    with pytest.raises(accel.AcceleratorError, match="zeDeviceGet found no GPU device"):
        be.init()
    assert sim_ze.state()["ze_runtime_initialized"]
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0")
    assert be.count() == 0
    assert "ZE_AFFINITY_MASK='9'" in be.report()["reason"]


def test_repeated_counts_cost_no_vendor_call_and_recounts_reuse_the_cards(monkeypatch):
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    be = _xpu(monkeypatch)
    first = vendor_calls_made_by(be.count)
    assert first.get("zesDeviceGet", 0) >= 1 and "zeInit" not in first
    assert vendor_calls_made_by(lambda: [be.count() for _ in range(50)]) == {}
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    assert vendor_calls_made_by(be.count) == {}          # the card list is kept; the mask is applied here
    assert be.count() == 1
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,1")
    assert vendor_calls_made_by(lambda: accel.device_count()) == {}
    assert be.count() == 2
    assert _not_started(be)


def test_old_loader_recounts_in_a_child_only_when_the_variables_change(monkeypatch):
    """Without zesInit each count is a child's zeInit: one child per new pair of values, none
    for a repeated count, none after init; this process's driver never starts before init."""
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    monkeypatch.delenv("ZE_FLAT_DEVICE_HIERARCHY", raising=False)
    children = []
    real = _ze_count.count_in_child

    def counting(*args, **kwargs):
        children.append(kwargs.get("visibility"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_ze_count, "count_in_child", counting)
    be = _xpu(monkeypatch, ACCEL_SIM_ZE_LOADER="1.8.12", ACCEL_SIM_ZE_TILES=2)
    assert be.count() == 4 and be.count() == 4
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    assert be.count() == 2
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    assert be.count() == 1 and be.count() == 1
    assert children == [(None, None), (None, "COMPOSITE"), ("1", "COMPOSITE")]
    assert be.report()["count_path"] == "child-zeInit"
    assert _not_started(be)
    be.init()
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,1")
    assert be.count() == 1 == len(be._devices)
    assert len(children) == 3


def test_forked_child_counts_with_its_own_mask(monkeypatch):
    """Counting before init keeps fork safe: a child forked after a count re-reads Sysman (the
    parent's handles mean nothing there) and applies the mask it sets itself."""
    import os
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    be = _xpu(monkeypatch, ACCEL_SIM_DEVICES=3)
    assert be.count() == 3
    pid = os.fork()
    if pid == 0:                                        # the child: report through the exit status
        code = 100
        try:
            os.environ["ZE_AFFINITY_MASK"] = "0,1"
            code = be.count() * 10 + int(be.driver_started)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 20
    assert be.count() == 3 and _not_started(be)
