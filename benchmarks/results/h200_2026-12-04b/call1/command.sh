#!/bin/bash
# session 18, call 1: three options of the default tiles (kv_order 1 and 2, state_sums_mma),
# timed first (the layer's kernels, the kernel alone at 8 x 1k and 1 x 64k), then their GPU tests
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
s=$SECONDS
timeout 170 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer,layer-kv-order1,layer-kv-order2,layer-rev-sums-mma --out $R/layer > $R/layer.log 2>&1
grep "^{" $R/layer.log | python -c "import sys, json; [print(r['branches'], r.get('forward_device_ms'), r.get('fwd_bwd_device_ms'), r.get('error', '')) for r in map(json.loads, sys.stdin)]"
sed -n '/fwd + bwd/,$p' $R/layer/kernel_anatomy.md | head -30; echo "anatomy $((SECONDS-s)) s"
s=$SECONDS
timeout 170 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)$" --tune --tune-shapes 8x1024,1x65536 --tune-configs default,kv-order1,kv-order2,rev-sums-mma --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_\|config" $R/speed.log | head -30; echo "speed $((SECONDS-s)) s"
s=$SECONDS
GPU_TESTS_TIMEOUT=210 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py --deselect tests/test_triton_kernels.py::test_routing_head_dim_80_goes_to_the_pieces > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
