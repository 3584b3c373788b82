"""Level Zero simulator against the specification, round r68h.

Three leniencies found by auditing accel/sim/ze (and accel/sim/_ze_kernels.py) against ze_api.h and
the Core Programming Guide (PROG.rst, level-zero-spec 1.14), each now refused:

* **Re-executing a regular command list whose signal events were not reset.** PROG.rst, Command Lists >
  Submission: "A command list may be submitted multiple times. It is up to the application to ensure
  that the command list can be executed multiple times. For example, events must be explicitly reset
  prior to re-execution." The simulator re-ran such a list: its event still held the first run's
  signal, so the host (or another list) waiting for the second run passed at once, before the work it
  waited for -- the race a GPU has, silently. zeCommandQueueExecuteCommandLists now answers
  ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT (in its @returns) unless a reset of the event was
  submitted after its latest signal (zeEventHostReset, zeCommandListAppendEventReset on an immediate or
  executed list, a reset earlier in the list itself or in an earlier list of the same call). The first
  execution after creation or zeCommandListReset is exempt: "Signaling a signaled event ... is valid
  and has no effect" (PROG.rst, Events).
* **A host synchronize as the device is lost.** ``_host_wait`` answered 0 when the device faulted
  between the call's initialization check and its first look at the condition (which counts a lost
  device as done); PROG.rst, Contexts: after a hang "all APIs will return ZE_RESULT_ERROR_DEVICE_LOST".
* **zeModuleCreate's build flags and specialization constants were ignored.** ze_module_desc_t.pBuildFlags
  lists the supported options (PROG.rst, Module Build Options: -ze-opt-disable, -ze-opt-level,
  -ze-opt-greater-than-4GB-buffer-required, -ze-opt-large-register-file, -ze-opt-has-buffer-offset-arg,
  -g); any other option is refused (MODULE_BUILD_FAILURE, the log names it). ``pConstants`` "must be set
  to nullptr if no specialization constants are provided" (INVALID_ARGUMENT), and constants themselves
  are not simulated (the SPIR-V SpecId decorations are not read): UNSUPPORTED_FEATURE.

* **Extension structures in a creation descriptor's pNext were ignored** (ze_api.h: pNext "must be
  null or a pointer to an extension-specific structure"): relaxed allocation limits, external memory,
  counter-based event pools or linked module programs change what the call does, and none is
  simulated. zeContextCreate, zeMemAllocDevice/Host, zeEventPoolCreate, zeEventCreate,
  zeCommandQueueCreate, zeCommandListCreate(Immediate), zeModuleCreate and zeKernelCreate now refuse
  a non-NULL pNext with UNSUPPORTED_FEATURE.

Last, accel: its graph replays (the one place it re-executes a regular list) still run, since the
stream resets the list's completion event before the next launch; and module_load keeps its
build-flags string alive through zeModuleCreate (the flags rule above exposed a dangling pointer
there, fixed meanwhile in 1fd8785; the last test checks it deterministically).
"""

import numpy as np
import pytest

from accel import backends, sim
from accel._hostmem import address_of
from accel._ffi._ze import ffi
from accel.sim.ze import commands as ze_commands, events as ze_events

from conftest import use_sim
from test_sim_ze_metal_strict import ze  # noqa: F401 (the fixture)
from test_user_kernels import spirv_module

_UINT64_MAX = (1 << 64) - 1


def _regular_signalling(z, ev, how, ptr):
    """A closed regular list on device 0 that fills ``ptr`` and signals ``ev`` (``how``: by the
    fill's signal event, an appended signal, or a barrier's)."""
    lib = z.lib
    cl = z.regular()
    if how == "fill":
        assert z.fill(cl, ptr, 64, 7, ev) == 0
    else:
        assert z.fill(cl, ptr, 64, 7) == 0
        if how == "signal":
            # (r69f) the list has no IN_ORDER flag: a barrier orders the signal after the fill, else
            # the signal may complete first (PROG.rst, Execution Barriers) and the simulator faults
            assert lib.zeCommandListAppendBarrier(cl, ffi.NULL, 0, ffi.NULL) == 0
            assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
        else:
            assert lib.zeCommandListAppendBarrier(cl, ev, 0, ffi.NULL) == 0
    assert lib.zeCommandListClose(cl) == 0
    return cl


