#!/bin/bash
# session 18, call 2: the new default (kv_order 2, state_sums_mma): the layer's kernels against
# session 17's tiles, the five ratios, the host part by part
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
s=$SECONDS
timeout 150 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer,layer-session17,layer-sums-reduced,layer-kv-order0 --out $R/layer > $R/layer.log 2>&1
grep "^{" $R/layer.log | python -c "import sys, json; [print(r['branches'], r.get('forward_device_ms'), r.get('fwd_bwd_device_ms'), r.get('error', '')) for r in map(json.loads, sys.stdin)]"
sed -n '/fwd + bwd/,$p' $R/layer/kernel_anatomy.md | head -16; echo "anatomy $((SECONDS-s)) s"
s=$SECONDS
timeout 230 python benchmarks/attention_speed.py --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" --tune --tune-shapes 1x65536 --tune-configs default,session17 --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_\|config" $R/speed.log | head -40; echo "speed $((SECONDS-s)) s"
s=$SECONDS
timeout 120 python benchmarks/profile_hybrid.py --shapes 8x1024 --host --no-denominator --out $R/profile.json > $R/profile.log 2>&1
grep "^==" $R/profile.log | head -20; echo "profile $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
