#!/usr/bin/env bash
# Issue 13 on the GPU machine: the generation tests (tests/test_decode_gpu.py), then the decode
# benchmark's latency and batch parts, combined - benchmarks/speed_gpu.sh's steps 1 and 2.
#   bash benchmarks/decode_gpu.sh        (wheels in .whl/, carried)
# Limits (seconds, env): DECODE_TESTS_TIMEOUT 240, LATENCY_TIMEOUT 180, BATCH_TIMEOUT 150.
# Writes $OUT/speed_gpu.log and $OUT/speed/decode_speed.{json,md}. (Its first version, which
# produced benchmarks/results/decode_tests_h200.log, kept the same steps in its own copy.)
TESTS="tests/test_decode_gpu.py" TESTS_TIMEOUT=${DECODE_TESTS_TIMEOUT:-240} \
  LATENCY_TIMEOUT=${LATENCY_TIMEOUT:-180} BATCH_TIMEOUT=${BATCH_TIMEOUT:-150} \
  SKIP_PROFILE=1 SKIP_ATTN=1 exec bash "$(dirname "$0")/speed_gpu.sh"