def _execute(z, q, *lists):
    arr = ffi.new("ze_command_list_handle_t[]", list(lists))
    return z.lib.zeCommandQueueExecuteCommandLists(q, len(lists), arr, ffi.NULL)


# -- re-execution needs the list's signal events reset ------------------------------------------------

@pytest.mark.parametrize("how", ["fill", "signal", "barrier"])
def test_reexecuting_a_list_whose_signal_event_was_not_reset_is_refused(ze, how):
    """PROG.rst, Submission: "events must be explicitly reset prior to re-execution". The second
    execute is refused and changes nothing; after zeEventHostReset it runs and signals again."""
    z = ze()
    lib = z.lib
    p, q, pool = z.alloc(), z.queue(), z.pool()
    ev = z.event(pool)
    cl = _regular_signalling(z, ev, how, p)
    assert _execute(z, q, cl) == 0
    assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert _execute(z, q, cl) == lib.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
    assert lib.zeEventQueryStatus(ev) == 0          # still the first run's signal; nothing queued
    assert lib.zeEventHostReset(ev) == 0
    assert lib.zeEventQueryStatus(ev) == lib.ZE_RESULT_NOT_READY
    assert _execute(z, q, cl) == 0
    assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    for destroy, h in ((lib.zeCommandListDestroy, cl), (lib.zeCommandQueueDestroy, q), (lib.zeEventDestroy, ev),
                       (lib.zeEventPoolDestroy, pool), (lambda ptr: lib.zeMemFree(z.ctx, ptr), p)):
        assert destroy(h) == 0


def test_a_host_signal_since_the_last_reset_also_needs_a_reset(ze):
    """The event must be reset before the re-execution whatever signalled it last: a host signal
    after the host's reset leaves it signalled, and the re-execution is refused."""
    z = ze()
    lib = z.lib
    p, q, pool = z.alloc(), z.queue(), z.pool()
    ev = z.event(pool)
    cl = _regular_signalling(z, ev, "fill", p)
    assert _execute(z, q, cl) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert lib.zeEventHostReset(ev) == 0
    assert lib.zeEventHostSignal(ev) == 0
    assert _execute(z, q, cl) == lib.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT


def test_a_reset_submitted_on_an_immediate_list_counts(ze):
    """zeCommandListAppendEventReset on an immediate list is submitted at once: the re-execution
    after it (in submission order) is accepted, and its signal is the one the host sees."""
    z = ze()
    lib = z.lib
    p, q, pool = z.alloc(), z.queue(), z.pool()
    ev = z.event(pool)
    imm = z.immediate()
    cl = _regular_signalling(z, ev, "barrier", p)
    for _ in range(3):
        assert _execute(z, q, cl) == 0
        assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == 0
        assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
        assert lib.zeCommandListAppendEventReset(imm, ev) == 0
        assert lib.zeCommandListHostSynchronize(imm, _UINT64_MAX) == 0


def test_a_list_that_resets_its_own_event_first_may_be_reexecuted(ze):
    """A reset earlier in the list itself (or in an earlier list of the same execute call) comes
    before the signal in submission order: accepted."""
    z = ze()
    lib = z.lib
    p, q, pool = z.alloc(), z.queue(), z.pool(count=4)
    ev, ev2 = z.event(pool, 0), z.event(pool, 1)
    cl = z.regular()
    assert lib.zeCommandListAppendEventReset(cl, ev) == 0
    assert z.fill(cl, p, 64, 3, ev) == 0
    assert lib.zeCommandListClose(cl) == 0
    # a second pair: ``resetter`` resets ev2, ``signaller`` signals it
    resetter, signaller = z.regular(), z.regular()
    assert lib.zeCommandListAppendEventReset(resetter, ev2) == 0
    assert lib.zeCommandListAppendSignalEvent(signaller, ev2) == 0
    for c in (resetter, signaller):
        assert lib.zeCommandListClose(c) == 0
    for _ in range(3):
        assert _execute(z, q, cl) == 0
        assert _execute(z, q, resetter, signaller) == 0
        assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
        assert lib.zeEventQueryStatus(ev) == 0 and lib.zeEventQueryStatus(ev2) == 0
    # the signaller alone, its event still signalled: refused
    assert _execute(z, q, signaller) == lib.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
    # and in one call after a list that signals it again (not a reset): refused too
    assert lib.zeEventHostReset(ev2) == 0
    other = z.regular()
    assert lib.zeCommandListAppendSignalEvent(other, ev2) == 0
    assert lib.zeCommandListClose(other) == 0
    assert _execute(z, q, other, signaller) == lib.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT


