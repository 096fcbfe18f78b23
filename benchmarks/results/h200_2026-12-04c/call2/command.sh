#!/bin/bash
# session 19, call 2: the new default (the forward on 64 x 32 tiles, 4 warps, the state
# product pipelined) against session 18's tiles; the five ratios; the host; all GPU tests
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; git status --short | head; } > $R/gpu.txt
s=$SECONDS
timeout 120 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer,layer-session18,layer-fwd-p2 --out $R/layer > $R/layer.log 2>&1
grep "^{" $R/layer.log | python -c "import sys, json; [print(r['branches'], r.get('forward_device_ms'), r.get('fwd_bwd_device_ms'), r.get('error', '')) for r in map(json.loads, sys.stdin)]"
grep -n "_fwd\b\|_fwd \|_bwd_q" $R/layer/kernel_anatomy.md | head -20; echo "anatomy $((SECONDS-s)) s"
s=$SECONDS
timeout 230 python benchmarks/attention_speed.py --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" --tune --tune-shapes 1x65536 --tune-configs default,session18 --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_\|config" $R/speed.log | head -40; echo "speed $((SECONDS-s)) s"
s=$SECONDS
timeout 90 python benchmarks/profile_hybrid.py --shapes 8x1024 --host --no-denominator --out $R/profile.json > $R/profile.log 2>&1
grep "^==" $R/profile.log | head -6; echo "profile $((SECONDS-s)) s"
s=$SECONDS
GPU_TESTS_TIMEOUT=300 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py tests/test_recipes.py tests/test_fast_launch.py > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
