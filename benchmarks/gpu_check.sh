#!/usr/bin/env bash
# The GPU check (issue [kernels]): every Pallas kernel compiled for the real backend, checked against
# its reference, and timed (time, TB/s or TFLOP/s, fraction of the H200's peak). No network needed;
# each check is bounded so the whole run stays under 5 minutes. Tables print here and land as JSON
# (with date, device and jax version) in benchmarks/results/. The timeouts bound the worst case;
# the checks take much less when they pass.
#
#     bash benchmarks/gpu_check.sh            # PYTHON=... to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
status=0
# The kernels alone, then the whole model with every kernel against the XLA paths (4 compiles).
for check in kda:100 kda_decode:60 mla:100 moe:100 model:180; do
    name=${check%%:*}
    echo "== gpu_check_$name"
    timeout "${check##*:}" "$PY" -m "benchmarks.gpu_check_$name" || { echo "gpu_check_$name FAILED ($?)"; status=1; }
done
exit $status
