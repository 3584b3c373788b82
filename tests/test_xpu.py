"""The XPU backend against the real Level Zero loader (Debian's libze1 1.8.12) on a
machine without an Intel driver, and the backend's symbol contract."""

import json
import os
import re
import subprocess
import sys

import pytest

import accel
from accel import backends
from accel._errors import AcceleratorError
from accel.backends import xpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _real_loader():
    from accel._ffi import open_library
    try:
        return open_library("ze")
    except OSError as exc:
        pytest.skip(f"real libze_loader absent: {exc}")


def _called_symbols():
    """Level Zero functions the backend (the accel/backends/xpu package, _ze_count.py) calls
    through the library object."""
    import glob
    from accel.backends import _ze_count
    files = sorted(glob.glob(os.path.join(os.path.dirname(xpu.__file__), "*.py"))) + [_ze_count.__file__]
    assert len(files) > 2, files
    src = "".join(open(f).read() for f in files)
    return set(re.findall(r"(?:\blib|_lib\[1\])\.(zes?[A-Z]\w+)\b", src))


def test_required_symbols_are_exactly_the_unconditional_calls():
    called = _called_symbols()
    declared = set(xpu.REQUIRED_SYMBOLS) | set(xpu.OPTIONAL_SYMBOLS)
    assert called - declared == set(), "calls missing from REQUIRED_SYMBOLS/OPTIONAL_SYMBOLS"
    assert set(xpu.REQUIRED_SYMBOLS) - called == set(), "REQUIRED_SYMBOLS lists functions never called"
    assert not set(xpu.REQUIRED_SYMBOLS) & set(xpu.OPTIONAL_SYMBOLS)
    from accel._ffi import _ze
    assert declared <= set(_ze.FUNCTIONS), "every called function must be in the generated bindings"
    assert set(xpu.OPTIONAL_SYMBOLS) <= _ze.OPTIONAL_SYMBOLS


@pytest.mark.reallib
def test_required_symbols_exist_in_the_real_loader():
    from accel._ffi import has_symbol
    _ffi, lib, path = _real_loader()
    missing = [s for s in xpu.REQUIRED_SYMBOLS if not has_symbol(lib, s)]
    assert missing == [], f"{path} lacks {missing}"
    if "1.8." in os.path.realpath(path):
        # Debian's loader predates every optional symbol: the fallbacks are what runs there.
        assert [s for s in xpu.OPTIONAL_SYMBOLS if has_symbol(lib, s)] == []


def _no_gpu_driver():
    from accel.backends import _ze_count
    return _ze_count.probe_gpu_drivers() == []


@pytest.mark.reallib
def test_no_driver_is_unavailable_without_exception(monkeypatch):
    _real_loader()
    if not _no_gpu_driver():
        pytest.skip("an Intel Level Zero GPU driver is installed here")
    monkeypatch.setenv("ACCEL_BACKEND", "xpu")
    accel._lazy._reset_for_tests()
    assert accel.is_available() is False
    assert accel.device_count() == 0
    be = backends.get("xpu")
    assert be.count() == 0
    info = be.report()
    assert info["count_path"] == "driver-probe"
    assert "libze_intel_gpu.so.1" in info["reason"] and "zesInit" in info["reason"]
    assert info["library"].endswith(tuple(["libze_loader.so.1", ".so.1.8.0"])) or "libze_loader" in info["library"]
    assert not accel.is_initialized()


@pytest.mark.reallib
def test_init_without_driver_names_the_vendor_error(monkeypatch):
    _real_loader()
    if not _no_gpu_driver():
        pytest.skip("an Intel Level Zero GPU driver is installed here")
    monkeypatch.delenv("ZES_ENABLE_SYSMAN", raising=False)
    be = xpu.create()
    with pytest.raises(AcceleratorError) as err:
        be.init()
    e = err.value
    assert (e.library, e.call, e.code, e.code_name) == ("libze_loader", "zeInit", 0x78000001,
                                                        "ZE_RESULT_ERROR_UNINITIALIZED")
    assert "0x78000001" in str(e)
    assert "ZES_ENABLE_SYSMAN" not in os.environ   # set for zeInit only, then removed


@pytest.mark.reallib
def test_child_count_path_with_the_real_loader(monkeypatch):
    """With a driver name the probe cannot check, zeInit runs in a child process."""
    _real_loader()
    if not _no_gpu_driver():
        pytest.skip("an Intel Level Zero GPU driver is installed here")
    monkeypatch.setenv("ZE_ENABLE_ALT_DRIVERS", "libze_intel_gpu.so.1")
    be = xpu.create()
    assert be.count() == 0
    info = be.report()
    assert info["count_path"] == "child-zeInit"
    assert "ZE_RESULT_ERROR_UNINITIALIZED" in info["reason"]


@pytest.mark.reallib
def test_python_m_accel_reports_the_count_path():
    _real_loader()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ZE_"))}
    env.update(ACCEL_BACKEND="xpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "accel", "--json"], env=env, capture_output=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr.decode()
    data = json.loads(out.stdout)
    report = data["backends"]["xpu"]
    assert report["count"] == 0 or report["count_path"] in ("zesInit", "child-zeInit")
    assert report["count_path"] in ("driver-probe", "zesInit", "child-zeInit")
    if report["count"] == 0:
        assert report["reason"]
