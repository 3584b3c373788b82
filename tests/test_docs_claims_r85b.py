"""Review r85b: README.md's and the public docstrings' concrete claims that earlier rounds
(test_docs_claims_r62i, test_docstring_claims_r64c, test_docstring_claims_memory_random_r64c,
test_readme_examples_r46, test_public_docstrings) do not test, chiefly those added since:
the stream and seed rows of "Where accel deliberately differs from torch", the allocator
variables read as torch's CUDA build reads them, the libcudart choice, the simulated peer and
PCI-order variables, DLPack copies and captures, Metal's capsule form, and the paragraph on
capsules dropped while an exception propagates.

Each test says the sentence it checks.  A claim the code contradicts is a strict xfail whose
reason says which side is wrong."""

import configparser
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import accel
from accel._dlpack.importing import parse
from accel._errors import CaptureError
from accel.memory import _config

from conftest import use_sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDLCPU = 1
IS_COPIED = 1 << 1          # dlpack.h DLPACK_FLAG_BITMASK_IS_COPIED
MiB = 1 << 20


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "CUDA_DEVICE_ORDER", "ZE_", "ZES_", "PYTORCH_"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(code: str, timeout: float = 30, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=_clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _documented_defaults(monkeypatch):
    """The README's claims are about the default allocator and peer settings: a rerun under
    ACCEL_TEST_ALLOC_CONF or ACCEL_TEST_SIM_PEER (which conftest applies to every test) does not
    change what these tests check; a test that needs a setting sets it itself."""
    for name in ("ACCEL_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                 "ACCEL_SIM_PEER"):
        monkeypatch.delenv(name, raising=False)


def _handle(stream) -> int:
    return stream.stream_id


def _defaults(monkeypatch, kind: str) -> None:
    """``kind``'s simulator with the default allocator and peer settings (a rerun under
    ACCEL_TEST_ALLOC_CONF or ACCEL_TEST_SIM_PEER sets them for every test: these check defaults)."""
    for name in ("ACCEL_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                 "ACCEL_SIM_PEER"):
        monkeypatch.delenv(name, raising=False)
    use_sim(monkeypatch, kind)


# -- "Python 3.11 or later" ------------------------------------------------------------------------
def test_python_requirement_is_the_readme_one():
    """README: "Python 3.11 or later"; setup.cfg's python_requires says the same."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["options"]["python_requires"].replace(" ", "") == ">=3.11"
    assert "Python 3.11 or later" in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


# -- Stream rows -----------------------------------------------------------------------------------
def test_each_stream_is_a_new_stream_33_distinct(sim_backend):
    """README `Stream()` row: torch hands streams round-robin from a pool of 32 (a 33rd
    repeats a handle); "each Stream() creates a stream": 33 live streams, 33 handles, and
    none is another's."""
    streams = [accel.Stream() for _ in range(33)]
    assert len({_handle(s) for s in streams}) == 33
    assert len({s for s in streams}) == 33
    for s in streams:
        s.close()


def test_stream_by_id_is_the_live_object_and_unknown_id_refused(sim_backend):
    """README `Stream(stream_id=…, device_index=…, device_type=…)` row: "the live Stream object
    itself; an id of no live accel stream is refused"."""
    s = accel.Stream(device=1) if accel.device_count() > 1 else accel.Stream()
    again = accel.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
    assert again is s
    gone = s.stream_id
    s.close()
    with pytest.raises(ValueError, match="no live accel stream"):
        accel.Stream(stream_id=gone, device_index=s.device_index, device_type=s.device_type)


def test_external_stream_names_are_from_handle(sim_cuda):
    """README API table: "`Stream.from_handle` = `accel.ExternalStream` =
    `accel.get_stream_from_external`": each wraps the handle in a foreign Stream equal to the
    others, and `cudaStreamPerThread` is refused (the `Stream.from_handle` row)."""
    s = accel.Stream()
    wrapped = [accel.Stream.from_handle(s.stream_id, 0), accel.ExternalStream(s.stream_id, 0),
               accel.get_stream_from_external(s.stream_id, 0)]
    assert all(w == s and hash(w) == hash(s) and w is not s for w in wrapped)
    for fn in (accel.Stream.from_handle, accel.ExternalStream, accel.get_stream_from_external):
        with pytest.raises(ValueError, match="cudaStreamPerThread"):
            fn(2, 0)


# -- Event rows ------------------------------------------------------------------------------------
def test_event_interprocess_is_not_implemented(sim_backend):
    """README `Event(interprocess=True)` row: "refused (`NotImplementedError`)"."""
    with pytest.raises(NotImplementedError, match="inter-process"):
        accel.Event(interprocess=True)


def test_external_events_refused_at_construction_on_xpu_and_mps(sim_backend):
    """README `Event(external=True)` row: "XPU and MPS refuse it at construction"; CUDA takes
    it (the flag applies when the recording stream captures)."""
    if sim_backend == "cuda":
        e = accel.Event(external=True)
        assert e.external
        e.record()
        e.synchronize()
    else:
        with pytest.raises(NotImplementedError, match=f"not available on {sim_backend}"):
            accel.Event(external=True)


# -- "small refusals" row --------------------------------------------------------------------------
def test_elapsed_time_waits_for_both_events(monkeypatch, sim_graph_backend):
    """README "small refusals": torch raises unless both events completed; accel's
    `elapsed_time` "waits for both events".  With slow simulated work the end event is still
    pending when asked, and the call answers (>= 0) and leaves it complete."""
    use_sim(monkeypatch, sim_graph_backend, ACCEL_SIM_DELAY_US=3000)
    buf = accel.Buffer(1 << 12)
    s = accel.Stream()
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    with s:
        start.record()
        for _ in range(4):
            buf.fill_(1)
        end.record()
    assert start.elapsed_time(end) >= 0        # (no refusal whether or not the work was done)
    assert end.query() and start.query()


def test_pool_and_get_offset_answer_during_a_capture(sim_graph_backend):
    """README "small refusals": "`pool()` and `get_offset()` answer during a capture" (torch
    refuses both); the capture stays valid and replays."""
    gen = accel.random.default_generator(0)
    offset = gen.get_offset()
    buf = accel.Buffer(256)
    g = accel.Graph()
    s = accel.Stream()
    with s:
        g.capture_begin()
        try:
            buf.fill_(7)
            pool = g.pool()
            during = gen.get_offset()
        finally:
            g.capture_end()
    assert isinstance(pool, tuple) and len(pool) == 2
    assert during == offset
    g.replay()
    accel.synchronize()
    assert (buf.to_numpy() == 7).all()


def test_graphsafe_set_state_of_another_device_is_a_value_error(sim_backend):
    """README "small refusals": torch's `graphsafe_set_state` takes another device's state;
    accel: "another device's state is a `ValueError`", and the generator keeps its state."""
    if accel.device_count() < 2:
        pytest.skip("one simulated device (Metal)")
    gen0, gen1 = accel.random.default_generator(0), accel.random.default_generator(1)
    gen0.manual_seed(11)
    gen1.manual_seed(22)
    before = gen0.get_state().tobytes()
    with pytest.raises(ValueError, match="device 1.*device 0"):
        gen0.graphsafe_set_state(gen1.graphsafe_get_state())
    assert gen0.get_state().tobytes() == before and gen0.initial_seed() == 11


# -- manual_seed row -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1.5, True, "42", None, 2.0])
def test_seeds_are_integers_only(sim_backend, seed):
    """README `manual_seed` row: torch's `int(seed)` takes `1.5`, `True`, `"42"`; accel takes
    "integers only (`__index__`: int, numpy integers); anything else is a `TypeError` (also a
    `RuntimeError`)", and the seed is unchanged (bool is refused too: the row lists `True`
    among what `int()` would hide)."""
    accel.random.manual_seed(5)
    for fn in (accel.random.manual_seed, accel.random.manual_seed_all):
        with pytest.raises(TypeError) as info:
            fn(seed)
        assert isinstance(info.value, RuntimeError)
    assert accel.random.initial_seed() == 5


def test_numpy_integer_seeds_are_taken(sim_backend):
    """README `manual_seed` row: "`__index__`: int, numpy integers"."""
    accel.random.manual_seed(np.int64(12))
    assert accel.random.initial_seed() == 12
    accel.random.manual_seed_all(np.uint32(13))
    assert accel.random.initial_seed() == 13


def test_same_philox_numbers_on_every_backend(monkeypatch):
    """README: "same Philox streams, seeds and graph-safe offsets" on every backend; Philox
    (host and device) "agree bit for bit"; Metal's normal fills use the host path.  The same
    seed gives the same uniform and normal float32 words on the three simulators."""
    got = {}
    for kind in ("cuda", "xpu", "mps"):
        use_sim(monkeypatch, kind)
        u, n = accel.Buffer(256), accel.Buffer(256)
        accel.random.manual_seed(123)
        accel.random.uniform_(u)
        accel.random.normal_(n)
        got[kind] = (u.to_numpy(np.float32).tobytes(), n.to_numpy(np.float32).tobytes())
        u.close()
        n.close()
    assert got["cuda"] == got["xpu"] == got["mps"]


# -- memory rows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [1.5, -0.1, 2.0])
def test_memory_fraction_is_0_to_1_on_every_backend(sim_backend, fraction):
    """README `set_per_process_memory_fraction` on MPS row: torch.mps takes 0–2; accel "0–1 on
    every backend, as torch.cuda".  torch docs: torch.mps.set_per_process_memory_fraction
    "fraction (float) – Range: 0~2"; torch.cuda's and torch.xpu's "Range: 0~1".  A refusal
    leaves the fraction."""
    before = accel.memory.get_per_process_memory_fraction()
    with pytest.raises(ValueError, match="Allowed range: 0~1"):
        accel.memory.set_per_process_memory_fraction(fraction)
    assert accel.memory.get_per_process_memory_fraction() == before
    accel.memory.set_per_process_memory_fraction(1.0)
    accel.memory.set_per_process_memory_fraction(0.0)
    assert accel.memory.get_per_process_memory_fraction() == 0.0


def test_mempool_belongs_to_its_device_and_custom_allocators_are_refused(sim_backend):
    """README `MemPool` row: "a pool belongs to the device it was made on (`ValueError`
    elsewhere) ... a custom `allocator` is refused (`NotImplementedError`)"."""
    with pytest.raises(NotImplementedError, match="pluggable"):
        accel.memory.MemPool(allocator=object())
    if accel.device_count() < 2:
        return
    pool = accel.memory.MemPool()
    reserved1 = accel.memory_reserved(1)
    with accel.device_index(1):
        with pytest.raises(ValueError, match="belongs to device 0, not device 1"):
            with accel.memory.use_mem_pool(pool):
                accel.Buffer(16)
    assert accel.memory_reserved(1) == reserved1


def test_one_exabyte_is_refused_before_the_cache(sim_backend):
    """README: "A request of 1 EB or more is refused first, as torch does, without touching
    the cache" (torch: "Tried to allocate more than 1EB memory")."""
    keep = accel.Buffer(1 << 20)
    free = accel.Buffer(1 << 20)
    free.close()                                   # a cached free block
    reserved = accel.memory_reserved()
    with pytest.raises(accel.OutOfMemoryError, match="more than 1EB"):
        accel.Buffer(1 << 60)
    assert accel.memory_reserved() == reserved      # the cache was not emptied for a retry
    keep.close()


def test_default_segments_per_backend(monkeypatch, sim_backend):
    """README "caching allocator, default": "expandable segments on where the backend has
    virtual memory (CUDA, Level Zero); classic segments elsewhere round to 2 MiB"."""
    _defaults(monkeypatch, sim_backend)
    keep = accel.Buffer(5 * MiB)
    segments = accel.memory.memory_snapshot()
    mine = [s for s in segments if s["device"] == 0]
    if sim_backend == "mps":
        assert not any(s["is_expandable"] for s in mine)
        assert all(s["total_size"] % (2 * MiB) == 0 for s in mine)
        assert any(s["total_size"] == 6 * MiB for s in mine)          # 5 MiB rounded to 2 MiB
    else:
        assert all(s["is_expandable"] for s in mine)
    keep.close()


def test_policy_torch_gives_torchs_segment_sizes(monkeypatch, sim_graph_backend):
    """README: torch's default is "classic segments (20 MiB for 1–10 MiB requests), expandable
    segments off"; "`ACCEL_ALLOC_CONF=policy:torch` gives torch's rules and default"."""
    use_sim(monkeypatch, sim_graph_backend, ACCEL_ALLOC_CONF="policy:torch")
    small, mid = accel.Buffer(1000), accel.Buffer(5 * MiB)
    sizes = sorted((s["segment_type"], s["total_size"], s["is_expandable"])
                   for s in accel.memory.memory_snapshot() if s["device"] == 0)
    assert sizes == [("large", 20 * MiB, False), ("small", 2 * MiB, False)]
    small.close()
    mid.close()


def test_cuda_malloc_async_snapshot_and_empty_cache_in_capture(monkeypatch):
    """README `backend:cudaMallocAsync` row: `memory_snapshot()` "returns no segments" (torch
    raises); and "`empty_cache` ... (refused with `CaptureError` while a capture is
    underway)"."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    buf = accel.Buffer(1 << 20)
    assert accel.memory.memory_snapshot() == []
    s, g = accel.Stream(), accel.Graph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # (the empty-graph warning)
        with s:
            g.capture_begin()
            try:
                with pytest.raises(CaptureError, match="capture"):
                    accel.memory.empty_cache()
            finally:
                g.capture_end()
    buf.close()


# -- ACCEL_ALLOC_CONF: "Values are read as torch's CUDA build reads them" -------------------------
@pytest.mark.parametrize("text, field, value", [
    ("max_split_size_mb:64MB", "max_split_size", 64 * MiB),          # "`64MB` is 64"
    ("max_split_size_mb:-1", "max_split_size", _config.UNLIMITED),    # "`-1` wraps to no limit"
    ("max_non_split_rounding_mb:-1", "max_non_split_rounding", _config.UNLIMITED),
    ("max_split_size_mb:20", "max_split_size", 20 * MiB),             # "at least ... default 20"
    ("max_split_size_mb:64,", "max_split_size", 64 * MiB),            # one trailing comma, as torch
    ("backend:native,backend:native", "backend", "native"),           # two *different* are refused
    ("garbage_collection_threshold:0.6abc", "garbage_collection_threshold", 0.6),   # std::stod prefix
])
def test_alloc_conf_values_read_as_torch_reads_them(text, field, value):
    assert getattr(_config.parse(text), field) == value


@pytest.mark.parametrize("text, match", [
    (",max_split_size_mb:64", "empty option"),
    ("max_split_size_mb:64,,expandable_segments:True", "empty option"),
    ("backend:native,backend:cudaMallocAsync", "name one backend"),
    ("max_split_size_mb:19", "must be >= 20"),
    ("max_non_split_rounding_mb:19", "must be >= 20"),
    ("policy:torch,max_split_size_mb:25,large_segment_size_mb:30", "must be >= 30"),
    ("bogus:1", "valid options are:\n  max_split_size_mb"),
    ("expandable_segments:true", "True/False"),
])
def test_alloc_conf_refusals_as_readme_lists(text, match):
    """README: "an empty option or two different `backend` values refused"; max_split_size_mb
    and max_non_split_rounding_mb "both at least `large_segment_size_mb`, default 20"; "an
    unknown key or a bad value raises `ValueError` listing the valid options"."""
    with pytest.raises(ValueError, match=match):
        _config.parse(text)


def test_alloc_conf_hip_variable_skips_cuda_keys_with_a_warning():
    """README: "in `PYTORCH_HIP_ALLOC_CONF` the CUDA parser's keys are skipped with a warning,
    as a CUDA build never reads them there"."""
    with pytest.warns(UserWarning, match="backend, per_process_memory_fraction.*CUDA options"):
        config = _config.parse("backend:cudaMallocAsync,per_process_memory_fraction:0.5,max_split_size_mb:64",
                               "PYTORCH_HIP_ALLOC_CONF")
    assert (config.backend, config.per_process_memory_fraction, config.max_split_size) == ("native", 1.0, 64 * MiB)


def test_alloc_conf_torch_only_keys_warn_once_and_do_nothing():
    """README: "torch's other keys are accepted with one warning and no effect"."""
    text = "pinned_use_background_threads:True,release_lock_on_cudamalloc:True"
    with pytest.warns(UserWarning, match="torch options accel does not implement"):
        config = _config.parse(text, "PYTORCH_CUDA_ALLOC_CONF")
    assert config._replace(source="", text="") == _config.AllocConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config.parse(text, "PYTORCH_CUDA_ALLOC_CONF")       # one warning per process, not per parse


def test_alloc_conf_empty_pytorch_variable_is_read(monkeypatch, sim_backend):
    """README: the first of PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF and
    PYTORCH_ALLOC_CONF "that is set (even empty) is read"."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "bogus:1")
    config = _config.from_environment()
    assert config.source == "PYTORCH_CUDA_ALLOC_CONF" and config.text == ""


def test_get_allocator_settings_returns_the_last_string(sim_backend):
    """README: "`get_allocator_settings()` returns the last string"."""
    text = "garbage_collection_threshold:0.5,max_split_size_mb:64"
    accel.memory.set_allocator_settings(text)
    assert accel.memory.get_allocator_settings() == text
    accel.memory.set_allocator_settings("max_split_size_mb:128")
    assert accel.memory.get_allocator_settings() == "max_split_size_mb:128"


# -- Which CUDA runtime ----------------------------------------------------------------------------
def test_no_runtime_the_driver_can_run(monkeypatch):
    """README "Which CUDA runtime": "When NVML sees GPUs but no installed runtime can run on the
    driver (the 13 wheel on an R550 node), `is_available()` is False and the reason names both
    versions and what to install (`pip install nvidia-cuda-runtime-cu12`, or a driver ≥ R580);
    CUDA stays the accelerator type, so the first device use raises that reason"."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="13.0", ACCEL_SIM_CUDA_DRIVER="12.4")
    assert accel.is_available() is False
    assert accel.current_accelerator().type == "cuda"
    with pytest.raises(accel.AcceleratorError) as info:
        accel.Buffer(16)
    text = str(info.value)
    for part in ("13.0", "12.4", "pip install nvidia-cuda-runtime-cu12", "R580"):
        assert part in text


@pytest.mark.parametrize("driver, chosen, reason", [
    ("12.8", "12.4", "newest runtime the driver (CUDA 12.8) supports"),
    ("13.0", "13.0", "newest runtime the driver (CUDA 13.0) supports"),
    ("12.2", "12.4", "minor-version compatibility"),
])
def test_runtime_choice_and_report(driver, chosen, reason):
    """README: accel "takes the newest runtime it has bindings for (12, 13) that the driver fully
    supports (≤ its version), else the newest that runs"; "`python -m accel` lists every
    candidate as taken or rejected, with why" (and `--json` prints the same for machines)."""
    import json
    out = subprocess.run([sys.executable, "-m", "accel", "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=_clean_env(ACCEL_SIM="cuda", ACCEL_SIM_CUDA_RUNTIME="12.4,13.0",
                                                    ACCEL_SIM_CUDA_DRIVER=driver))
    assert out.returncode == 0, out.stderr
    choice = json.loads(out.stdout)["backends"]["cuda"]["cudart_choice"]
    assert choice["chosen_version"] == chosen
    verdicts = {c["version"]: (c["verdict"], c["reason"]) for c in choice["candidates"]}
    assert verdicts[chosen][0] == "taken" and reason in verdicts[chosen][1]
    assert [v for v, (verdict, _) in verdicts.items() if verdict == "rejected"] == [
        v for v in ("12.4", "13.0") if v != chosen]


# -- simulator variables ---------------------------------------------------------------------------
def test_sim_peer_settings(monkeypatch):
    """README `ACCEL_SIM_PEER`: "`all` (default), `none`, or pairs of physical devices such as
    `0:1,2:3`"."""
    monkeypatch.delenv("ACCEL_SIM_PEER", raising=False)
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=4)
    assert all(accel.can_device_access_peer(a, b) for a in range(4) for b in range(4) if a != b)
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=4, ACCEL_SIM_PEER="none")
    assert not any(accel.can_device_access_peer(a, b) for a in range(4) for b in range(4) if a != b)
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=4, ACCEL_SIM_PEER="0:1,2:3")
    peers = {(a, b) for a in range(4) for b in range(4) if a != b and accel.can_device_access_peer(a, b)}
    assert peers == {(0, 1), (1, 0), (2, 3), (3, 2)}


