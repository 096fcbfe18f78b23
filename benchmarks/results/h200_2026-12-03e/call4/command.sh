#!/bin/bash
# session 13, call 4 (the last ~300 s of GPU time): the forward's F slices at 128 and the walked
# state kernels on larger tiles, per kernel, against the default
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $R/gpu.txt
timeout 190 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default,fc128,st128x64,st128 --branches hybrid --out $R > $R/notes.txt 2>&1
grep '"config"' $R/notes.txt | cut -c1-300
true
