#!/bin/bash
# session 15, call 4: the feature maps' kernels through tensor descriptors (FWD_TMA, BWD_TMA):
# every fused-kernel / feature-map test first, then both maps alone and the layer, TMA on / off
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
GPU_TESTS_TIMEOUT=240 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log
timeout 120 python benchmarks/phi_speed.py --shapes 8x1024,1x65536 --variants from-output,fwd-ptr,bwd-ptr --out $R/phi > $R/phi.log 2>&1
cat $R/phi/phi_speed.md || tail -5 $R/phi.log
timeout 150 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer,layer-phi-pointers,layer-no-du --out $R/layer > $R/layer.log 2>&1
grep "^{" $R/layer.log | python -c "import sys, json; [print(r['branches'], r.get('forward_device_ms'), r.get('fwd_bwd_device_ms'), r.get('error', '')) for r in map(json.loads, sys.stdin)]"
sed -n '/fwd + bwd/,$p' $R/layer/kernel_anatomy.md | head -22
cd $OUT && tar czf r.tgz r && rm -rf r
true
