"""Which libcudart to load: every installed candidate, its CUDA version, and the driver's.

The dynamic loader takes the first ``libcudart`` it finds; with the CUDA 13 wheel on
an R535-R570 driver (CUDA 12.x) every runtime call then returns
cudaErrorInsufficientDriver (35).  This module lists every candidate, reads each one's
version without starting CUDA (the library's own ``cudaRuntimeGetVersion``, which
initializes nothing; never its file name, which may lie), reads the CUDA version the
driver supports without starting CUDA (NVML ``nvmlSystemGetCudaDriverVersion_v2``), and
picks one, keeping a verdict per candidate for ``python -m accel``.

What "the driver supports runtime X.Y" means here (REFERENCE.md "Runtime vs driver
versions"; CUDA Compatibility guide, "Minor Version Compatibility"): a runtime runs on
any driver whose CUDA version has the same major or a newer one (12.x needs R525+,
i.e. a driver reporting CUDA >= 12.0; 13.x needs R580+, CUDA >= 13.0).  A driver of an
older major makes every runtime call return 35.  Within a major, a runtime newer than
the driver runs by minor-version compatibility but features newer than the driver
(and PTX newer than it) fail, so a runtime the driver fully supports (X.Y <= the
driver's version) is preferred; among equals the newest wins.

Pure logic plus probes over the loader's search (``accel._ffi.cudart_search``); the
CUDA backend calls :func:`choose`.  The simulator supplies its installed runtimes as candidates.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

#: Driver branch that first supports each CUDA major (CUDA Compatibility guide, table 3).
MIN_DRIVER_BRANCH = {12: "R525", 13: "R580"}
#: What to install for a runtime of each major when the driver is older.
RUNTIME_WHEEL = {12: "nvidia-cuda-runtime-cu12", 13: "nvidia-cuda-runtime"}



def vtext(version: Optional[int]) -> str:
    """12040 -> "12.4" (None -> "unknown")."""
    if version is None:
        return "unknown"
    return f"{version // 1000}.{version % 1000 // 10}"


class Candidate:
    """One libcudart that might be loaded, and what accel made of it.

    ``path`` is what is handed to the loader (a file, or a bare soname), ``source``
    where it came from, ``resolved`` the file it is (None when it did not load),
    ``version`` its CUDA version (``1000 * major + 10 * minor``), ``verdict``
    ``"taken"`` or ``"rejected"`` and ``reason`` why.
    """
    # A plain class, not a dataclass: ``dataclasses`` costs ~15 ms at the first device_count().
    __slots__ = ("path", "source", "resolved", "version", "version_from", "verdict", "reason")

    def __init__(self, path: str, source: str, resolved: Optional[str] = None,
                 version: Optional[int] = None, version_from: str = "", verdict: str = "rejected",
                 reason: str = ""):
        self.path, self.source, self.resolved, self.version = path, source, resolved, version
        self.version_from, self.verdict, self.reason = version_from, verdict, reason

    def __repr__(self):
        return (f"Candidate({self.path!r}, {self.source!r}, version={vtext(self.version)}, "
                f"verdict={self.verdict!r}, reason={self.reason!r})")

    def as_dict(self) -> dict:
        return {"path": self.path, "source": self.source, "file": self.resolved,
                "version": vtext(self.version) if self.version else None, "verdict": self.verdict,
                "reason": self.reason}


class Choice:
    """The outcome: the candidate taken (or None), every candidate with its verdict, the
    driver's CUDA version and where it came from, and ``error``: why the taken library
    cannot run (an explicit ``ACCEL_CUDART_PATH`` too new for the driver) or, with
    nothing taken, why nothing can."""
    __slots__ = ("chosen", "candidates", "driver_version", "driver_note", "explicit", "error")

    def __init__(self, chosen: Optional[Candidate], candidates: List[Candidate],
                 driver_version: Optional[int], driver_note: str, explicit: bool = False,
                 error: Optional[str] = None):
        self.chosen, self.candidates, self.driver_version = chosen, candidates, driver_version
        self.driver_note, self.explicit, self.error = driver_note, explicit, error

    @property
    def usable(self) -> bool:
        return self.chosen is not None and self.error is None

    def as_dict(self) -> dict:
        return {"chosen": self.chosen.path if self.chosen else None,
                "chosen_version": vtext(self.chosen.version) if self.chosen else None,
                "driver_cuda_version": vtext(self.driver_version) if self.driver_version else None,
                "driver_version_from": self.driver_note, "explicit": self.explicit, "error": self.error,
                "candidates": [c.as_dict() for c in self.candidates]}


def supports(driver_version: int, runtime_version: int) -> bool:
    """True when a driver supporting CUDA ``driver_version`` runs runtime ``runtime_version``:
    the driver's major is at least the runtime's (minor-version compatibility within a
    major, backward compatibility across majors)."""
    return driver_version // 1000 >= runtime_version // 1000


def _install_hint(runtime_version: int, driver_version: int) -> str:
    major, dmajor = runtime_version // 1000, driver_version // 1000
    hints = []
    if dmajor in RUNTIME_WHEEL:
        hints.append(f"pip install {RUNTIME_WHEEL[dmajor]} (a CUDA {dmajor} runtime this driver runs; "
                     f"ACCEL_CUDART_PATH can point at its lib/)")
    hints.append(f"install a driver >= {MIN_DRIVER_BRANCH.get(major, 'supporting CUDA %d' % major)} "
                 f"(CUDA {major}.x)")
    return " or ".join(hints)


def too_new_message(c: Candidate, driver_version: int) -> str:
    return (f"libcudart {vtext(c.version)} ({c.resolved or c.path}) needs a driver supporting CUDA "
            f"{c.version // 1000}.0 or newer; the driver supports CUDA {vtext(driver_version)}: "
            f"{_install_hint(c.version, driver_version)}")


def insufficient_driver_message(runtime_version: int, driver_version: int) -> str:
    """Why a runtime answered cudaErrorInsufficientDriver (35), from its own version and the
    driver's (``cudaDriverGetVersion``, which starts nothing and gives 0 without a driver)."""
    major = runtime_version // 1000
    if driver_version <= 0:
        return (f"no NVIDIA driver is installed (cudaDriverGetVersion reports none); libcudart "
                f"{vtext(runtime_version)} needs one >= {MIN_DRIVER_BRANCH.get(major, 'supporting CUDA %d' % major)}")
    if supports(driver_version, runtime_version):
        # (r69g: it read "needs a driver supporting CUDA 12.0 or newer; the driver supports CUDA
        # 12.2"; r69i: nor is "update the driver" right for a driver past the branch minimum)
        return (f"libcudart {vtext(runtime_version)} refused the driver, though the driver supports CUDA "
                f"{vtext(driver_version)}, which runs CUDA {major}.x runtimes: unexpected.  Most likely the "
                f"libcuda loaded does not match the kernel driver (a CUDA compat package, or a container's "
                f"libcuda from another driver version; compare nvidia-smi's driver version with libcuda's), "
                f"or the driver is older than branch "
                f"{MIN_DRIVER_BRANCH.get(major, 'supporting CUDA %d' % major)}, the oldest CUDA {major}.x runs on")
    return (f"libcudart {vtext(runtime_version)} needs a driver supporting CUDA {major}.0 or newer; the driver "
            f"supports CUDA {vtext(driver_version)}: {_install_hint(runtime_version, driver_version)}")


