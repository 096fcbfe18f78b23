#!/bin/bash
# session 12, call 1: tune sweep (dq128, cs64) kernel alone; feature-map row loops; the layer
# at 8 x 1k with the new feature maps; GPU tests of the feature map and of the decode step
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 150 python benchmarks/attention_speed.py --shapes "" --tune --tune-shapes 8x1024 --tune-configs default,dq128,cs64,dq128-cs64 --out $R/tune1k > $R/tune1k.log 2>&1
grep "tune" $R/tune1k.log | cut -c1-600
timeout 100 python benchmarks/phi_speed.py --shapes 8x1024,1x65536 --variants from-output,loop1,loop2,loop8 --out $R/phi > $R/phi.log 2>&1
tail -3 $R/phi.log; cat $R/phi/phi_speed.md
timeout 60 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_" $R/speed.log
timeout 100 python benchmarks/attention_speed.py --shapes "" --tune --tune-shapes 1x65536 --tune-configs default,dq128,cs64,dq128-cs64 --out $R/tune64k > $R/tune64k.log 2>&1
grep "tune" $R/tune64k.log | cut -c1-600
GPU_TESTS_TIMEOUT=150 GPU_TESTS_WORKERS=12 OUT=$R/tests bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py tests/test_decode_gpu.py -k "phi or feature or decode or fast_launch" > $R/tests.log 2>&1
tail -4 $R/tests/gpu_tests.log
for d in tune1k tune64k phi speed tests; do for f in $R/$d/*; do [ -f "$f" ] && cp "$f" "$R/${d}_$(basename $f)"; done; rm -rf $R/$d; done
ls $R
true
