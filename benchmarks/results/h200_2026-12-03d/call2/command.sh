#!/bin/bash
# session 12, call 2: dq_block_m 128 default, phi bias sums in the kernel: phi A/B, all five
# ratios in one run, the fused-kernel GPU tests. At most 8 files come back: logs folded into one
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R; N=$R/notes.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $N
timeout 80 python benchmarks/phi_speed.py --shapes 8x1024,1x65536 --variants from-output,torch-db --out $R/phi > $R/phi.log 2>&1
cat $R/phi/phi_speed.md; tail -2 $R/phi.log
timeout 200 python benchmarks/attention_speed.py --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_" $R/speed.log
GPU_TESTS_TIMEOUT=230 GPU_TESTS_WORKERS=12 OUT=$R/tests bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py > $R/tests.log 2>&1
tail -4 $R/tests/gpu_tests.log
{ echo "## phi.log"; cat $R/phi.log; echo "## speed.log"; cat $R/speed.log; echo "## tests (grep)"; grep -E "PASSED|FAILED|ERROR|passed|failed" $R/tests/gpu_tests.log | tail -130; } >> $N
cp $R/phi/phi_speed.md $R/phi_speed.md; cp $R/phi/phi_speed.json $R/phi_speed.json
cp $R/speed/attention_speed.md $R/speed/attention_speed.json $R/speed/summary.json $R/speed/attention_speed.png $R/ 2>/dev/null
rm -rf $R/phi $R/speed $R/tests $R/phi.log $R/speed.log $R/tests.log
ls $R
true
