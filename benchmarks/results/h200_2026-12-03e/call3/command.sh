#!/bin/bash
# session 13, call 3: the query-side backward packed (default) against the forward packed only
# (pack4-dq1), per kernel; all five ratios in one run; the fused-kernel GPU tests and every
# recipe through `hedgecats pipeline` with the packed kernels (side by side: nothing timed then)
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R; N=$R/notes.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $R/gpu.txt
timeout 100 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs pack4-dq1,default --branches hybrid,swa --out $R > $N 2>&1
tail -2 $N
timeout 200 python benchmarks/attention_speed.py --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_" $R/speed.log
GPU_TESTS_TIMEOUT=300 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py tests/test_recipes.py > /dev/null 2>&1
{ echo "## speed.log"; cat $R/speed.log; echo "## tests"; grep -E "FAILED|ERROR|passed|failed" $R/t1/gpu_tests.log | tail -30; } >> $N
cp $R/t1/gpu_tests.log $R/gpu_tests.log
cp $R/speed/attention_speed.md $R/speed/attention_speed.json $R/ 2>/dev/null
rm -rf $R/speed $R/t1 $R/speed.log
tail -14 $N
ls $R
true
