#!/bin/bash
# session 11, call 3: host micro-changes (1k rows), feature-map tiles, split states at 8 chunks,
# then every recipe through `hedgecats pipeline` on the GPU and the fast-launch / phi tests
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 45 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=" $R/speed.log
timeout 80 python benchmarks/phi_speed.py --shapes 8x1024,1x65536 --variants from-output,bwd64,bwd128,fwd128-bwd64 --out $R/phi > $R/phi.log 2>&1
cut -c1-200 $R/phi.log | grep "^{"
timeout 60 python benchmarks/attention_speed.py --shapes "" --tune --tune-shapes 8x1024 --tune-configs default,split-states --out $R/tune > $R/tune.log 2>&1
grep "tune" $R/tune.log
GPU_TESTS_TIMEOUT=240 GPU_TESTS_WORKERS=14 OUT=$R/recipes bash benchmarks/gpu_tests.sh tests/test_recipes.py > $R/recipes.log 2>&1
tail -2 $R/recipes/gpu_tests.log
GPU_TESTS_TIMEOUT=60 GPU_TESTS_WORKERS=8 OUT=$R/tests bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py -k "fast_launch or models_memory or phi or feature" > $R/tests.log 2>&1
tail -2 $R/tests/gpu_tests.log
true
