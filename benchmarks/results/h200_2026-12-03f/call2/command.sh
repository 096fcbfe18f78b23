#!/bin/bash
# session 14, call 2: the maps handing q, k on (GPU tests of the maps and the kernels' module
# path), the layer's 1k rows with it, host vs device at 8 x 1k with cProfile tables,
# _bwd_dkv_la's launches apart, the feature maps' forward / backward on other tiles
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
GPU_TESTS_TIMEOUT=150 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py -k "feature_map or hands" > $R/tests.log 2>&1
tail -3 $R/t1/gpu_tests.log
timeout 60 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=" $R/speed.log
timeout 100 python benchmarks/profile_hybrid.py --shapes 8x1024 --no-denominator --host --out $R/prof.json > $R/prof.log 2>&1
grep "^== B=8 T=1024 [a-z]*:" $R/prof.log | head -5
timeout 80 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default,dv64 --branches hybrid --out $R/anat > $R/anat.log 2>&1
grep -A16 "fwd + bwd" $R/anat/kernel_anatomy.md
timeout 90 python benchmarks/phi_speed.py --shapes 8x1024 --variants from-output,fwd32w4,fwd64w4,bwd64w4 --out $R/phi > $R/phi.log 2>&1
tail -24 $R/phi.log
cd $OUT && tar czf r.tgz r && rm -rf r
true
