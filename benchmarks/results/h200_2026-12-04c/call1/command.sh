#!/bin/bash
# session 19, call 1: kernel tests (the reverse states' launch moved into _la_states_rev in
# 799179b, not yet run on a GPU); the forward on 64-row 4-warp programs; the host baseline
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; git status --short | head; } > $R/gpu.txt
s=$SECONDS
timeout 200 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer,layer-fwd64-bn32,layer-fwd64-p2-bn32,layer-fwd64-bn32-ss2,layer-fwd64-s1,layer-fwd64-p2-s1 --out $R/layer > $R/layer.log 2>&1
grep "^{" $R/layer.log | python -c "import sys, json; [print(r['branches'], r.get('forward_device_ms'), r.get('fwd_bwd_device_ms'), r.get('rel_err_vs_first_config'), r.get('error', '')) for r in map(json.loads, sys.stdin)]"
grep -n "_fwd\b\|_fwd " $R/layer/kernel_anatomy.md | head -20; echo "anatomy $((SECONDS-s)) s"
s=$SECONDS
timeout 90 python benchmarks/profile_hybrid.py --shapes 8x1024 --host --no-denominator --out $R/profile.json > $R/profile.log 2>&1
grep "^==" $R/profile.log | head -8; echo "profile $((SECONDS-s)) s"
s=$SECONDS
GPU_TESTS_TIMEOUT=230 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
