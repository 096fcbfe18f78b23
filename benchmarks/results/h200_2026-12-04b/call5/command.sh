#!/bin/bash
# session 18, call 5 (after call 4 routed the padded forward split share away from the sums on the tensor cores): the new default (kv_order 2, state_sums_mma) under every fused-kernel GPU
# test and every recipe through `hedgecats pipeline` (18 8B pipelines + 10 testbed recipes)
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
s=$SECONDS
GPU_TESTS_TIMEOUT=300 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py tests/test_recipes.py tests/test_fast_launch.py > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
