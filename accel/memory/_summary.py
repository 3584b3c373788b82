"""``memory_summary()``: the text table of ``torch.cuda.memory_summary``.

Labels, column widths and the 75-column rule are torch 2.13's (``torch/cuda/memory.py``),
so a log scraper written for torch's table reads accel's.  The title says ``accel`` where
torch's says ``PyTorch`` (padded to the same width), and the retry counter is named after
the backend's allocation call (``cudaMalloc retries`` as torch's on CUDA).
"""

from __future__ import annotations

_SIZE_METRICS = (
    ("allocated_bytes", "Allocated memory"),
    ("active_bytes", "Active memory"),
    ("requested_bytes", "Requested memory"),
    ("reserved_bytes", "GPU reserved memory"),
    ("inactive_split_bytes", "Non-releasable memory"),
)
_COUNT_METRICS = (
    ("allocation", "Allocations"),
    ("active", "Active allocs"),
    ("segment", "GPU reserved segments"),
    ("inactive_split", "Non-releasable allocs"),
)
_OVERSIZE = (("oversize_allocations", "Oversize allocations"),
             ("oversize_segments", "Oversize GPU segments"))
_WIDTH = 75
#: the runtime call a "retry" repeats (torch's line says "cudaMalloc retries")
_ALLOC_CALL = {"cuda": "cudaMalloc", "xpu": "zeMemAllocDevice", "mps": "newBuffer"}


def _format_size(size: int, pref: float) -> str:
    # torch picks the unit from the row's first column so a row shares one unit.
    prefix = "B  "
    for new_prefix in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if pref < 768 * 1024:
            break
        prefix = new_prefix
        size //= 1024
        pref /= 1024
    return f"{size:6d} {prefix}"


def _format_count(count: int, pref: float) -> str:
    prefix = " "
    for new_prefix in ("K", "M"):
        if pref < 750 * 1000:
            break
        prefix = new_prefix
        count //= 1000
        pref /= 1000
    return f"{count:7d} {prefix} "


def summary(stats, device: int, backend_name: str, abbreviated: bool = False) -> str:
    """Render ``stats`` (the flat memory_stats keys) as torch's summary table."""
    name = backend_name.upper()
    rule, double = "-" * _WIDTH, "=" * _WIDTH
    # torch: " {_:16} PyTorch CUDA memory summary, device ID {device:<17d} "
    title = f" {'':16} accel {name} memory summary, device ID {device:<17d} "
    # torch: "  {_:9} CUDA OOMs: {num_ooms:<12d} | {_:6} cudaMalloc retries: {num_alloc_retries:<8d}  "
    call = _ALLOC_CALL.get(backend_name, "device alloc")
    ooms = f"  {'':9} {name} OOMs: {stats.get('num_ooms', 0):<12d}"
    retries = f" {call} retries: {stats.get('num_alloc_retries', 0):<8d}  "
    pad = _WIDTH - len(ooms) - 3 - len(retries)
    if pad < 0:                     # a longer call name takes the padding, then the OOM field's
        ooms = ooms.rstrip().ljust(max(len(ooms) + pad, len(ooms.rstrip()) + 1))
        pad = max(_WIDTH - len(ooms) - 3 - len(retries), 0)
    lines = [double, title.ljust(_WIDTH), rule, f"{ooms} | {' ' * pad}{retries}".ljust(_WIDTH), double,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]

    def row(label, prefix, fmt, pref):
        values = [stats.get(prefix + field, 0) for field in ("current", "peak", "allocated", "freed")]
        prefs = pref or values
        cells = " | ".join(fmt(v, p) for v, p in zip(values, prefs))
        lines.append(f" {label:<21} | {cells} ")
        return values

    for metrics, fmt in ((_SIZE_METRICS, _format_size), (_COUNT_METRICS, _format_count)):
        for key, label in metrics:
            lines.append(rule)
            pref = row(label, f"{key}.all.", fmt, None)
            if not abbreviated:
                row("      from large pool", f"{key}.large_pool.", fmt, pref)
                row("      from small pool", f"{key}.small_pool.", fmt, pref)
    for key, label in _OVERSIZE:
        lines.append(rule)
        row(label, f"{key}.", _format_count, None)
    lines.append(double)
    return "|" + "|\n|".join(lines) + "|\n"
