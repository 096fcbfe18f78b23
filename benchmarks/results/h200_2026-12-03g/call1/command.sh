#!/bin/bash
# session 15, call 1: the whole layer's kernels at 8 x 1k (kernel_anatomy --branches layer, first
# GPU run), and the flattened pipelined reverse state walk (rev-flat) against the default
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; } > $R/gpu.txt
timeout 120 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default --branches layer --out $R/layer > $R/layer.log 2>&1
tail -40 $R/layer.log
timeout 150 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default,rev-flat --branches hybrid --out $R/revflat > $R/revflat.log 2>&1
tail -40 $R/revflat.log
cd $OUT && tar czf r.tgz r && rm -rf r
true
