#!/usr/bin/env bash
# Continue a GPU testbed from the runs an earlier call sent back (benchmarks/testbed_gpu.sh's
# testbed_runs.tgz.part-*, carried as .testbed/testbed_runs.tgz.part-*, with the teacher as
# .testbed/teacher.tar.part-*): every run whose stage 1 finished keeps it and runs stage 2 and
# its evaluations again from the start (checkpoints were not sent back); a run whose stage 1 did
# not finish starts again.
#
#   bash benchmarks/testbed_continue_gpu.sh          (carry .whl and the two .testbed parts)
# env: RECIPES (default: the seven whose stage 1 finished on 2026-12-02), RERUN (recipes to run
# from stage 1 with SET_RERUN overrides, e.g. lolcats_window_max with the collapse check off;
# default none), BUDGET (seconds, default 570), and, each 0 or 1:
#   MC      (0) the multiple-choice step on the GPU; with 0 the pipelines run without it
#           (testbed.py run --no-mc) and every finetune/stage.pt is sent back, so that
#           `testbed.py mc` runs the step for all runs on one device and dtype afterwards
#   GUARD   (0) first, alone on the GPU, the guard's cost (benchmarks/guard_overhead.py)
#   BESIDE  (0) beside the testbed, the fused kernels' tests and the decode tests
# (the call of 2026-12-02 ran with RERUN=lolcats_window_max MC=1 GUARD=1 BESIDE=1)
# Writes to $OUT: gpu_call.log, testbed_runs.tgz.part-*, report.tgz, and with GUARD / BESIDE
# kernel_tests.jsonl, guard_overhead_h200_full.json.
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
exec > >(tee -a "$OUT/gpu_call.log") 2>&1
source benchmarks/gpu_env.sh || exit 1
MC=${MC:-0}; GUARD=${GUARD:-0}; BESIDE=${BESIDE:-0}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ROOT=/tmp/testbed; mkdir -p $ROOT
cat .testbed/teacher.tar.part-* | tar -x -C $ROOT || exit 1
cat .testbed/testbed_runs.tgz.part-* | tar -xz -C $ROOT || exit 1
RECIPES=${RECIPES:-lolcats,lolcats_shared_norm,inference_hybrid,hedgecats,ssd_dropout,ssd_window,ssd_fixed}
RERUN=${RERUN:-}
SET_RERUN=${SET_RERUN:-stages.transfer.fit.model.init_args.max_den_collapsed=null}
for d in $ROOT/*-s[0-9]*; do
  if [ -f $d/transfer/done ]; then rm -rf $d/finetune $d/results.json $d/mc; else rm -rf $d; fi
done
for r in ${RERUN//,/ }; do rm -rf $ROOT/$r-s[0-9]*; done
rm -rf $ROOT/legacy $ROOT/report $ROOT/jobs*.json $ROOT/logs
echo "kept stage 1 of: $(cd $ROOT && ls -d *-s[0-9]* | tr '\n' ' ')"

if [ "$GUARD" = 1 ]; then
  echo "== 1. guard overhead, alone on the GPU ($(( $(date +%s) - START )) s)"
  timeout 100 python3 benchmarks/guard_overhead.py --device cuda --dtype bfloat16 --preset llama-1b \
    --batch 8 --seq 1024 --out $OUT/guard_overhead_h200_full.json 2>&1 | tail -15
fi
NOMC=""; [ "$MC" = 1 ] || NOMC=--no-mc

echo "== 2. testbed ($(( $(date +%s) - START )) s): $RECIPES; again from stage 1: $RERUN"
python3 - $ROOT/mc_tasks <<'PY'
import sys
from hedgecats.data.recall_bytes import write_recall_mc_tasks
write_recall_mc_tasks(sys.argv[1], task="marker", n_docs=64, seed=1234)
PY
COMMON="--root $ROOT --teacher $ROOT/teacher/teacher/model --seeds 0,1,2 --transfer-steps 200 --finetune-steps 250 --mc-docs 64 $NOMC"
timeout $(( $(left) - 25 )) python3 benchmarks/testbed.py run $COMMON --recipes $RECIPES \
  --jobs 21 > $ROOT/run_main.log 2>&1 &
P1=$!
P2=""
if [ -n "$RERUN" ]; then
  timeout $(( $(left) - 25 )) python3 benchmarks/testbed.py run $COMMON --recipes $RERUN \
    --set "$SET_RERUN" --jobs 3 > $ROOT/run_rerun.log 2>&1 &
  P2=$!
fi

if [ "$BESIDE" = 1 ]; then
  echo "== 3. beside it: fused kernel tests, decode tests ($(( $(date +%s) - START )) s)"
  export HEDGECATS_GPU_REPORT=/tmp/kernel_report HEDGECATS_TRITON=1
  timeout -s INT -k 20 170 python3 -m pytest -p no:cacheprovider -m gpu -q -rfE --tb=line -n 6 \
    tests/test_triton_kernels.py 2>&1 | grep -v '^{' | tail -40
  cat /tmp/kernel_report/*.jsonl > $OUT/kernel_tests.jsonl 2>/dev/null
  unset HEDGECATS_TRITON
  timeout -s INT -k 20 120 python3 -m pytest -p no:cacheprovider -m gpu -q -rfE --tb=short \
    tests/test_decode_gpu.py 2>&1 | tail -30
fi

wait $P1; echo "testbed rc=$?"; cat $ROOT/run_main.log | grep -v "^\[.*start "
[ -n "$P2" ] && { wait $P2; echo "rerun rc=$?"; cat $ROOT/run_rerun.log; }
python3 benchmarks/testbed.py recover --root $ROOT
python3 benchmarks/testbed.py report --root $ROOT --out $ROOT/report 2>&1 | tail -60
(cd $ROOT && tar -czf $OUT/report.tgz report 2>/dev/null)
KEEP=""; [ "$MC" = 1 ] && KEEP="--exclude=*/finetune/stage.pt"  # else sent back for `mc`
(cd $ROOT && tar -czf - --exclude='*.ckpt' $KEEP \
   --exclude='teacher/teacher/model' --exclude='mc_tasks' . 2>/dev/null \
   | split -b 15M - $OUT/testbed_runs.tgz.part-)
echo "== done at $(( $(date +%s) - START )) s"; ls -la "$OUT"