def choose(cands: Sequence[Candidate], driver_version: Optional[int], driver_note: str,
           majors: Sequence[int], explicit: bool = False) -> Choice:
    """Pick among probed candidates (``version`` set where they loaded).  Sets every
    candidate's verdict; returns the :class:`Choice`."""
    cands = list(cands)
    for c in cands:
        c.verdict = "rejected"
    loaded = [c for c in cands if c.version]

    def rank(c):
        # a runtime the driver fully supports first (<= its version), then the newest
        full = driver_version is None or c.version <= driver_version
        return (full, c.version)

    if explicit:
        # ACCEL_CUDART_PATH is honoured: it is the only candidate and it is taken when it
        # loads; a runtime the driver cannot run is an error at first runtime use.  A lib/
        # directory holding several majors gives one candidate each: the one the driver runs
        # is taken, as below (r70l: .13 was always taken, also on a 12 driver).
        c = cands[0]
        if len(cands) > 1:
            usable = [x for x in loaded if x.version // 1000 in majors]
            runs = [x for x in usable if driver_version is None or supports(driver_version, x.version)]
            if runs or usable:
                c = max(runs or usable, key=rank)
            for x in cands:
                if x is not c and not x.reason:
                    x.reason = f"{c.resolved or c.path}, in the same ACCEL_CUDART_PATH directory, was taken"
        if not c.version:
            env = os.environ.get("ACCEL_CUDART_PATH", "")
            if env and os.path.isdir(env) and not os.path.lexists(c.path):  # the loader looked inside it
                return Choice(None, cands, driver_version, driver_note, True,
                              f"ACCEL_CUDART_PATH={env!r} is a directory with no libcudart.so.13 or "
                              f"libcudart.so.12 in it: point it at the libcudart file, or at the lib/ "
                              f"directory that holds it")
            return Choice(None, cands, driver_version, driver_note, True,
                          f"ACCEL_CUDART_PATH={c.path!r} cannot be used: {c.reason}")
        if c.version // 1000 not in majors:
            c.reason = _no_bindings(c.version, majors)
            return Choice(None, cands, driver_version, driver_note, True,
                          f"ACCEL_CUDART_PATH={c.path!r}: {c.reason}")
        c.verdict = "taken"
        error = None
        if driver_version is not None and not supports(driver_version, c.version):
            error = too_new_message(c, driver_version)
            c.reason = f"set by ACCEL_CUDART_PATH, but {error}"
        else:
            c.reason = "set by ACCEL_CUDART_PATH" + (f" ({driver_note})" if driver_version is None else "")
        return Choice(c, cands, driver_version, driver_note, True, error)

    eligible = []
    for c in loaded:
        if c.version // 1000 not in majors:
            c.reason = _no_bindings(c.version, majors)
        elif driver_version is not None and not supports(driver_version, c.version):
            c.reason = too_new_message(c, driver_version)
        else:
            eligible.append(c)
    if not eligible:
        too_new = [c for c in loaded if c.version // 1000 in majors]
        # (r70l: the too-new message left out a broken runtime of the driver's own major, and told
        # the user to install what was installed; "no libcudart found" gave no fix)
        # (r82c: dedupe()'s "same file as" entries were listed as broken runtimes too)
        broken = [c for c in cands if not c.version and c.reason not in ("", "not found", "no such file")
                  and not c.reason.startswith("same file as ")]
        also = ("; also tried: " + "; ".join(f"{c.resolved or c.path}: {c.reason}" for c in broken)
                if broken else "")
        if too_new:
            error = "no libcudart the driver can run: " + "; ".join(c.reason for c in too_new) + also
        elif loaded:
            error = "no libcudart accel has bindings for: " + "; ".join(
                f"{c.resolved or c.path}: {c.reason}" for c in loaded) + also
        else:
            error = ("no libcudart found: " + "; ".join(f"{c.path}: {c.reason}" for c in cands)
                     + ".  Install one (pip install nvidia-cuda-runtime for CUDA 13, or "
                       "nvidia-cuda-runtime-cu12 for CUDA 12), or set ACCEL_CUDART_PATH to a libcudart file "
                       "or the lib/ directory that holds one")
        return Choice(None, cands, driver_version, driver_note, False, error)

    best = max(eligible, key=rank)   # max() keeps the first of equals: the search order decides
    best.verdict = "taken"
    if driver_version is None:
        best.reason = f"newest runtime with bindings ({driver_note})"
    elif best.version <= driver_version:
        best.reason = f"newest runtime the driver (CUDA {vtext(driver_version)}) supports"
    else:
        best.reason = (f"runs on the driver's CUDA {vtext(driver_version)} by minor-version compatibility "
                       f"(no installed runtime <= {vtext(driver_version)})")
    for c in eligible:
        if c is best:
            continue
        if c.version == best.version:
            c.reason = f"same CUDA {vtext(c.version)} as {best.resolved or best.path}, found earlier"
        elif c.version < best.version:
            c.reason = f"{vtext(c.version)} < {vtext(best.version)}: the newer one is preferred"
        else:
            c.reason = (f"{vtext(c.version)} is newer than the driver's CUDA {vtext(driver_version)} "
                        f"(it would run only by minor-version compatibility); {vtext(best.version)}, "
                        f"which the driver fully supports, is preferred")
    return Choice(best, cands, driver_version, driver_note, False, None)


def _no_bindings(version: int, majors: Sequence[int]) -> str:
    return (f"no bindings for CUDA major {version // 1000} (accel has "
            f"{', '.join(str(m) for m in majors)})")


# -- the real candidates -----------------------------------------------------------

def _pathfinder_path() -> Optional[str]:
    """Where cuda.pathfinder (NVIDIA's library finder, optional) finds libcudart, if installed.
    Its public API finds by loading (load_nvidia_dynamic_lib -> LoadedDL.abs_path); loading a
    libcudart starts nothing."""
    try:
        from cuda import pathfinder  # type: ignore
    except Exception:
        return None
    try:
        return pathfinder.load_nvidia_dynamic_lib("cudart").abs_path
    except Exception:
        return None


def real_candidates() -> Tuple[List[Candidate], bool]:
    """The candidate libcudart files in search order (the loader's ``cudart_search``, then
    ``cuda.pathfinder``'s find when it is installed), and whether ACCEL_CUDART_PATH chose one.
    Not probed yet (no version)."""
    from ..._ffi import cudart_search
    found, explicit = cudart_search()
    out = [Candidate(path, source) for path, source in found]
    if not explicit:
        extra = _pathfinder_path()
        if extra and all(os.path.normpath(extra) != os.path.normpath(c.path) for c in out if os.sep in c.path):
            out.append(Candidate(extra, "cuda.pathfinder"))
    return out, explicit


def _resolved(path: str, lib) -> str:
    """The real file a path or bare soname loaded as ``lib`` (links followed)."""
    from ..._ffi import _cudart, _resolved as loaded
    found = loaded(path, _cudart.ffi, lib, "cudart")
    return os.path.realpath(found) if os.sep in found else found


_probe_lock = threading.Lock()
_probed: Dict[str, Tuple[Optional[str], Optional[int], str, str]] = {}


def _fresh_probe_lock() -> None:
    # a child forked while another thread of the parent probed (the first call) gets a free lock
    global _probe_lock
    _probe_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_probe_lock)


def probe(c: Candidate) -> Candidate:
    """Fill ``resolved``/``version`` (or ``reason`` when it does not load).  Cached per path."""
    with _probe_lock:
        got = _probed.get(c.path)
        if got is None:
            got = _probed[c.path] = _probe(c.path)
    c.resolved, c.version, c.version_from, c.reason = got
    return c


def _probe(path: str):
    if os.sep in path and not os.path.exists(path):
        if os.path.islink(path):
            return None, None, "", "a symbolic link that leads to no file (dangling, or a loop)"
        return None, None, "", "no such file"
    from ..._ffi import _cudart, loader_file_problem   # cudaRuntimeGetVersion: one signature in every major
    problem = loader_file_problem(path)     # a bare soname: the file the loader would take (r71b)
    if problem:
        return None, None, "", f"does not load: {problem}"
    try:
        lib = _cudart.ffi.dlopen(path)
    except OSError as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, None, "", ("not found" if "cannot open shared object" in text and os.sep not in path
                                else f"does not load: {text}")
    resolved = _resolved(path, lib)
    # The library's own answer, never its file name's (r70l: another library named
    # libcudart.so.12.4.127 was taken as CUDA 12.4, and a 12.4 runtime named libcudart.so.13.0.96
    # was opened with the 13 bindings, whose structures differ)
    try:
        v = _cudart.ffi.new("int *")
        rc = lib.cudaRuntimeGetVersion(v)   # initializes nothing
    except (AttributeError, _cudart.ffi.error):
        return resolved, None, "", "not a libcudart (no cudaRuntimeGetVersion)"
    if rc != 0 or v[0] <= 0:
        return resolved, None, "", f"cudaRuntimeGetVersion returned {rc}"
    return resolved, v[0] // 10 * 10, "cudaRuntimeGetVersion", ""


def dedupe(cands: List[Candidate]) -> None:
    """A file reached by several candidates (a soname and its directory) keeps its first
    entry; the others are rejected as duplicates."""
    first: Dict[str, Candidate] = {}
    for c in cands:
        if c.version and c.resolved:
            if c.resolved in first:
                c.reason = f"same file as {first[c.resolved].path}"
                c.version = None
            else:
                first[c.resolved] = c


#: NVML_ERROR_LIBRARY_NOT_FOUND.  nvml.h, nvmlSystemGetCudaDriverVersion_v2: "Returns
#: NVML_ERROR_LIBRARY_NOT_FOUND if libcuda.so.1 or libcuda.dll is not found".
NVML_LIBRARY_NOT_FOUND = 12
#: The note a choice's driver_note starts with when NVML runs but libcuda.so.1 is absent.
NO_LIBCUDA = "libcuda.so.1 not found"


def driver_version_from_nvml(ffi, lib) -> Tuple[Optional[int], str]:
    """The CUDA version an initialized NVML says the driver supports (starts no CUDA)."""
    from ..._ffi import has_symbol
    if not has_symbol(lib, "nvmlSystemGetCudaDriverVersion_v2"):
        # (r82c: it raised ffi.error out of count() and report(); in NVML since CUDA 10.1)
        return None, "driver version unknown: this NVML has no nvmlSystemGetCudaDriverVersion_v2"
    v = ffi.new("int *")
    rc = lib.nvmlSystemGetCudaDriverVersion_v2(v)
    if rc == NVML_LIBRARY_NOT_FOUND:
        # The kernel driver runs (nvmlInit_v2 succeeded) but its CUDA library is not visible: a
        # container given NVIDIA_DRIVER_CAPABILITIES=utility without compute (r82c: reported as
        # "no NVIDIA driver is installed")
        return None, (f"{NO_LIBCUDA}: NVML runs (the NVIDIA driver is loaded) but "
                      f"nvmlSystemGetCudaDriverVersion_v2 returned NVML_ERROR_LIBRARY_NOT_FOUND ({rc}); "
                      f"make the driver's libcuda.so.1 visible (in a container: NVIDIA_DRIVER_CAPABILITIES "
                      f"must include compute)")
    if rc != 0 or v[0] <= 0:
        return None, f"driver version unknown: nvmlSystemGetCudaDriverVersion_v2 returned {rc}"
    return v[0], "NVML nvmlSystemGetCudaDriverVersion_v2"


def driver_version_note(version: int, source: str, nvml_note: str) -> Tuple[Optional[int], str]:
    """``cudaDriverGetVersion``'s answer ``version`` (0: no driver), read from ``source``, as the
    (driver version, note) a choice records; ``nvml_note`` says why NVML gave none."""
    if version <= 0:
        return None, f"no NVIDIA driver: cudaDriverGetVersion of {source} reports none ({nvml_note})"
    return version, f"cudaDriverGetVersion of {source} ({nvml_note})"


def driver_version_from_runtime(cands: Sequence[Candidate], nvml_note: str) -> Tuple[Optional[int], str]:
    """The driver's CUDA version from the first loadable candidate's ``cudaDriverGetVersion``
    (it starts nothing and answers 0 without a driver), for when NVML cannot say: a container
    given the compute capability only has libcuda but no NVML (r69g: accel then took the newest
    runtime, one the driver could not run)."""
    from ..._ffi import _cudart   # cudaDriverGetVersion: one signature in every major
    for c in cands:
        if not c.version:
            continue
        try:
            lib = _cudart.ffi.dlopen(c.resolved or c.path)
            v = _cudart.ffi.new("int *")
            rc = lib.cudaDriverGetVersion(v)
        except (OSError, AttributeError, _cudart.ffi.error):
            continue
        if rc == 0:
            return driver_version_note(v[0], c.resolved or c.path, nvml_note)
    return None, f"driver version unknown: {nvml_note}, and no runtime answered cudaDriverGetVersion"


def choose_real(driver_version: Optional[int], driver_note: str) -> Choice:
    """Enumerate, probe and choose among the real libcudart files."""
    from ..._ffi import CUDART_MAJORS
    cands, explicit = real_candidates()
    for c in cands:
        probe(c)
    if not explicit:
        dedupe(cands)
    nvml_note = driver_note
    if driver_version is None:
        driver_version, driver_note = driver_version_from_runtime(cands, driver_note)
    choice = choose(cands, driver_version, driver_note, CUDART_MAJORS, explicit)
    if driver_version is None and nvml_note.startswith(NO_LIBCUDA) and choice.chosen is not None:
        # NVML sees the driver but no runtime reaches libcuda: every runtime call would answer
        # cudaErrorInsufficientDriver, so none can run (r82c: counted as available)
        choice.error = f"libcudart {vtext(choice.chosen.version)} cannot run: {nvml_note}"
    return choice


def read_driver_version() -> Tuple[Optional[int], str]:
    """The driver's CUDA version from NVML, opening and initializing it for this call only."""
    from ..._ffi import open_library
    try:
        ffi, lib, _path = open_library("nvml")
    except OSError:
        return None, "driver version unknown: NVML missing"
    rc = lib.nvmlInit_v2()
    if rc != 0:
        return None, f"driver version unknown: nvmlInit_v2 returned {rc}"
    try:
        return driver_version_from_nvml(ffi, lib)
    finally:
        lib.nvmlShutdown()
