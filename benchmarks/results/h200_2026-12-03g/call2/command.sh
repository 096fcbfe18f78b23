#!/bin/bash
# session 15, call 2: the q map's backward from the kernel's du (kernel_du): correctness first
# (the new GPU test, the feature-map and fused-kernel tests), then the layer's anatomy with and
# without it, the kernel alone
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
GPU_TESTS_TIMEOUT=260 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py > $R/tests1.log 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log
timeout 150 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer,layer-no-du,hybrid --out $R/layer > $R/layer.log 2>&1
tail -60 $R/layer.log
cd $OUT && tar czf r.tgz r && rm -rf r
true