def test_the_first_execution_may_signal_a_signalled_event(ze):
    """PROG.rst, Events: "Signaling a signaled event ... is valid and has no effect": the first
    execution of a list (after creation, or after zeCommandListReset and new recording) is not a
    re-execution and is accepted with its event still signalled."""
    z = ze()
    lib = z.lib
    p, q, pool = z.alloc(), z.queue(), z.pool()
    ev = z.event(pool)
    assert lib.zeEventHostSignal(ev) == 0
    cl = _regular_signalling(z, ev, "signal", p)
    assert _execute(z, q, cl) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert _execute(z, q, cl) == lib.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
    assert lib.zeCommandListReset(cl) == 0
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    assert lib.zeCommandListClose(cl) == 0
    assert _execute(z, q, cl) == 0                  # new contents: a first execution
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0


def test_a_list_that_signals_nothing_reexecutes_freely(ze):
    z = ze()
    lib = z.lib
    p, q = z.alloc(), z.queue()
    cl = z.regular()
    assert z.fill(cl, p, 64, 9) == 0
    assert lib.zeCommandListClose(cl) == 0
    for _ in range(3):
        assert _execute(z, q, cl) == 0
        assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0


# -- a host synchronize as the device is lost --------------------------------------------------------

def _lose_after_ready(monkeypatch, module):
    """Make ``module``'s initialization check pass, then lose the device: a fault landing right
    after the check, before the call looks at its condition."""
    real = module._ready

    def ready():
        rt, rc = real()
        if not rc:
            rt.lost = "r68h: a command faulted (test)"
        return rt, rc
    monkeypatch.setattr(module, "_ready", ready)


def test_event_host_synchronize_as_the_device_is_lost_is_device_lost(ze, monkeypatch):
    """PROG.rst, Contexts: after a device hang "all APIs will return ZE_RESULT_ERROR_DEVICE_LOST".
    The fast path answered 0 for an unsignalled event (its condition counts a lost device as done)."""
    z = ze()
    lib = z.lib
    pool = z.pool()
    ev = z.event(pool)
    _lose_after_ready(monkeypatch, ze_events)
    assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == lib.ZE_RESULT_ERROR_DEVICE_LOST
    assert lib.zeEventHostSynchronize(ev, 0) == lib.ZE_RESULT_ERROR_DEVICE_LOST


def test_list_and_queue_synchronize_as_the_device_is_lost_is_device_lost(ze, monkeypatch):
    z = ze()
    lib = z.lib
    imm = z.immediate()
    ready = ze_commands._ready
    _lose_after_ready(monkeypatch, ze_commands)
    assert lib.zeCommandListHostSynchronize(imm, _UINT64_MAX) == lib.ZE_RESULT_ERROR_DEVICE_LOST
    monkeypatch.setattr(ze_commands, "_ready", ready)
    sim.reset()
    z = ze()                    # a fresh machine
    q = z.queue()
    _lose_after_ready(monkeypatch, ze_commands)
    assert z.lib.zeCommandQueueSynchronize(q, 0) == z.lib.ZE_RESULT_ERROR_DEVICE_LOST


# -- zeModuleCreate: build flags and specialization constants -----------------------------------------