@pytest.mark.parametrize("order", ["PCI_BUS_ID", "FASTEST_FIRST"])
def test_sim_pci_order(monkeypatch, order):
    """README `ACCEL_SIM_PCI_ORDER`: "the simulated physical devices in PCI bus id order, e.g.
    `1,0`: NVML and `CUDA_DEVICE_ORDER=PCI_BUS_ID` enumerate in it, the CUDA default
    (`FASTEST_FIRST`) in physical order"."""
    use_sim(monkeypatch, "cuda")
    physical = [str(accel.get_device_properties(i).uuid) for i in range(2)]
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PCI_ORDER="1,0", CUDA_DEVICE_ORDER=order)
    got = [accel.get_device_properties(i) for i in range(2)]
    uuids = [str(p.uuid) for p in got]
    if order == "PCI_BUS_ID":
        assert uuids == physical[::-1]
        assert got[0].pci_bus_id < got[1].pci_bus_id
    else:
        assert uuids == physical
        assert got[0].pci_bus_id > got[1].pci_bus_id


def test_test_sim_peer_knob_is_kept_and_overridable():
    """README: "`ACCEL_TEST_SIM_PEER=none python -m pytest ...` reruns tests on a simulated
    machine whose devices cannot reach each other's memory (tests/conftest.py sets
    `ACCEL_SIM_PEER` from it; a test setting it itself wins)": the knob survives the clean
    environment, and the fixture sets ACCEL_SIM_PEER through monkeypatch (a test's own setenv
    comes later and wins)."""
    import conftest
    assert "ACCEL_TEST_SIM_PEER" in conftest._KEEP
    assert conftest.dropped_env({"ACCEL_TEST_SIM_PEER": "none", "ACCEL_SIM_PEER": "none"}, False) == [
        "ACCEL_SIM_PEER"]


