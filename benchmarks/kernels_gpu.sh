#!/usr/bin/env bash
# The fused Triton kernels on the GPU machine, in one call (issues 11 and 12):
#   1. tests/test_triton_kernels.py and tests/test_stage1_overlap_gpu.py (gpu-marked): every
#      case's errors against the references, stage 1's side-stream students against in order
#   2. benchmarks/attention_speed.py --tune: one layer, all baselines, T = 1k .. 128k
#   3. benchmarks/stage_speed.py --profile: stage throughput on the 8B shape, T = 1k and 4k
# Each step has its own time limit and the next one runs whatever the last one did; the
# benchmarks write their JSON after every row / shape, so a cut-short step keeps what it had.
#
#   bash benchmarks/kernels_gpu.sh            (wheels in .whl/ are installed first if present)
#
# Writes to $OUT (8 files): kernels_gpu.log (everything printed), kernel_tests.md (one row per
# test case: errors against the reference), kernel_tests.jsonl (the same, raw),
# attention_speed.{json,md}, stage_speed.{json,md}, summary.json.
# Limits (seconds, env): TESTS_TIMEOUT 170, ATTN_TIMEOUT 180, STAGES_TIMEOUT 160; WORKERS 8
# (worst case with the kill grace periods: 580 s, under the 600 s a GPU call may take).
# SKIP_TESTS=1 / SKIP_ATTN=1 / SKIP_STAGES=1 leave a step out; ATTN_TUNE=0 leaves out the tile
# sweep (its compilations took the whole step on 2026-12-02); ATTN_ARGS / STAGE_ARGS are passed on.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/kernels_gpu.log"
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD/src" /tmp/pkg/hedgecats
export PYTHONPATH=/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
export HEDGECATS_TRITON=${HEDGECATS_TRITON:-1}  # auto takes the fused kernel (the default; 0 turns it off)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
  --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for m in ("triton", "fla", "transformers", "peft", "xdist"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "present"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__)
from hedgecats.models.ops.hybrid import backends
print("backend 'triton' available:", backends.available("triton"),
      "| auto uses the fused kernel:", backends.triton_enabled())
EOF

# ---------------------------------------------------------------- 1. kernel tests
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  say "== 1. tests/test_triton_kernels.py tests/test_stage1_overlap_gpu.py ($(($(date +%s) - start)) s)"
  export HEDGECATS_GPU_REPORT=/tmp/kernel_report
  rm -rf "$HEDGECATS_GPU_REPORT"
  par=""
  python3 -c "import xdist" 2>/dev/null && par="-n ${WORKERS:-8}"
  timeout -s INT -k 30 "${TESTS_TIMEOUT:-170}" python3 -m pytest -p no:cacheprovider -m gpu -q -rfEs \
    --tb=line $par tests/test_triton_kernels.py tests/test_stage1_overlap_gpu.py 2>&1 | grep -v '^{' | tee -a "$LOG"
  say "pytest exit status: $?"
  cat "$HEDGECATS_GPU_REPORT"/*.jsonl > "$OUT/kernel_tests.jsonl" 2>/dev/null
  python3 benchmarks/gpu_tests_report.py "$OUT/kernel_tests.jsonl" > "$OUT/kernel_tests.md"
  say "$(wc -l < "$OUT/kernel_tests.jsonl" 2>/dev/null) case reports in kernel_tests.md"
fi

# ---------------------------------------------------------------- 2. one layer
if [ "${SKIP_ATTN:-0}" != 1 ]; then
  say "== 2. benchmarks/attention_speed.py ($(($(date +%s) - start)) s)"
  tune=--tune; [ "${ATTN_TUNE:-1}" = 0 ] && tune=""
  timeout -s INT -k 20 "${ATTN_TIMEOUT:-180}" python3 benchmarks/attention_speed.py $tune --out "$OUT" \
    ${ATTN_ARGS:-} 2>&1 | tee -a "$LOG"
  say "attention_speed exit status: $?"
fi

# ---------------------------------------------------------------- 3. stages
if [ "${SKIP_STAGES:-0}" != 1 ]; then
  say "== 3. benchmarks/stage_speed.py ($(($(date +%s) - start)) s)"
  timeout -s INT -k 20 "${STAGES_TIMEOUT:-160}" python3 benchmarks/stage_speed.py --profile --out "$OUT" \
    ${STAGE_ARGS:-} 2>&1 | grep -v "FutureWarning\|warnings.warn" | tee -a "$LOG"
  say "stage_speed exit status: $?"
fi

say "== done in $(($(date +%s) - start)) s"
[ -f "$OUT/summary.json" ] && cat "$OUT/summary.json" | tee -a "$LOG"
ls -la "$OUT"
