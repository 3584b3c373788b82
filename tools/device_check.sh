#!/usr/bin/env bash
# Everything that needs a real accelerator, as one script for a borrowed GPU machine (minutes):
#
#     tools/device_check.sh [OUTDIR]          # default ./device-report
#
# Writes OUTDIR/env.txt (nvidia-smi, python, peers), main.txt (python -m accel), selftest.json and
# selftest.log (python -m accel.selftest: every check in its own process, peers' interop and
# per-call figures included), soak.log (tools/soak.py on the device: state and resources stay
# flat over create/destroy cycles; CUDA: soak_raw.log, the same cycle in raw libcudart calls,
# soak_raw_vmm.log, with the driver's virtual-memory calls, soak_classic.log, the soak with
# classic segments, and soak_profile.log, the soak's top functions in its first and last blocks),
# conformance.json (CUDA: tools/cuda_conformance.py --real: every raw runtime call's code, to
# compare with the simulator; copy it to tests/conformance/), pytest.log (the device-marked
# tests not already run by the self-test), profile.csv and philox_sm90.sass (CUDA, where ncu is
# installed: the Philox fills' counters and machine code), steps.txt (each step's exit status
# and seconds).  That is more than a lent machine hands back file by file: tar OUTDIR there.
# Exit status: 0 when each step passed, or when there is no device (it says so).  PYTHON picks
# the interpreter.  On 2026-12-05 the whole script took 100 s on an H100.
set -u
out=${1:-device-report}
mkdir -p "$out"
: > "$out/steps.txt"
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
unset ACCEL_SIM
status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, say how it ended
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    timeout "$limit" "$@"
    rc=$?
    echo "device_check: $name rc=$rc in $((SECONDS - t0)) s" >> "$out/steps.txt"
    [ "$rc" -eq 0 ] || status=1
}
{
    date -u; uname -a; nvidia-smi 2>&1 | head -20
    "$py" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "cffi", "torch", "cupy", "cuda.core", "cuda.bindings"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "not importable:", type(exc).__name__, exc)
EOF
} > "$out/env.txt" 2>&1
step main 60 "$py" -m accel > "$out/main.txt" 2>&1
kind=$("$py" -c "import accel; print(accel.current_accelerator().type if accel.is_available() else '')" 2>/dev/null)
if [ -z "$kind" ]; then
    echo "device_check: no accelerator device here (python -m accel says why: $out/main.txt); nothing else to run"
    exit 0
fi
# Most telling first, so that a lease that ends early still brings back the conformance run.
if [ "$kind" = cuda ]; then
    step conformance 200 "$py" tools/cuda_conformance.py --real --jobs 8 --timeout 45 \
        --json "$out/conformance.json" > /dev/null 2>&1
fi
step selftest 150 "$py" -m accel.selftest --budget 120 --json "$out/selftest.json" > "$out/selftest.log" 2>&1
cat "$out/selftest.log"
step pytest 100 "$py" -m pytest -m device -q -p no:cacheprovider tests/test_user_kernels.py tests/test_selftest.py \
    "tests/test_device_real.py::test_multi_device_check_from_the_second_device" > "$out/pytest.log" 2>&1
if [ "$kind" = cuda ] && command -v ncu > /dev/null; then
    # Where the Philox fills spend their time: the uniform float32 fill ran at 0.43 of the raw
    # one on 2026-12-04 with the same grid and stores.  Counters of both, and their machine code.
    step profile 90 ncu --clock-control none --csv --page raw -k "regex:accel_philox_(raw_u32|uniform_f32)" \
        --metrics gpu__time_duration.sum,dram__bytes_write.sum,dram__bytes_read.sum,lts__t_sectors_op_write.sum,smsp__inst_executed.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        "$py" -c "import accel, accel.random as R; a = accel.Buffer(1 << 28); R.random_raw_(a); R.uniform_(a); accel.synchronize()" \
        > "$out/profile.csv" 2>&1
    cuobjdump -sass -arch sm_90 accel/random/kernels/philox.fatbin > "$out/philox_sm90.sass" 2>&1
fi
step soak 60 env ACCEL_BACKEND="$kind" "$py" tools/soak.py --cycles 20000 --every 2000 > "$out/soak.log" 2>&1
if [ "$kind" = cuda ]; then
    # The H100's soak slowed 1.57x over 10,000 cycles (2026-12-05) with every count flat: the same
    # cycle in raw libcudart calls says whether the driver slows, the profiled soak where accel does.
    step soak_raw 60 "$py" tools/soak_raw.py --cycles 30000 --every 3000 > "$out/soak_raw.log" 2>&1
    # Each soak cycle's fresh stream reserves an address range of the device's memory and maps a
    # page for its first Buffer (expandable segments), unmapped and freed once the stream is gone:
    # the raw cycle with those driver calls, and the soak with classic segments, say whether that
    # churn is what slows.
    step soak_raw_vmm 60 "$py" tools/soak_raw.py --cycles 10000 --every 2000 --variant vmm \
        > "$out/soak_raw_vmm.log" 2>&1
    step soak_classic 60 env ACCEL_BACKEND="$kind" ACCEL_ALLOC_CONF=expandable_segments:False \
        "$py" tools/soak.py --cycles 10000 --every 2000 > "$out/soak_classic.log" 2>&1
    step soak_profile 60 env ACCEL_BACKEND="$kind" "$py" tools/soak.py --cycles 10000 --every 2000 --profile \
        > "$out/soak_profile.log" 2>&1
fi
tail -n 3 "$out/soak.log" "$out/pytest.log"; cat "$out/steps.txt"
exit $status
