#!/bin/bash
# session 11, call 1: tiles found with ptxas's launch hints (fwd128, bwd64) against the default,
# kernel alone, event and device time; the 1k rows with the device-time column; the layout test
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 230 python benchmarks/attention_speed.py --shapes "" --tune --tune-shapes 8x1024 --tune-configs default,fwd128,bwd64,fwd128-bwd64 --out $R/tune1k > $R/tune1k.log 2>&1
grep "tune" $R/tune1k.log
timeout 70 python benchmarks/attention_speed.py --shapes "" --tune --tune-shapes 1x65536 --tune-configs default,fwd128-bwd64 --out $R/tune64k > $R/tune64k.log 2>&1
grep "tune" $R/tune64k.log
timeout 50 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=" $R/speed.log
GPU_TESTS_TIMEOUT=80 GPU_TESTS_WORKERS=4 OUT=$R/tests bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py -k "models_memory or head_dim_80" > $R/tests.log 2>&1
tail -3 $R/tests/gpu_tests.log
true
