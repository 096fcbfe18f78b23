#!/bin/bash
# session 13, call 1: the fused kernel's anatomy (per kernel, hybrid / SWA alone / LA alone,
# default vs cs64 vs 64-query forward), then the Qwen2-shaped GPU cases, then every recipe
# through `hedgecats pipeline`
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/gpu.txt
timeout 200 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default,cs64,chunk64 --out $R > $R/notes.txt 2>&1
tail -3 $R/notes.txt
GPU_TESTS_TIMEOUT=120 GPU_TESTS_WORKERS=6 OUT=$R/t1 bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py -k H28 > /dev/null 2>&1
echo "== H28 tests" >> $R/notes.txt; grep -E "passed|failed|FAILED|ERROR" $R/t1/gpu_tests.log | tail -8 >> $R/notes.txt
GPU_TESTS_TIMEOUT=170 GPU_TESTS_WORKERS=14 OUT=$R/t2 bash benchmarks/gpu_tests.sh tests/test_recipes.py > /dev/null 2>&1
echo "== recipes" >> $R/notes.txt; grep -E "passed|failed|FAILED|ERROR" $R/t2/gpu_tests.log | tail -8 >> $R/notes.txt
cp $R/t2/gpu_tests.log $R/recipes.log; cp $R/t1/gpu_tests.log $R/h28.log; rm -rf $R/t1 $R/t2
tail -12 $R/notes.txt
true