def _module(z, flags=None, constants=None):
    """zeModuleCreate of a one-kernel SPIR-V module: (result, module or None, build log text)."""
    lib = z.lib
    image = spirv_module("r68h_k")
    data = ffi.new("uint8_t[]", image)
    keep = [data]
    desc = ffi.new("ze_module_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MODULE_DESC,
                                         "format": lib.ZE_MODULE_FORMAT_IL_SPIRV, "inputSize": len(image),
                                         "pInputModule": data})
    if flags is not None:
        keep.append(ffi.new("char[]", flags.encode()))
        desc.pBuildFlags = keep[-1]
    if constants is not None:
        ids = ffi.new("uint32_t[]", [i for i, _ in constants] or [0])
        vals = [ffi.new("uint32_t *", v) for _, v in constants]
        pvals = ffi.new("void *[]", [ffi.cast("void *", v) for v in vals] or [ffi.NULL])
        c = ffi.new("ze_module_constants_t *", {"numConstants": len(constants), "pConstantIds": ids,
                                                "pConstantValues": ffi.cast("void **", pvals)})
        keep += [ids, vals, pvals, c]
        desc.pConstants = c
    mod = ffi.new("ze_module_handle_t *")
    log = ffi.new("ze_module_build_log_handle_t *")
    rc = lib.zeModuleCreate(z.ctx, z.devices[0], desc, mod, log)
    size = ffi.new("size_t *")
    assert lib.zeModuleBuildLogGetString(log[0], size, ffi.NULL) == 0
    buf = ffi.new("char[]", size[0])
    assert lib.zeModuleBuildLogGetString(log[0], size, buf) == 0
    assert lib.zeModuleBuildLogDestroy(log[0]) == 0
    return rc, (mod[0] if rc == 0 else None), ffi.string(buf).decode()


@pytest.mark.parametrize("flags", ["", "-ze-opt-disable", "-ze-opt-level=0", "-ze-opt-level 2", "-g",
                                   "-ze-opt-greater-than-4GB-buffer-required -ze-opt-large-register-file "
                                   "-ze-opt-has-buffer-offset-arg -ze-opt-level=1"])
def test_documented_build_options_build(ze, flags):
    z = ze()
    rc, mod, _log = _module(z, flags)
    assert rc == 0
    assert z.lib.zeModuleDestroy(mod) == 0


@pytest.mark.parametrize("flags, named", [("-cl-fast-relaxed-math", "-cl-fast-relaxed-math"),
                                          ("-ze-opt-disable -O3", "-O3"),
                                          ("-ze-opt-level=3", "levels are 0, 1 and 2"),
                                          ("-ze-opt-level", "needs a level"),
                                          ("-ze-intel-enable-auto-large-GRF-mode", "auto-large-GRF")])
def test_undocumented_build_options_fail_the_build(ze, flags, named):
    """ze_module_desc_t.pBuildFlags: "Following options are supported" (PROG.rst, Module Build
    Options). The simulator ignored the string; any other option is now a build failure whose log
    names it (a driver may take more, or reject them: the documents are silent, so refused)."""
    z = ze()
    rc, mod, log = _module(z, flags)
    assert rc == z.lib.ZE_RESULT_ERROR_MODULE_BUILD_FAILURE and mod is None
    assert named in log
    assert sim.state().ze_live_modules == 0


def test_specialization_constants_are_refused(ze):
    """ze_module_desc_t.pConstants "must be set to nullptr if no specialization constants are
    provided" (INVALID_ARGUMENT); given constants, they would be silently ignored (SpecId is not read):
    not simulated, UNSUPPORTED_FEATURE."""
    z = ze()
    rc, mod, log = _module(z, constants=[])
    assert rc == z.lib.ZE_RESULT_ERROR_INVALID_ARGUMENT and "pConstants" in log
    rc, mod, log = _module(z, constants=[(0, 16)])
    assert rc == z.lib.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE and "specialization constants" in log
    assert sim.state().ze_live_modules == 0


# -- extension structures in a descriptor's pNext chain ----------------------------------------------

