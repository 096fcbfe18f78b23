#!/bin/bash
# session 18, call 4: which split-state case faults with state_sums_mma (call 3: an illegal
# memory access in test_kernel_options_match_the_reference[split_states-*], B 2, T 300, padding)
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
export CUDA_LAUNCH_BLOCKING=1
for args in "1 300 0 both 2" "1 300 1 both 2" "0 300 1 both 2" "1 384 1 both 2" "1 300 1 both 1" "1 300 1 fwd 2" "1 300 1 rev 2" "0 384 1 both 1"; do
  timeout 60 python benchmarks/results/h200_2026-12-04b/call4/bisect.py $args 2>&1 | grep -v Warning | tail -4
done | tee $R/bisect.log
cd $OUT && tar czf r.tgz r && rm -rf r
true