def test_zes_enable_sysman_makes_no_zes_init(monkeypatch):
    """README XPU notes: "With `ZES_ENABLE_SYSMAN=1` in the environment ... accel makes no
    `zesInit` ... and counts the same way"."""
    from accel import sim
    use_sim(monkeypatch, "xpu")
    plain = accel.device_count()
    assert dict(sim.calls()).get("zesInit", 0) >= 1
    use_sim(monkeypatch, "xpu", ZES_ENABLE_SYSMAN=1)
    before = dict(sim.calls()).get("zesInit", 0)
    assert accel.device_count() == plain == 2
    assert dict(sim.calls()).get("zesInit", 0) == before


def test_cuda_visible_devices_stops_at_the_first_invalid_entry(monkeypatch):
    """README: `CUDA_VISIBLE_DEVICES` "honoured when counting, exactly as the CUDA runtime
    parses them (... stop at the first invalid entry)"; CUDA C Programming Guide, "CUDA
    Environment Variables": "Only the devices whose index is present in the sequence are
    visible to CUDA applications"; an invalid index ends the list (torch's
    _parse_visible_devices: "Return empty list if invalid ... stop at the first")."""
    for value, count in (("1,foo,0", 1), ("3,7,0", 1), ("-1,0", 0), ("1,0", 2)):
        use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=4, CUDA_VISIBLE_DEVICES=value)
        assert accel.device_count() == count, value


