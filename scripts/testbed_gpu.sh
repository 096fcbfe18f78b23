#!/usr/bin/env bash
# The testbed on the GPU machine, in one device call (docs/testbed.md; CI never has a GPU).
#
#   bash scripts/testbed_gpu.sh [--smoke] [--teacher] [--seeds 0,1,2] [--recipes all]
#                                  [--legacy] [--jobs N] [--budget SECONDS]
#                                  [--teacher-config teacher_strong] [--q 0,0.1,0.5]
#
#   --smoke    first: every recipe file through hedgecats pipeline on tiny models
#              (pytest -m gpu tests/test_recipes.py), log to $OUT/recipes_gpu.log
#   --teacher  train the testbed teacher (configs/testbed/teacher.yaml), in the background while
#              the smoke tests run, and send it back as $OUT/teacher.tar.part-* (else the
#              teacher is read from .testbed/teacher.tar.part-*, carried from an earlier call)
#   --seeds / --recipes / --legacy / --jobs / --steps T,F (transfer, finetune; default 200,250)
#              / --mc-docs N: experiments/testbed.py run (skipped without --seeds)
#   --legacy-recipes R1,R2  beside the main run, the same seeds of these recipes with the first
#              weights_xent (--legacy-objective, into <root>/legacy; report in report/legacy):
#              the controlled before/after of issue 20 in one call
#   --budget   stop starting new work after this many seconds (default 540)
#   --teacher-config NAME  configs/testbed/NAME.yaml for the teacher (default teacher); passed to
#              experiments/testbed.py run, whose recipes and tasks take its filler letters
#   --q Q[,Q]  the regime axis (docs/testbed.md#regime): experiments/testbed.py run --q
# Results: $OUT/testbed_runs.tgz.part-* (every run's results.json, mc/, config.yaml, metrics.csv, logs),
# $OUT/report.tgz (experiments/testbed.py report), $OUT/testbed_gpu.log. Wheels: .whl (carried).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
SMOKE=0; TEACHER=0; SEEDS=""; RECIPES=all; LEGACY=""; LEGACY_RECIPES=""; JOBS=7; BUDGET=540; STEPS=200,250; MC=64
TCFG=teacher; Q=""
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1;; --teacher) TEACHER=1;; --legacy) LEGACY=--legacy-objective;;
    --seeds) SEEDS=$2; shift;; --legacy-recipes) LEGACY_RECIPES=$2; shift;; --recipes) RECIPES=$2; shift;; --jobs) JOBS=$2; shift;;
    --budget) BUDGET=$2; shift;; --steps) STEPS=$2; shift;; --mc-docs) MC=$2; shift;;
    --teacher-config) TCFG=$2; shift;; --q) Q="--q $2"; shift;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac; shift
done
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
LOG=$OUT/testbed_gpu.log
exec > >(tee -a "$LOG") 2>&1

source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, fla, lightning, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
ROOT=/tmp/testbed; mkdir -p $ROOT
TEACHER_DIR=$ROOT/teacher/teacher/model

if [ $TEACHER = 1 ]; then
  echo "== teacher (background) at $(( $(date +%s) - START )) s"
  (python3 -m hedgecats.cli pipeline configs/testbed/$TCFG.yaml --output $ROOT/teacher \
     > $ROOT/teacher.log 2>&1; echo "teacher exit $?" >> $ROOT/teacher.log) &
  TPID=$!
elif ls .testbed/teacher.tar.part-* >/dev/null 2>&1; then
  cat .testbed/teacher.tar.part-* | tar -x -C $ROOT && echo "teacher carried: $(ls $TEACHER_DIR)"
fi

if [ $SMOKE = 1 ]; then
  echo "== recipe smoke tests at $(( $(date +%s) - START )) s"
  timeout $(( $(left) - 240 > 60 ? $(left) - 240 : 60 )) python3 -m pytest -p no:cacheprovider \
    -m gpu -rfEs --tb=short -q -n 8 tests/test_recipes.py 2>&1 | tail -60 > $OUT/recipes_gpu.log
  echo "smoke rc=$?"; tail -5 $OUT/recipes_gpu.log
fi

if [ $TEACHER = 1 ]; then
  wait $TPID
  tail -40 $ROOT/teacher.log | grep -v "it/s" | cut -c1-200
  (cd $ROOT && tar -cf - teacher/teacher/model teacher/results.json | split -b 15M - $OUT/teacher.tar.part-)
  cp $ROOT/teacher/teacher/logs/attempt_0/metrics.csv $OUT/teacher_metrics.csv 2>/dev/null
fi

if [ -n "$SEEDS" ] && [ -d "$TEACHER_DIR" ] && [ "$(left)" -gt 120 ]; then
  echo "== recipes seeds $SEEDS ($RECIPES, $JOBS at once) at $(( $(date +%s) - START )) s"
  if [ -n "$LEGACY_RECIPES" ]; then
    echo "== beside it: legacy objective, $LEGACY_RECIPES seeds $SEEDS"
    timeout $(( $(left) - 30 )) python3 -m experiments.testbed run --root $ROOT \
      --teacher $TEACHER_DIR --seeds $SEEDS --recipes $LEGACY_RECIPES --jobs 8 \
      --legacy-objective --transfer-steps ${STEPS%,*} --finetune-steps ${STEPS#*,} \
      --mc-docs $MC --teacher-config $TCFG $Q > $ROOT/legacy_run.log 2>&1 &
    LPID=$!
  fi
  timeout $(( $(left) - 30 )) python3 -m experiments.testbed run --root $ROOT \
    --teacher $TEACHER_DIR --seeds $SEEDS --recipes $RECIPES --jobs $JOBS $LEGACY \
    --transfer-steps ${STEPS%,*} --finetune-steps ${STEPS#*,} --mc-docs $MC \
    --teacher-config $TCFG $Q
  echo "testbed rc=$?"
  if [ -n "$LEGACY_RECIPES" ]; then wait $LPID; echo "legacy rc=$?"; cat $ROOT/legacy_run.log; fi
  python3 -m experiments.testbed recover --root $ROOT  # runs stopped in their last evaluation
  python3 -m experiments.testbed report --root $ROOT --out $ROOT/report 2>&1 | tail -80
  if [ -d $ROOT/legacy ]; then
    python3 -m experiments.testbed report --root $ROOT/legacy --out $ROOT/report/legacy 2>&1 | tail -40
  fi
  (cd $ROOT && tar -czf $OUT/report.tgz report 2>/dev/null)
fi
# in 15 MB parts (a file over 16 MB would not come back): cat testbed_runs.tgz.part-* | tar -xz
[ -n "$SEEDS" ] && (cd $ROOT && tar -czf - --exclude='*.ckpt' --exclude='*/finetune/stage.pt' \
   --exclude='teacher/teacher/model' --exclude='mc_tasks' . 2>/dev/null \
   | split -b 15M - $OUT/testbed_runs.tgz.part-)
echo "== done at $(( $(date +%s) - START )) s"; ls -la "$OUT"
