#!/bin/bash
# session 12, call 3: the layer at 8 x 1k with the final code; the backend matrix to the end
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R; N=$R/notes.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $N
timeout 60 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_" $R/speed.log
GPU_TESTS_TIMEOUT=400 GPU_TESTS_WORKERS=12 OUT=$R/tests bash benchmarks/gpu_tests.sh > $R/tests.log 2>&1
tail -4 $R/tests/gpu_tests.log
{ echo "## speed.log"; cat $R/speed.log; } >> $N
cp $R/speed/attention_speed.md $R/speed_1k.md
cp $R/tests/gpu_tests.log $R/gpu_tests.log; cp $R/tests/gpu_tests.md $R/gpu_tests.md 2>/dev/null
rm -rf $R/speed $R/tests $R/speed.log $R/tests.log
ls $R
true
