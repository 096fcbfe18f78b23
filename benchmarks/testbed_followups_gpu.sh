#!/usr/bin/env bash
# The testbed's open questions in one GPU call (issues 10 and 15; docs/testbed.md, "Not measured
# yet"), every pipeline without its multiple-choice step (run afterwards on any machine with
# `python benchmarks/testbed.py mc --root <root> --device cpu`, as for the other runs):
#   A. the three SSD schedules at the paper's stage-2 learning rate, 1e-4 (ours: 1e-3), from the
#      carried stage-1 checkpoints (HedgeCATs' stage 1, the same for every SSD recipe and seed),
#      into /tmp/tb_lr: is SSD's damage to the SWA and softmax paths the step size?
#   B. lolcats_window_max (LoLCATs' own shared normalisation) through both stages with the
#      collapse check off, into /tmp/tb_new: does LoRA revive the LA branch stage 1 silenced?
#   C. the gated mixers (lolcats_gate_elementwise, lolcats_gate_lowrank) through both stages,
#      into /tmp/tb_new (issue 15, item 5).
#   bash benchmarks/testbed_followups_gpu.sh   (carry .whl, .testbed/teacher.tar.part-* and
#                                               .testbed/testbed_runs.tgz.part-*)
# env: SEEDS (0,1,2), BUDGET (seconds, 560), PARTS (ABC). Writes to $OUT: gpu_call.log,
# followups.tgz.part-* (both roots: results, logs, metrics, finetune/stage.pt; no checkpoints).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET=${BUDGET:-560}; SEEDS=${SEEDS:-0,1,2}; PARTS=${PARTS:-ABC}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
exec > >(tee -a "$OUT/gpu_call.log") 2>&1
source benchmarks/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# the teacher where the carried runs' stage 1 read it (a done stage whose config names another
# teacher path would be refused as changed)
T=/tmp/testbed; mkdir -p $T /tmp/tb_lr /tmp/tb_new /tmp/tb_carried
cat .testbed/teacher.tar.part-* | tar -x -C $T || exit 1
TEACHER=$T/teacher/teacher/model
COMMON="--teacher $TEACHER --seeds $SEEDS --transfer-steps 200 --finetune-steps 250 --mc-docs 64 --no-mc"
pids=""
if [[ $PARTS == *A* ]]; then
  cat .testbed/testbed_runs.tgz.part-* | tar -xz -C /tmp/tb_carried || exit 1
  for r in ssd_dropout ssd_window ssd_fixed; do
    for s in ${SEEDS//,/ }; do
      src=/tmp/tb_carried/$r-s$s/transfer
      [ -f $src/done ] || { echo "no finished stage 1 for $r-s$s: it runs from the start"; continue; }
      mkdir -p /tmp/tb_lr/$r-s$s && cp -r $src /tmp/tb_lr/$r-s$s/
    done
  done
  echo "== A. SSD at lr 1e-4 ($(( $(date +%s) - START )) s)"
  timeout $(( $(left) - 40 )) python3 benchmarks/testbed.py run --root /tmp/tb_lr $COMMON \
    --recipes ssd_dropout,ssd_window,ssd_fixed --jobs 9 \
    --set stages.finetune.fit.model.init_args.lr=1e-4 > /tmp/tb_lr/run.log 2>&1 &
  pids="$pids $!"
fi
if [[ $PARTS == *B* ]]; then
  echo "== B. lolcats_window_max, collapse check off ($(( $(date +%s) - START )) s)"
  timeout $(( $(left) - 40 )) python3 benchmarks/testbed.py run --root /tmp/tb_new $COMMON \
    --recipes lolcats_window_max --jobs 3 \
    --set stages.transfer.fit.model.init_args.max_den_collapsed=null > /tmp/tb_new/run_b.log 2>&1 &
  pids="$pids $!"
fi
if [[ $PARTS == *C* ]]; then
  echo "== C. gated mixers ($(( $(date +%s) - START )) s)"
  timeout $(( $(left) - 40 )) python3 benchmarks/testbed.py run --root /tmp/tb_new $COMMON \
    --recipes lolcats_gate_elementwise,lolcats_gate_lowrank --jobs 6 > /tmp/tb_new/run_c.log 2>&1 &
  pids="$pids $!"
fi
for p in $pids; do wait $p; echo "exit $?"; done
cat /tmp/tb_lr/run.log /tmp/tb_new/run_b.log /tmp/tb_new/run_c.log 2>/dev/null | grep -v " start "
for root in /tmp/tb_lr /tmp/tb_new; do
  python3 benchmarks/testbed.py recover --root $root
  python3 benchmarks/testbed.py report --root $root --out $root/report --no-plots 2>&1 | tail -40
done
# in 15 MB parts (a file over 16 MB would not come back): cat followups.tgz.part-* | tar -xz
(cd /tmp && tar -czf - --exclude='*.ckpt' --exclude='mc_tasks' tb_lr tb_new 2>/dev/null \
   | split -b 15M - $OUT/followups.tgz.part-)
echo "== done at $(( $(date +%s) - START )) s"; ls -la "$OUT"
