#!/bin/bash
# session 17, call 1: session 16's code on a GPU for the first time. Correctness first (every
# fused-kernel / feature-map / launcher test, the 12 fused-backward variants included), then the
# layer's kernels with each fusion, then the ratios at 8 x 1k with the tune configs
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
s=$SECONDS
GPU_TESTS_TIMEOUT=240 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py tests/test_fast_launch.py > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
s=$SECONDS
timeout 150 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer,layer-fuse-q,layer-fuse-kv,layer-fuse-qkv --out $R/layer > $R/layer.log 2>&1
grep "^{" $R/layer.log | python -c "import sys, json; [print(r['branches'], r.get('forward_device_ms'), r.get('fwd_bwd_device_ms'), r.get('error', '')) for r in map(json.loads, sys.stdin)]"
sed -n '/fwd + bwd/,$p' $R/layer/kernel_anatomy.md | head -30; echo "anatomy $((SECONDS-s)) s"
s=$SECONDS
timeout 140 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed)( fwd)?$" --tune --tune-shapes 8x1024 --tune-configs default,fwd-bn32,fuse-qkv --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_\|config" $R/speed.log | head -30; echo "speed $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
