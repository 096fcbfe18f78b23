#!/bin/bash
# session 17, call 4: every fused-kernel / feature-map GPU test with the fused backward kernels
# on by default (the D 128 bf16 shapes now run _bwd_q / _bwd_kv; the D 80 routing test passed in
# call 3 on this code and takes ~150 s: left out), then the 8 x 1k rows once more (the event
# ratio's spread across hosts)
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; nproc; lscpu | grep "Model name"; } > $R/gpu.txt
s=$SECONDS
GPU_TESTS_TIMEOUT=250 GPU_TESTS_WORKERS=14 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py --deselect tests/test_triton_kernels.py::test_routing_head_dim_80_goes_to_the_pieces > /dev/null 2>&1
pkill -f "pytest" ; sleep 2
grep -E "FAILED|ERROR" $R/t1/gpu_tests.log | head -20; tail -1 $R/t1/gpu_tests.log; echo "tests $((SECONDS-s)) s"
s=$SECONDS
timeout 70 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
grep "^B=\|layer_" $R/speed.log; echo "speed $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