def _extension(stype=0x00020001):
    """A stand-in extension structure: stype (ZE_STRUCTURE_TYPE_RELAXED_ALLOCATION_LIMITS_EXP_DESC by
    default), a NULL pNext, then zeros (the generated declarations have no extension types)."""
    raw = ffi.new("uint64_t[4]")
    ffi.cast("uint32_t *", raw)[0] = stype
    return raw


def _create_with_extension(z, what, ext):
    """Call the creator ``what`` with ``ext`` as its descriptor's pNext; its result."""
    lib = z.lib
    pnext = ffi.NULL if ext is None else ffi.cast("void *", ext)
    out = ffi.new("void **")
    if what == "context":
        d = ffi.new("ze_context_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC, "pNext": pnext})
        return lib.zeContextCreate(z.driver, d, ffi.cast("ze_context_handle_t *", out))
    if what == "device memory":
        d = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC,
                                                    "pNext": pnext})
        return lib.zeMemAllocDevice(z.ctx, d, 64, 0, z.devices[0], out)
    if what == "host memory":
        d = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC,
                                                  "pNext": pnext})
        return lib.zeMemAllocHost(z.ctx, d, 64, 0, out)
    if what == "event pool":
        d = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC, "count": 1,
                                              "flags": lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE, "pNext": pnext})
        return lib.zeEventPoolCreate(z.ctx, d, 0, ffi.NULL, ffi.cast("ze_event_pool_handle_t *", out))
    if what == "event":
        d = ffi.new("ze_event_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_DESC, "pNext": pnext})
        return lib.zeEventCreate(z.pool(), d, ffi.cast("ze_event_handle_t *", out))
    if what in ("queue", "immediate list"):
        d = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC, "ordinal": 1,
                                                 "pNext": pnext})
        if what == "queue":
            return lib.zeCommandQueueCreate(z.ctx, z.devices[0], d, ffi.cast("ze_command_queue_handle_t *", out))
        return lib.zeCommandListCreateImmediate(z.ctx, z.devices[0], d, ffi.cast("ze_command_list_handle_t *", out))
    if what == "regular list":
        d = ffi.new("ze_command_list_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC,
                                                "commandQueueGroupOrdinal": 1, "pNext": pnext})
        return lib.zeCommandListCreate(z.ctx, z.devices[0], d, ffi.cast("ze_command_list_handle_t *", out))
    image = spirv_module("r68h_ext")
    data = ffi.new("uint8_t[]", image)
    d = ffi.new("ze_module_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MODULE_DESC, "inputSize": len(image),
                                      "format": lib.ZE_MODULE_FORMAT_IL_SPIRV, "pInputModule": data,
                                      "pNext": pnext if what == "module" else ffi.NULL})
    mod = ffi.new("ze_module_handle_t *")
    rc = lib.zeModuleCreate(z.ctx, z.devices[0], d, mod, ffi.NULL)
    if what == "module":
        return rc
    assert rc == 0
    name = ffi.new("char[]", b"r68h_ext")
    kd = ffi.new("ze_kernel_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_KERNEL_DESC, "pKernelName": name,
                                       "pNext": pnext})
    return lib.zeKernelCreate(mod[0], kd, ffi.cast("ze_kernel_handle_t *", out))


_CREATORS = ["context", "device memory", "host memory", "event pool", "event", "queue", "immediate list",
             "regular list", "module", "kernel"]


@pytest.mark.parametrize("what", _CREATORS)
def test_an_extension_structure_in_pnext_is_refused(ze, what):
    """ze_api.h, every descriptor's pNext: "must be null or a pointer to an extension-specific
    structure". An extension changes what the call does (relaxed allocation limits, external memory,
    counter-based event pools, linked module programs); the simulator simulates none and ignored the
    chain, doing the plain call. Refused now: UNSUPPORTED_FEATURE, nothing created."""
    z = ze()
    before = sim.state()
    ext = _extension()
    assert _create_with_extension(z, what, ext) == z.lib.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    after = sim.state()
    for key in ("ze_live_allocations", "ze_live_events", "ze_live_command_lists", "ze_live_command_queues",
                "ze_live_kernels"):
        assert getattr(after, key) == getattr(before, key), key


