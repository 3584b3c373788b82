#!/usr/bin/env python3
"""The soak's cycle in raw libcudart calls, with no accel layer: is a slowdown the driver's?

    python tools/soak_raw.py --cycles 30000 --every 2000          # on a GPU
    ACCEL_SIM=cuda python tools/soak_raw.py --cycles 10000         # the simulator (dry run)

One cycle: cudaStreamCreateWithFlags(non-blocking), cudaMemsetAsync of a buffer allocated once,
cudaEventCreateWithFlags(disable timing), cudaEventRecord, cudaStreamWaitEvent of the legacy
default stream on it (as tools/soak.py's ``default_stream(d).wait_event(e)``), cudaEventDestroy,
cudaStreamDestroy.  ``--variant no-default-wait`` leaves out the wait, ``--variant sync-every``
also synchronizes the device at each report, ``--variant vmm`` adds what accel's expandable
segments do for a fresh stream's first allocation and after the stream is gone: reserve an address
range of the device's total memory, create one granule of physical memory, map it, grant access,
fill it instead of the buffer, then unmap, release and free the range (through accel's backend:
thin wrappers of the driver entry points).  Each report line gives the time of that block;
the summary compares the last block with the first, as tools/soak.py does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def open_cudart():
    if os.environ.get("ACCEL_SIM"):
        from accel import sim
        from accel.backends.cuda.runtime import _cudart_ffi_for
        lib = sim.open_library("cudart")
        return _cudart_ffi_for(lib), lib
    from accel._ffi import open_library
    ffi, lib, _ = open_library("cudart")
    return ffi, lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=30000)
    ap.add_argument("--every", type=int, default=2000)
    ap.add_argument("--variant", choices=("soak", "no-default-wait", "sync-every", "vmm"), default="soak")
    args = ap.parse_args(argv)
    ffi, lib = open_cudart()

    def ok(rc, what):
        if rc:
            raise SystemExit(f"soak_raw: {what} returned {rc}")

    p = ffi.new("void **")
    ok(lib.cudaMalloc(p, 4096), "cudaMalloc")
    buf = p[0]
    sp, ep = ffi.new("cudaStream_t *"), ffi.new("cudaEvent_t *")
    legacy = ffi.cast("cudaStream_t", 1)     # cudaStreamLegacy
    vmm = None
    if args.variant == "vmm":
        from accel import _lazy
        be = _lazy.lazy_init()
        gran = be.vmm_granularity(0)
        total = -(-be.mem_info()[1] // gran) * gran
        vmm = (be, gran, total)
    blocks = []
    t0 = time.perf_counter()
    for i in range(1, args.cycles + 1):
        ok(lib.cudaStreamCreateWithFlags(sp, 1), "cudaStreamCreateWithFlags")
        s = sp[0]
        target = buf
        if vmm is not None:
            be, gran, total = vmm
            va = be.vmm_reserve(0, total)
            handle = be.vmm_create(0, gran)
            be.vmm_map(va, gran, handle, 0)
            be.vmm_set_access(va, gran, 0)
            target = ffi.cast("void *", va)
        ok(lib.cudaMemsetAsync(target, i & 255, 1024 + 512 * (i % 5), s), "cudaMemsetAsync")
        ok(lib.cudaEventCreateWithFlags(ep, 2), "cudaEventCreateWithFlags")
        e = ep[0]
        ok(lib.cudaEventRecord(e, s), "cudaEventRecord")
        if args.variant != "no-default-wait":
            ok(lib.cudaStreamWaitEvent(legacy, e, 0), "cudaStreamWaitEvent")
        ok(lib.cudaEventDestroy(e), "cudaEventDestroy")
        ok(lib.cudaStreamDestroy(s), "cudaStreamDestroy")
        if vmm is not None:
            ok(lib.cudaStreamSynchronize(legacy), "cudaStreamSynchronize")    # unmap waits for no work
            be.vmm_unmap(va, gran)
            be.vmm_release(handle)
            be.vmm_free(va, total)
        if i % args.every == 0:
            if args.variant == "sync-every":
                ok(lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            t1 = time.perf_counter()
            blocks.append((t1 - t0) * 1e3)
            print(f"{i:8d} cycles {blocks[-1]:9.1f} ms/{args.every}", flush=True)
            t0 = time.perf_counter()
    ok(lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    ok(lib.cudaFree(buf), "cudaFree")
    if blocks:
        print(f"soak_raw ({args.variant}): first block {blocks[0]:.1f} ms, last {blocks[-1]:.1f} ms "
              f"(ratio {blocks[-1] / blocks[0]:.2f}), fastest {min(blocks):.1f}, slowest {max(blocks):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
