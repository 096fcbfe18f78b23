#!/bin/bash
# session 13, call 2: the packed forward (pack_heads 4, the new default) against one head a
# program (pack1 = session 12's default) and the cs64 walk, per kernel; the layer's 1k rows;
# every fused-kernel GPU test with the packed forward
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 170 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs pack1,default,pack2,cs64-walk,pack4-cs64-walk --out $R > $R/notes.txt 2>&1
tail -2 $R/notes.txt
timeout 60 python benchmarks/attention_speed.py --shapes 8x1024 --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" --out $R/speed > $R/speed.log 2>&1
echo "== speed" >> $R/notes.txt; grep "^B=\|ratio" $R/speed.log >> $R/notes.txt; cp $R/speed/attention_speed.md $R/speed_1k.md; cp $R/speed/attention_speed.json $R/speed_1k.json; rm -rf $R/speed
GPU_TESTS_TIMEOUT=230 GPU_TESTS_WORKERS=8 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py > /dev/null 2>&1
echo "== kernel tests" >> $R/notes.txt; grep -E "passed|failed|FAILED|ERROR" $R/t1/gpu_tests.log | tail -12 >> $R/notes.txt
cp $R/t1/gpu_tests.log $R/kernel_tests.log; rm -rf $R/t1
tail -25 $R/notes.txt
true
