#!/bin/bash
# session 13, call 5 (the last ~150 s, the machine still warm): st128 against the default, kernel alone, gradients compared
source benchmarks/gpu_env.sh; mkdir -p $OUT/r
timeout 100 python benchmarks/attention_speed.py --shapes "" --tune --tune-shapes 8x1024 --tune-configs default,st128 --out $OUT/r/t > $OUT/r/tune.log 2>&1