# -- DLPack ----------------------------------------------------------------------------------------
def test_dlpack_copies_when_asked(sim_backend):
    """README: "`dl_device=(kDLCPU, 0)` (what `numpy.from_dlpack(x, device="cpu")` sends) gives
    a host copy, and `copy=True` a copy in a new Buffer on the same device, each flagged
    `DLPACK_FLAG_BITMASK_IS_COPIED`"."""
    buf = accel.Buffer(64).fill_(3)
    host = parse(buf.__dlpack__(dl_device=(KDLCPU, 0), max_version=(1, 0)))
    assert host.device_type == KDLCPU and host.flags & IS_COPIED
    del host
    same = parse(buf.__dlpack__(copy=True, max_version=(1, 0)))
    assert (same.device_type, same.device_id) == buf.__dlpack_device__() and same.flags & IS_COPIED
    assert same.data + same.byte_offset != buf.ptr or sim_backend == "mps"
    del same
    assert (np.from_dlpack(buf, device="cpu") == 3).all()
    plain = parse(buf.__dlpack__(max_version=(1, 0)))
    assert not plain.flags & IS_COPIED
    del plain


def test_dlpack_during_a_capture_serves_only_the_capture(sim_cuda):
    """README: "During a capture, `__dlpack__` serves the capturing stream, a stream of the same
    capture, or `stream=-1`, and refuses any other stream (its wait would pull it into the
    capture)"."""
    buf = accel.Buffer(64)
    s, joined, other = accel.Stream(), accel.Stream(), accel.Stream()
    g = accel.Graph()
    with s:
        g.capture_begin()
        try:
            buf.fill_(1)
            joined.wait_stream(s)                  # joins the capture (CUDA: cross-stream dependency)
            for stream in (s.stream_id, joined.stream_id, -1):
                capsule = buf.__dlpack__(stream=stream)
                del capsule
            for stream in (other.stream_id, None):
                with pytest.raises(CaptureError, match="capturing"):
                    buf.__dlpack__(stream=stream)
            s.wait_stream(joined)
        finally:
            g.capture_end()
    g.replay()
    accel.synchronize()
    assert (buf.to_numpy() == 1).all()


def test_metal_capsule_is_the_mtlbuffer_and_the_offset(mps_backend):
    """README: "On Metal a capsule's `data` is the `id<MTLBuffer>` and `byte_offset` the offset
    into it, as torch's MPS tensors and MLX read it": two buffers of one segment name one
    MTLBuffer, at offsets that differ as their contents addresses do."""
    a, b = accel.Buffer(4096), accel.Buffer(4096)
    ca, cb = parse(a.__dlpack__(max_version=(1, 0))), parse(b.__dlpack__(max_version=(1, 0)))
    assert ca.data == cb.data and ca.data not in (a.ptr, b.ptr)
    assert cb.byte_offset - ca.byte_offset == b.ptr - a.ptr
    del ca, cb