@pytest.mark.parametrize("what", _CREATORS)
def test_the_same_creators_without_pnext_succeed(ze, what):
    z = ze()
    assert _create_with_extension(z, what, None) == 0


# -- accel's graph replays reset the list's event before each re-execution -----------------------------

def test_accel_graph_replays_reexecute_with_the_done_event_reset(monkeypatch):
    """accel's graphs are the one regular list it executes more than once: the launching stream
    resets the list's done event after waiting for it, before the next launch (graphs.py). Replays
    on one stream and alternating between two run, and give the captured result each time."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=200)
    be = backends.get("xpu")
    be.init()
    n = 4096
    s1, s2, side = be.stream_create(), be.stream_create(), be.stream_create()
    a, b = be.mem_alloc(n), be.mem_alloc(n)
    be.capture_begin(side, "global")
    be.memcpy_async(b, a, n, side)
    g = be.capture_end(side)
    x = be.graph_instantiate(g)
    for i, s in enumerate((s1, s1, s2, s1, s2, s2)):
        be.memset_async(a, i + 1, n, s)
        be.graph_launch(x, s)
        out = np.zeros(n, np.uint8)
        be.memcpy_async(address_of(out), b, n, s)     # pageable destination: synchronous
        assert (out == i + 1).all()
    be.device_synchronize()
    be.graph_exec_destroy(x)
    be.graph_destroy(g)
    assert sim.state().ze_errors == []


# -- accel: module_load keeps its build-flags string alive through zeModuleCreate -----------------------

class _Watch:
    """``ffi`` and ``lib`` of the XPU backend, watched: every ``char[]`` the backend makes is
    remembered (weakly), and zeModuleCreate notes whether the latest one was still alive when the
    driver got its pointer in ``desc.pBuildFlags``."""

    def __init__(self, ffi_, lib):
        import weakref
        self._ffi, self._lib, self._weakref = ffi_, lib, weakref
        self.strings, self.seen = [], []

    def new(self, ctype, *args):
        obj = self._ffi.new(ctype, *args)
        if ctype == "char[]":
            self.strings.append((self._weakref.ref(obj), int(self._ffi.cast("uintptr_t", obj))))
        return obj

    def zeModuleCreate(self, hContext, hDevice, desc, phModule, phBuildLog):
        flags = int(self._ffi.cast("uintptr_t", desc.pBuildFlags))
        made = [ref for ref, addr in self.strings if addr == flags]
        self.seen.append("NULL" if not flags else "alive" if made and made[-1]() is not None else "freed")
        return self._lib.zeModuleCreate(hContext, hDevice, desc, phModule, phBuildLog)

    def __getattr__(self, name):
        src = self._ffi if hasattr(self._ffi, name) and not hasattr(self._lib, name) else self._lib
        return getattr(src, name)


def test_accel_module_load_keeps_its_build_flags_alive(monkeypatch):
    """cffi frees an owning cdata when its last reference goes; a struct field holding its address is
    no reference. module_load wrote ``desc.pBuildFlags = ffi.new("char[]", b"")``, handing
    zeModuleCreate a freed buffer; once the simulator read the flags (this round) it saw garbage ('@')
    and failed the build (tests/test_xpu_adversarial.py, test_user_programs_xpu_r62m.py,
    test_capture_misuse.py, intermittently). Fixed in accel/backends/xpu/kernels.py (1fd8785, r68g);
    this checks, deterministically, that the string is alive when the driver gets its pointer."""
    import accel
    use_sim(monkeypatch, "xpu")
    be = backends.get("xpu")
    be.init()
    ffi_, lib, path = be._lib
    watch = _Watch(ffi_, lib)
    monkeypatch.setattr(be, "_lib", (watch, watch, path))
    m = accel.Module(spirv_module("r68h_flags"))
    del m
    assert watch.seen and all(s in ("alive", "NULL") for s in watch.seen), watch.seen
