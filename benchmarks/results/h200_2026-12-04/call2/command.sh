#!/bin/bash
# session 17, call 2: the backward's fused kernels on by default (D 128 bf16). On a quiet
# machine first (nothing else running): all five ratios, the fused kernels against the
# separate ones at 64k (the kernel alone), the layer's host time against its device time; then
# the GPU test call 1's time limit cut, and every recipe through `hedgecats pipeline`
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; nproc; } > $R/gpu.txt
s=$SECONDS
timeout 250 python benchmarks/attention_speed.py --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" --tune --tune-shapes 1x65536 --tune-configs default,unfused --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_\|tune" $R/speed.log; echo "speed $((SECONDS-s)) s"
s=$SECONDS
timeout 60 python benchmarks/profile_hybrid.py --shapes 8x1024 --no-denominator --host --out $R/prof.json > $R/prof.log 2>&1
grep "^== .*host_ms" $R/prof.log; echo "prof $((SECONDS-s)) s"
s=$SECONDS
GPU_TESTS_TIMEOUT=230 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_recipes.py "tests/test_triton_kernels.py::test_routing_head_dim_80_goes_to_the_pieces" > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
