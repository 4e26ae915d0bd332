#!/usr/bin/env bash
# The GPU check (issue [kernels]): every Pallas kernel compiled for the real backend, checked against
# its reference, and timed (time, TB/s or TFLOP/s, fraction of the H200's peak). No network needed;
# each check is bounded so the whole run stays under 5 minutes. Tables print here and land as JSON
# (with date, device and jax version) in benchmarks/results/.
#
#     bash benchmarks/gpu_check.sh            # PYTHON=... to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
status=0
for check in kda kda_decode mla moe; do
    echo "== gpu_check_$check"
    timeout 110 "$PY" -m "benchmarks.gpu_check_$check" || { echo "gpu_check_$check FAILED ($?)"; status=1; }
done
exit $status
