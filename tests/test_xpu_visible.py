"""ZE_FLAT_DEVICE_HIERARCHY / ZE_AFFINITY_MASK: the backend's Sysman-based count
against the rules, and against the simulated driver's own zeDeviceGet."""

import itertools

import pytest

from accel import _lazy, backends
from accel.backends._ze_visible import visible_devices
from accel.sim import ze as sim_ze

from conftest import use_sim


@pytest.mark.parametrize("tiles, mask, mode, expected", [
    # no mask: FLAT (the default) and COMBINED expose tiles, COMPOSITE cards
    ([2, 2], None, None, [(0, 0), (0, 1), (1, 0), (1, 1)]),
    ([2, 2], None, "FLAT", [(0, 0), (0, 1), (1, 0), (1, 1)]),
    ([2, 2], None, "COMBINED", [(0, 0), (0, 1), (1, 0), (1, 1)]),
    ([2, 2], None, "COMPOSITE", [(0, None), (1, None)]),
    ([0, 1, 2], None, None, [(0, None), (1, None), (2, 0), (2, 1)]),  # 0 or 1 sub-devices: one device
    # unknown or lower-case values are the driver default, FLAT
    ([2], None, "composite", [(0, 0), (0, 1)]),
    ([2], None, "bogus", [(0, 0), (0, 1)]),
    # FLAT masks index the flattened list; X.Y is ignored; order is physical; duplicates once
    ([2, 2], "3,1", None, [(0, 1), (1, 1)]),
    ([2, 2], "1,1", None, [(0, 1)]),
    ([2, 2], "0.1", None, []),
    ([2, 2], "0.1,2", "FLAT", [(1, 0)]),
    ([2, 2], "9,x,,-1, 2", None, [(1, 0)]),
    ([2, 2], "", None, [(0, 0), (0, 1), (1, 0), (1, 1)]),
    ([2, 2], "default", None, [(0, 0), (0, 1), (1, 0), (1, 1)]),
    # COMPOSITE masks name cards and X.Y tiles; a card cut to one tile is that tile
    ([2, 2], "1", "COMPOSITE", [(1, None)]),
    ([2, 2], "1.1", "COMPOSITE", [(1, 1)]),
    ([2, 2], "0.0,0.1", "COMPOSITE", [(0, None)]),
    ([2, 2], "1.0,0", "COMPOSITE", [(0, None), (1, 0)]),
    ([2, 2], "0.2,5", "COMPOSITE", []),
    ([1, 1], "0.0,1", "COMPOSITE", [(0, None), (1, None)]),
    ([1, 1], "0.1", "COMPOSITE", []),
])
def test_visible_devices_rules(tiles, mask, mode, expected):
    assert visible_devices(tiles, mask, mode) == expected


CASES = list(itertools.product(
    [(2, 1), (2, 2), (3, 2)],                       # (cards, tiles per card)
    [None, "1", "0,2", "2,0,2", "0.1", "1.0,0.1", "5", "1.1,2"],
    [None, "FLAT", "COMPOSITE", "COMBINED"],
))


@pytest.mark.parametrize("machine, mask, mode", CASES)
def test_count_without_init_matches_driver(monkeypatch, machine, mask, mode):
    """count() from Sysman + the rules == len(zeDeviceGet) of the simulated driver after zeInit."""
    cards, tiles = machine
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=cards)
    if mask is not None:
        monkeypatch.setenv("ZE_AFFINITY_MASK", mask)
    if mode is not None:
        monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", mode)
    sim_ze.configure_ze(tiles=tiles)
    be = backends.get("xpu")
    counted = be.count()
    assert be.report()["count_path"] == "zesInit"
    assert not sim_ze.state()["ze_runtime_initialized"]
    if counted == 0:
        with pytest.raises(Exception):
            be.init()
        return
    be.init()
    assert len(be._devices) == counted
    # every device got its Sysman card (and tile) for mem_info
    assert all(d.sysman is not None for d in be._devices)
    be.close()
    _lazy._reset_for_tests()