@pytest.mark.parametrize("kind", [
    "cuda", "xpu",
    # r85b, fixed in session 40: ArrayView.__dlpack__'s docstring said the capsule holds "the data
    # pointer at the first element (byte_offset 0)"; on MPS the data is the id<MTLBuffer> and
    # byte_offset the view's offset into it (README 'Interop'; what torch's MPS from_dlpack reads)
    "mps"])
def test_array_view_capsule_is_the_first_element_with_byte_offset_0(monkeypatch, kind):
    """ArrayView.__dlpack__: "A DLPack capsule of the view (zero copy): ... the data pointer at
    the first element (``byte_offset`` 0; on MPS the data is the ``id<MTLBuffer>`` and
    ``byte_offset`` the view's offset into it ...)"."""
    use_sim(monkeypatch, kind)
    buf = accel.Buffer(256)
    view = buf.as_array(np.float32, (8,), offset=64)
    info = parse(view.__dlpack__(max_version=(1, 0)))
    first, offset = info.data, info.byte_offset
    del info
    if kind == "mps":
        whole = parse(buf.as_array(np.float32, (64,)).__dlpack__(max_version=(1, 0)))
        assert (first, offset) == (whole.data, 64)      # the same MTLBuffer, 64 bytes in
        del whole
    else:
        assert (first, offset) == (buf.ptr + 64, 0)


_TEMPORARY = """
import os, sys
import accel
buf = accel.Buffer(64)
def take(a, b):
    pass
try:
    {expr}
except BaseException as exc:
    print("raised", type(exc).__name__, flush=True)
from accel import _dlpack
print("live", _dlpack.live_exports(), flush=True)
"""


def test_capsule_in_a_local_of_a_frame_an_exception_leaves(sim_cuda):
    """README: an unconsumed capsule "is still released"; "pass the object itself ... rather than
    a capsule you made".  Held in a local of the frame an exception leaves, the traceback keeps
    it to the end of the handler: the caller gets its own exception and the export is gone."""
    code = _TEMPORARY.replace("def take(a, b):\n    pass", "def take():\n    c = buf.__dlpack__()\n    1 / 0")
    code = code.format(expr="take()")
    out = _run(code, ACCEL_SIM="cuda")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "raised ZeroDivisionError" in out.stdout and "live 0" in out.stdout


@pytest.mark.parametrize("expr", ["[buf.__dlpack__(), 1 / 0]", "take(buf.__dlpack__(), 1 / 0)"])
@pytest.mark.xfail(strict=True, reason=(
    "r85b, left open in session 40 as a CPython limit of a pure-Python producer (README 'Interop' now "
    "says so): accel._dlpack.exporting._on_capsule_free: a capsule held as a temporary on the value stack "
    "(README's own example '[buf.__dlpack__(), 1 / 0]') is dropped by the eval loop's exception unwind; "
    "the ctypes destructor fetches the pending exception, then restores it by raising inside the "
    "callback, which ctypes reports as unraisable and clears, so the unwind continues with no exception "
    "set and the interpreter dies of SIGSEGV. README says the caller gets SystemError; the process crashes "
    "(Python's 'Extending and Embedding', Finalization and De-allocation: a deallocator must leave any "
    "pending exception alone, 'since deallocators are frequently called as the interpreter unwinds the "
    "Python stack')"))
def test_capsule_temporary_dropped_as_an_exception_propagates(sim_cuda, expr):
    """What a producer should do (the README said so before session 40, which now documents the
    crash): the capsule released, the exception kept.  A ctypes or cffi destructor cannot (the lead
    tried both, with a capsule of a bare PyCapsule_New: each dies of SIGSEGV in these two
    expressions); only a C one can."""
    out = _run(_TEMPORARY.format(expr=expr), ACCEL_SIM="cuda")
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-600:]}"
    assert "raised SystemError" in out.stdout or "raised ZeroDivisionError" in out.stdout
    assert "live 0" in out.stdout


# -- kernels ---------------------------------------------------------------------------------------
_MSL = r"""
#include <metal_stdlib>
using namespace metal;
kernel void fill7(device float *y [[buffer(0)]], constant uint &n [[buffer(1)]],
                  uint i [[thread_position_in_grid]])
{ if (i < n) y[i] = 7.0f; }
"""


def test_metal_kernel_reports_two_occupancy_attributes(mps_backend):
    """accel.Kernel: "Metal reports :attr:`max_threads_per_block` and :attr:`shared_size_bytes`
    (the kernel's threadgroup variables) only (the others raise NotImplementedError)"."""
    import accel.sim

    def ref(grid, block, view, y, n):
        view(y, 4 * n, np.float32)[:] = 7

    accel.sim.register_kernel("fill7", ref, "ptr, u32")
    kernel = accel.Module(_MSL).function("fill7", signature="ptr, u32")
    assert kernel.max_threads_per_block > 0
    assert kernel.shared_size_bytes == 0
    with pytest.raises(NotImplementedError):
        kernel.num_regs
    with pytest.raises(NotImplementedError):
        kernel.max_potential_block_size()
    y = accel.Buffer(64)
    accel.launch(kernel, 1, 16, y, 16)
    assert (y.to_numpy(np.float32) == 7).all()


def test_launch_opts_in_above_48_kib_of_shared_memory(sim_cuda):
    """accel.launch: "Above 48 KiB of shared memory the kernel is opted in first (CUDA:
    ``cudaFuncAttributeMaxDynamicSharedMemorySize``), up to the device's opt-in limit".  CUDA C
    Programming Guide (Shared Memory, compute capability 7.x+): "Kernels relying on shared memory
    allocations over 48 KB per block ... must use dynamic shared memory ... and require an
    explicit opt-in using cudaFuncSetAttribute()"."""
    from accel import sim
    from conftest import vendor_calls_made_by
    sim.register_kernel("r85b_k", lambda grid, block, view, *args: None, "u64")
    try:
        kernel = accel.Module(_PTX).function("r85b_k")
        at_48 = vendor_calls_made_by(lambda: accel.launch(kernel, 1, 32, 0, shared_mem=48 << 10))
        above = vendor_calls_made_by(lambda: accel.launch(kernel, 1, 32, 0, shared_mem=64 << 10))
        assert "cudaFuncSetAttribute" not in at_48 and above.get("cudaFuncSetAttribute") == 1
        with pytest.raises(ValueError, match="above the device's limit"):
            accel.launch(kernel, 1, 32, 0, shared_mem=1 << 20)
        accel.synchronize()
    finally:
        sim.unregister_kernel("r85b_k")


