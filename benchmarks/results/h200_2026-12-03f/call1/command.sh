#!/bin/bash
# session 14, call 1: every fused-kernel GPU test with the 128 x 128 state tiles (incl. the new
# B8-H16 shape), the pipelined state product against the default kernel by kernel, the layer's
# 1k rows with the current default
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt
GPU_TESTS_TIMEOUT=300 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py > $R/tests.log 2>&1
tail -3 $R/t1/gpu_tests.log
timeout 90 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default,pipe-state --branches hybrid,la --out $R/anat > $R/anat.log 2>&1
tail -40 $R/anat.log
timeout 60 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep -A12 "^B=" $R/speed.log | head -30
true
