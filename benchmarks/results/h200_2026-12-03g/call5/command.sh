#!/bin/bash
# session 15, call 5: all five ratios in one run with this session's code (the q map's backward
# from the kernel's du), then every recipe through `hedgecats pipeline` with it
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
timeout 180 python benchmarks/attention_speed.py --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_" $R/speed.log
GPU_TESTS_TIMEOUT=150 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_recipes.py > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log
cd $OUT && tar czf r.tgz r && rm -rf r
true