_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry r85b_k(
    .param .u64 p0
)
{
    ret;
}
"""


@pytest.mark.parametrize("runtime, loads, not_loads", [
    ("12.4", {"cudaGetDriverEntryPoint", "cuModuleLoadData"}, "cudaLibraryLoadData"),
    ("12.8", {"cudaLibraryLoadData"}, "cuModuleLoadData"),
    ("13.0", {"cudaLibraryLoadData"}, "cuModuleLoadData"),
])
def test_rng_kernels_load_by_runtime_version(monkeypatch, runtime, loads, not_loads):
    """README CUDA notes: the RNG kernels "are loaded with `cudaLibraryLoadData` on runtimes
    12.8+, and on older ones with the driver's `cuModuleLoadData` reached through
    `cudaGetDriverEntryPoint`: no nvrtc, no libcuda binding"."""
    from conftest import vendor_calls_made_by
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME=runtime)
    buf = accel.Buffer(4096)
    calls = vendor_calls_made_by(lambda: (accel.random.uniform_(buf), accel.synchronize()))
    assert loads <= set(calls) and not_loads not in calls
    assert not any("nvrtc" in name.lower() for name in calls)


def test_cai_named_stream_is_destroyed_only_once_the_buffer_goes(sim_cuda):
    """README: "every stream that a `__cuda_array_interface__` named is destroyed by
    `Stream.close()` only once the buffer is closed or collected" (CAI v3: the consumer may
    still use the stream the producer named)."""
    import gc
    from accel import sim

    def destroyed():
        return dict(sim.calls()).get("cudaStreamDestroy", 0)

    for end in ("close", "collect"):
        buf, s = accel.Buffer(64), accel.Stream()
        with s:
            buf.fill_(1)
        assert buf.__cuda_array_interface__["stream"] == s.stream_id
        before = destroyed()
        s.close()
        assert destroyed() == before
        if end == "close":
            buf.close()
        else:
            del buf
            gc.collect()
            accel.synchronize()                     # (an API entry runs pending releases)
        assert destroyed() == before + 1


def test_pool_segment_of_a_destroyed_stream_leaves_the_pool(sim_backend):
    """README `MemPool` segments of a destroyed stream row / MemPool docstring: "a segment that a
    destroyed Stream allocated in the pool leaves the pool for the general cache once wholly
    free, unless a graph capture used the pool"."""
    pool = accel.memory.MemPool()
    s = accel.Stream()
    with s, accel.memory.use_mem_pool(pool):
        buf = accel.Buffer(1 << 20)
    reserved = accel.memory_reserved()
    buf.close()
    assert len(pool.snapshot()) == 1                # free, but its stream lives: still the pool's
    s.close()
    accel.synchronize()
    assert pool.snapshot() == []
    assert accel.memory_reserved() == reserved      # in the general cache, not given back
    assert all(seg["segment_pool_id"] == (0, 0) for seg in accel.memory.memory_snapshot())


def test_foreign_stream_forgotten_when_its_last_wrapper_goes(sim_cuda):
    """README `Stream.from_handle` row: "when the last accel wrapper of the handle goes, the
    allocators forget it as for a destroyed stream (... its free blocks join the default
    stream's cache)"."""
    import gc
    from accel import _lazy
    backend = _lazy.lazy_init()
    handle = backend.stream_create()
    try:
        wrapper = accel.Stream.from_handle(handle, 0)
        with wrapper:
            buf = accel.Buffer(1 << 20)
        assert {seg["stream"] for seg in accel.memory.memory_snapshot()} == {handle}
        buf.close()
        del wrapper
        gc.collect()
        accel.Buffer(16).close()                    # an API entry after the wrapper went
        assert {seg["stream"] for seg in accel.memory.memory_snapshot()} == {0}
    finally:
        accel.synchronize()
        backend.stream_destroy(handle)


def test_memory_stats_has_123_sorted_keys_and_12_per_private_pool(sim_backend):
    """accel.memory_stats: "The allocator statistics with torch 2.13's ... keys, sorted: 123, and
    12 per private pool" ("An empty OrderedDict before the runtime is initialized")."""
    assert len(accel.memory.memory_stats()) == 0
    keep = accel.Buffer(16)
    stats = accel.memory.memory_stats()
    assert len(stats) == 123 and list(stats) == sorted(stats)
    pool = accel.memory.MemPool()
    with accel.memory.use_mem_pool(pool):
        inside = accel.Buffer(16)
    stats = accel.memory.memory_stats()
    assert len(stats) == 135 and list(stats) == sorted(stats)
    prefix = f"reserved_bytes_by_private_pools.{pool.id[0]}_{pool.id[1]}."
    assert sum(key.startswith(prefix) for key in stats) == 12
    inside.close()
    keep.close()


def test_event_handle_is_0_until_the_first_record(sim_backend):
    """accel.Event: "the device handle is created at the first :meth:`record`, on the recording
    stream's device, and :attr:`handle` is 0 until then"."""
    e = accel.Event()
    assert e.handle == 0
    e.record()
    assert e.handle != 0
    e.synchronize()


def test_graph_with_statement_refuses_the_default_stream(sim_graph_backend):
    """accel.Graph: "``with g:`` ... captures the body on the current stream (which must not be
    the legacy default stream: use ``with stream, g:`` or :func:`accel.graph`)"; torch's
    message: "CUDA graphs must be captured on a non-default stream."  The graph stays usable."""
    buf = accel.Buffer(64)
    g = accel.Graph()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        with g:
            buf.fill_(1)
    with accel.Stream(), g:
        buf.fill_(2)
    g.replay()
    accel.synchronize()
    assert (buf.to_numpy() == 2).all()


def test_native_empty_cache_refused_during_a_capture(sim_graph_backend):
    """README "Captures and other threads": what a capture would forbid "is refused with
    `CaptureError` (`empty_cache`)"; the capture survives it."""
    buf = accel.Buffer(64)
    g, s = accel.Graph(), accel.Stream()
    with s:
        g.capture_begin()
        try:
            buf.fill_(5)
            with pytest.raises(CaptureError):
                accel.memory.empty_cache()
        finally:
            g.capture_end()
    g.replay()
    accel.synchronize()
    assert (buf.to_numpy() == 5).all()


def test_compile_arch_defaults(monkeypatch):
    """accel.compile: ``arch`` None: "the current device's when a CUDA runtime (or the simulator)
    is initialized (never initializes one), else NVRTC's default"."""
    from accel import _lazy
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="8.6")
    src = 'extern "C" __global__ void r85b_empty() {}'
    try:
        before = accel.compile(src).ptx
    except RuntimeError as exc:
        if "nvrtc" in str(exc).lower():
            pytest.skip(f"no NVRTC: {exc}")
        raise
    assert not _lazy.is_initialized()
    assert b".target sm_86" not in before
    accel.Buffer(16).close()
    assert b".target sm_86" in accel.compile(src).ptx


