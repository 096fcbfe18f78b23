#!/bin/bash
# session 11, call 2: the 128-query forward (default) + FastLaunch: all five ratios in one run,
# the 1k rows with the fast launch off, host profile, then the fused-kernel GPU tests
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 200 python benchmarks/attention_speed.py --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_" $R/speed.log
HEDGECATS_TRITON_FAST_LAUNCH=0 timeout 45 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed_nofast > $R/speed_nofast.log 2>&1
grep "^B=" $R/speed_nofast.log
timeout 40 python benchmarks/profile_hybrid.py --shapes 8x1024 --no-denominator --host --out $R/prof.json > $R/prof.log 2>&1
grep "==" $R/prof.log
GPU_TESTS_TIMEOUT=230 GPU_TESTS_WORKERS=12 OUT=$R/tests bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py > $R/tests.log 2>&1
tail -4 $R/tests/gpu_tests.log
true
