#!/bin/bash
# session 18, call 6: after the key-side helpers refactor (PTX identical on CPU), the kernel
# tests that run _bwd_kv / _bwd_dkv_la at every order and part
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
s=$SECONDS
GPU_TESTS_TIMEOUT=170 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py -k "options or fused_backward or fused_bf16 or saved or stage1" > /dev/null 2>&1
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