@pytest.mark.parametrize("peer, conf, expect, absent", [
    ("none", None, {"cudaMemcpyPeerAsync"}, {"cuMemSetAccess", "cudaMemcpyAsync"}),
    ("all", None, {"cuMemSetAccess", "cudaMemcpyAsync"}, {"cudaMemcpyPeerAsync"}),
    ("all", "expandable_segments:False", {"cudaMemcpyAsync"}, {"cudaMemcpyPeerAsync", "cuMemSetAccess"}),
])
def test_copy_between_devices_grants_access_or_copies_peer(monkeypatch, peer, conf, expect, absent):
    """README "cross-device copies": "`Buffer.copy_from` grants the copying device access
    (`DeviceCachingAllocator.add_peer`) where `cudaDeviceCanAccessPeer` allows it, and otherwise
    copies with `cudaMemcpyPeerAsync`, which the driver stages".  CUDA Runtime API,
    cudaMemcpyPeerAsync: "Copies memory from one device to memory on another device"; cuMemSetAccess
    grants a peer access to mapped (expandable-segment) memory; cudaMalloc memory needs no grant."""
    from conftest import vendor_calls_made_by
    _defaults(monkeypatch, "cuda")
    env = {"ACCEL_SIM_PEER": peer}
    if conf:
        env["ACCEL_ALLOC_CONF"] = conf
    use_sim(monkeypatch, "cuda", **env)
    src = accel.Buffer(1 << 20).fill_(3)
    with accel.device_index(1):
        dst = accel.Buffer(1 << 20)
    calls = vendor_calls_made_by(lambda: (dst.copy_from(src), accel.synchronize(1)))
    assert expect <= set(calls) and not absent & set(calls)
    assert (dst.to_numpy() == 3).all()


def test_rng_threads_default_is_cpu_count_at_most_8(monkeypatch):
    """README `ACCEL_RNG_THREADS`: "threads for large host Philox fills (default: CPU count, at
    most 8; 1: none ...)"."""
    from accel.random import philox
    monkeypatch.delenv("ACCEL_RNG_THREADS", raising=False)
    for cpus, threads in ((None, 1), (1, 1), (2, 2), (8, 8), (64, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
        assert philox._threads() == threads
    monkeypatch.setenv("ACCEL_RNG_THREADS", "3")
    assert philox._threads() == 3


def test_seeding_in_a_child_forked_after_init_checks_and_does_nothing(sim_cuda):
    """accel.random: "in a child forked after initialization they [the seeding calls] check their
    arguments and do nothing, as torch's (queued there for an initialization that never comes)";
    README: such a child "gets "Cannot re-initialize CUDA in forked subprocess…" at first device
    use"."""
    from conftest import run_forked
    accel.Buffer(16).close()
    accel.random.manual_seed(9)

    def child():
        accel.random.manual_seed(3)
        accel.random.manual_seed_all(4)
        try:
            accel.random.manual_seed("x")
            return 3
        except TypeError:
            pass
        try:
            accel.random.initial_seed()
            return 4
        except RuntimeError as exc:
            if "Cannot re-initialize CUDA in forked subprocess" not in str(exc):
                return 5
        try:
            accel.Buffer(16)
            return 6
        except RuntimeError as exc:
            return 0 if "Cannot re-initialize CUDA in forked subprocess" in str(exc) else 7

    assert run_forked(child, timeout=30) == 0
    assert accel.random.initial_seed() == 9


@pytest.mark.parametrize("runtime", ["12.4", "13.0"])
def test_from_handle_device_checked_from_cuda_12_8(monkeypatch, runtime):
    """Stream.from_handle: "``device`` (... default: the stream's own device where the runtime can
    tell, else the current device) must be the stream's device: CUDA 12.8+ checks it with
    ``cudaStreamGetDevice`` ...; older runtimes cannot"."""
    from conftest import vendor_calls_made_by
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME=runtime)
    s = accel.Stream(device=1)
    if runtime == "13.0":
        with pytest.raises(accel.InvalidDeviceError, match="belongs to device 1, not device 0"):
            accel.Stream.from_handle(s.stream_id, 0)
        calls = vendor_calls_made_by(lambda: accel.Stream.from_handle(s.stream_id))
        assert calls.get("cudaStreamGetDevice") == 1
        assert accel.Stream.from_handle(s.stream_id).device_index == 1
    else:
        calls = vendor_calls_made_by(lambda: accel.Stream.from_handle(s.stream_id))
        assert "cudaStreamGetDevice" not in calls
        assert accel.Stream.from_handle(s.stream_id).device_index == 0      # the current device
        assert accel.Stream.from_handle(s.stream_id, 1).device_index == 1


def test_last_use_stream_is_what_interop_names(sim_cuda):
    """accel.Buffer: "The buffer remembers its *last-use stream*: the stream of its last copy,
    fill, random fill, ``record_stream`` or DLPack export (the allocation stream before any).
    Interop exports name it"."""
    s1, s2, s3, s4 = (accel.Stream() for _ in range(4))
    buf = accel.Buffer(64, stream=s1)

    def named():
        return buf.__cuda_array_interface__["stream"]

    assert named() == s1.stream_id
    with s2:
        buf.fill_(1)
    assert named() == s2.stream_id
    buf.record_stream(s3)
    assert named() == s3.stream_id
    capsule = buf.__dlpack__(stream=s4.stream_id)
    del capsule
    assert named() == s4.stream_id
    with s1:
        accel.random.uniform_(buf)
    assert named() == s1.stream_id
    with s2:
        buf.copy_from(np.zeros(64, np.uint8))
    assert named() == s2.stream_id
    accel.synchronize()


def test_torch_device_arguments_are_the_accel_device_they_name(sim_cuda):
    """README API table: "device arguments: `int`, `"cuda:1"`, `accel.device`, or a
    `torch.device` (taken as the `accel.device` it names ...)"; another type's device is refused
    as its string is."""
    torch = pytest.importorskip("torch")
    accel.set_device_index(torch.device("cuda", 1))
    assert accel.current_device_index() == 1
    with accel.device_index(torch.device("cuda:0")):
        assert accel.current_device_index() == 0
    assert accel.Buffer(16, device=torch.device("cuda:0")).device_index == 0
    assert accel.Stream(device=torch.device("cuda", 1)).device_index == 1
    for other in ("xpu:0", "cpu"):
        with pytest.raises(ValueError, match="doesn't match the current accelerator cuda") as by_torch:
            accel.set_device_index(torch.device(other))
        with pytest.raises(ValueError) as by_string:
            accel.set_device_index(other)
        assert str(by_torch.value) == str(by_string.value)
    assert accel.current_device_index() == 1


def test_classic_segments_release_the_cache_before_passing_the_high_water_mark(mps_backend):
    """README "caching allocator, default": classic segments (Metal) "round to 2 MiB and release
    cached segments before growing past the high-water mark"."""
    a = accel.Buffer(4 * MiB)
    a.close()                                       # cached: reserved 4 MiB, the peak
    assert accel.memory_reserved() == 4 * MiB
    b = accel.Buffer(6 * MiB)                       # would pass 4 MiB: the cached 4 MiB goes first
    assert accel.memory_reserved() == 6 * MiB
    assert accel.memory.memory_stats()["reserved_bytes.all.peak"] == 6 * MiB
    c = accel.Buffer(3 * MiB - 1)                   # 2 MiB rounding: a 4 MiB segment
    assert accel.memory_reserved() == 10 * MiB
    b.close()
    c.close()


def test_collected_stream_is_destroyed(sim_backend):
    """README `Stream()` row: "each `Stream()` creates a stream, destroyed by `close()` or when
    collected"."""
    import gc
    from accel import sim
    name = {"cuda": "cudaStreamDestroy", "xpu": "zeCommandListDestroy", "mps": None}[sim_backend]
    s = accel.Stream()
    with s:
        accel.Buffer(64).fill_(1)
    before = dict(sim.calls())
    del s
    gc.collect()
    accel.synchronize()                             # an API entry: deferred releases run
    after = dict(sim.calls())
    if name is None:
        assert accel.memory_allocated() == 0        # (Metal's queue has no destroy call to count)
    else:
        assert after.get(name, 0) == before.get(name, 0) + 1


def test_get_allocator_settings_before_any_change(monkeypatch, sim_backend):
    """accel.memory.get_allocator_settings: "The option string last given to
    set_allocator_settings, else the one read from the environment (ACCEL_ALLOC_CONF, then
    PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, PYTORCH_ALLOC_CONF), else ``""``"."""
    _defaults(monkeypatch, sim_backend)
    assert accel.memory.get_allocator_settings() == ""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    use_sim(monkeypatch, sim_backend)
    assert accel.memory.get_allocator_settings() == "max_split_size_mb:64"
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "garbage_collection_threshold:0.5")
    use_sim(monkeypatch, sim_backend)
    accel.Buffer(16).close()
    assert accel.memory.get_allocator_settings() == "garbage_collection_threshold:0.5"


