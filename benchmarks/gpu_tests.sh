#!/usr/bin/env bash
# The GPU test matrix on the device machine (CI has no GPU; see benchmarks/results/README.md).
#   bash benchmarks/gpu_tests.sh [test files and pytest args]      (wheels in .whl/, carried)
# Without test files it runs the backend matrix, tests/test_backends_gpu.py; with some, only
# those (the matrix alone takes most of a call: benchmarks/results/gpu_matrix/README.md).
# Installs the carried wheels into /tmp/site, links src/ as the hedgecats package and runs the
# gpu-marked tests in parallel workers (first Triton / inductor compilation is CPU-bound), writing
# the log to $OUT/gpu_tests.log, each case's errors to gpu_tests.md, the rows to gpu_tests.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD/src" /tmp/pkg/hedgecats
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu_tests.log"
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" | tee -a "$OUT/gpu_tests.log"
export HEDGECATS_GPU_REPORT=/tmp/gpu_report
targets=("$@")
[[ " $* " == *" tests/"* ]] || targets=(tests/test_backends_gpu.py "$@")
timeout "${GPU_TESTS_TIMEOUT:-520}" python3 -m pytest -p no:cacheprovider -m gpu -v -rfEs \
  --tb=short --log-level=WARNING -n "${GPU_TESTS_WORKERS:-6}" "${targets[@]}" 2>&1 | tee -a "$OUT/gpu_tests.log"
rc=$?
python3 benchmarks/gpu_tests_report.py /tmp/gpu_report > "$OUT/gpu_tests.md"
cat /tmp/gpu_report/*.jsonl > "$OUT/gpu_tests.jsonl" 2>/dev/null  # the rows, to re-render here
ls -la "$OUT"
exit $rc
