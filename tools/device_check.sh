#!/usr/bin/env bash
# Everything that needs a real accelerator, as one script for a borrowed GPU machine (minutes):
#
#     tools/device_check.sh [OUTDIR]          # default ./device-report
#
# Writes OUTDIR/env.txt (nvidia-smi, python, peers), main.txt (python -m accel), selftest.json and
# selftest.log (python -m accel.selftest: every check in its own process, peers' interop and
# per-call figures included), soak.log (tools/soak.py on the device: state and resources stay
# flat over create/destroy cycles), conformance.json (CUDA: tools/cuda_conformance.py --real: every
# raw runtime call's code, to compare with the simulator; copy it to tests/conformance/),
# pytest.log (the device-marked tests not already run by the self-test), steps.txt (each step's
# exit status and seconds).  Exit status: 0 when each step passed, or when there is no device
# (it says so).  PYTHON picks the interpreter.
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
step selftest 330 "$py" -m accel.selftest --budget 300 --json "$out/selftest.json" > "$out/selftest.log" 2>&1
cat "$out/selftest.log"
step soak 90 env ACCEL_BACKEND="$kind" "$py" tools/soak.py --cycles 20000 --every 2000 > "$out/soak.log" 2>&1
if [ "$kind" = cuda ]; then
    step conformance 300 "$py" tools/cuda_conformance.py --real --json "$out/conformance.json" > /dev/null 2>&1
fi
step pytest 120 "$py" -m pytest -m device -q -p no:cacheprovider tests/test_user_kernels.py tests/test_selftest.py \
    "tests/test_device_real.py::test_multi_device_check_from_the_second_device" > "$out/pytest.log" 2>&1
tail -n 3 "$out/soak.log" "$out/pytest.log"; cat "$out/steps.txt"
exit $status