def test_memory_snapshot_of_one_pool(sim_backend):
    """accel.memory.memory_snapshot: "With ``mempool_id`` ... only that pool's segments, as torch
    2.13 (``(0, 0)``, torch's id for none, gives every segment)"."""
    keep = accel.Buffer(16)
    pool = accel.memory.MemPool()
    with accel.memory.use_mem_pool(pool):
        inside = accel.Buffer(16)
    every = accel.memory.memory_snapshot()
    assert len(every) == 2
    assert accel.memory.memory_snapshot(mempool_id=(0, 0)) == every
    mine = accel.memory.memory_snapshot(mempool_id=pool.id)
    assert [seg["segment_pool_id"] for seg in mine] == [pool.id]
    inside.close()
    keep.close()


def test_empty_cache_before_init_is_a_no_op(sim_backend):
    """accel.memory.empty_cache: "No-op before initialization"."""
    from accel import _lazy
    accel.memory.empty_cache()
    accel.memory.empty_host_cache()
    assert not _lazy.is_initialized()


def test_empty_pinned_returns_to_the_cache_when_every_view_is_gone(sim_backend):
    """accel.empty_pinned: "A new, uninitialized numpy array of ``shape`` and ``dtype`` in pinned
    ... host memory from accel's host caching allocator ...  The memory returns to the cache when
    the array and every view of it are gone"; README: `Buffer.copy_to(out, non_blocking=True)`."""
    import gc

    def active():
        return accel.memory.host_memory_stats()["active_requests.current"]

    a = accel.empty_pinned((4, 8), np.float32)
    assert isinstance(a, np.ndarray) and a.shape == (4, 8) and a.dtype == np.float32
    view = a[1:]
    del a
    gc.collect()
    assert active() == 1
    del view
    gc.collect()
    assert active() == 0 and accel.memory.host_memory_stats()["allocations.current"] == 1   # cached
    out = accel.empty_pinned(128, np.uint8)
    accel.Buffer(128).fill_(2).copy_to(out, non_blocking=True)
    accel.synchronize()
    assert (out == 2).all()


def test_graph_enter_empties_the_cache(sim_graph_backend):
    """accel.Graph: "``with g:`` synchronizes, empties the caches and captures the body" (torch's
    graph __enter__: synchronize, gc.collect, empty_cache)."""
    free = accel.Buffer(8 * MiB)
    free.close()
    assert accel.memory_reserved() >= 8 * MiB
    g = accel.Graph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # (the empty-graph warning)
        with accel.Stream(), g:
            inside = accel.memory_reserved()
    assert inside < 8 * MiB


@pytest.mark.parametrize("mode", ["default", "global", "thread_local", "relaxed"])
def test_event_query_during_a_capture_follows_the_capture_mode(sim_cuda, mode):
    """accel.Event: "Querying or synchronizing any event while a capture is underway follows
    CUDA's rule (an error that invalidates the capture, except in relaxed mode)".  CUDA Driver
    API, CUstreamCaptureMode: GLOBAL/THREAD_LOCAL: a thread with an ongoing capture not begun
    RELAXED "is prohibited from potentially unsafe API calls"; RELAXED: "The local thread is not
    prohibited from potentially unsafe API calls".  Graph's ``capture_error_mode`` takes the four
    names torch takes."""
    done = accel.Event()
    done.record()
    done.synchronize()
    buf = accel.Buffer(64)
    g, s = accel.Graph(capture_error_mode=mode), accel.Stream()
    with s:
        g.capture_begin()
        try:
            buf.fill_(1)
            if mode == "relaxed":
                assert done.query() is True
            else:
                with pytest.raises(CaptureError, match="cudaErrorStreamCaptureUnsupported"):
                    done.query()
        finally:
            if mode == "relaxed":
                g.capture_end()
            else:
                with pytest.raises(CaptureError, match="cudaErrorStreamCaptureInvalidated"):
                    g.capture_end()
    if mode == "relaxed":
        g.replay()
        accel.synchronize()
        assert (buf.to_numpy() == 1).all()


@pytest.mark.parametrize("mode", ["bogus", None, "Global"])
def test_unknown_capture_error_mode_in_torchs_words(sim_graph_backend, mode):
    """torch docs, torch.cuda.graph / CUDAGraph.capture_begin: capture_error_mode "specifies the
    cudaStreamCaptureMode for the graph capture stream. Can be “global”, “thread_local” or
    “relaxed”" (torch's source also takes "default"); accel.Graph takes the same names, and
    another is refused in torch's words ("Unknown capture error mode. Expected `default`,
    `global`, `thread_local`, or `relaxed`, got ...")."""
    with pytest.raises(Exception, match="Unknown capture error mode. Expected `default`, `global`, "
                                        "`thread_local`, or `relaxed`, got"):
        accel.Graph(capture_error_mode=mode)
