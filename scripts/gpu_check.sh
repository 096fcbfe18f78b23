#!/usr/bin/env bash
# What sessions 20-23 built without a GPU, checked and measured on one:
#
#   bash benchmarks/validate_gpu.sh tests      (~7 min) the kernel GPU tests (the folded maps,
#       the no-grad forward, output gates, TWO_PROGRAM_FORWARD's fwd_two_programs), then the
#       recipes through `hedgecats pipeline` and stage 1's side streams
#   bash benchmarks/validate_gpu.sh measure    (~8 min) issue 11's five ratios with the
#       output-gate rows against the pieces beside them (attention_speed: 8 x 1k, 1 x 64k,
#       2 x 4k), the layer at 8 x 1k kernel by kernel against fq held by the forward's
#       programs (KernelConfig.hold_fq) and the call before the fold (kernel_anatomy), its
#       host work part by part (profile_hybrid --host)
#   bash benchmarks/validate_gpu.sh options    (~6 min) session 22-23's options for the
#       forward, each against the layer (kernel_anatomy at 8 x 1k): the maps' softmax by a
#       reciprocal (triton_phi.RECIPROCAL_SOFTMAX), their forward on 32-row programs
#       (FORWARD_TILES), their fp32 weights rounded in the pair's kernel
#       (WEIGHTS_IN_KERNEL), fq held (hold_fq), hold_fq with the reciprocal
#   bash benchmarks/validate_gpu.sh forward    (~6 min) session 22's q map inside the no-grad
#       forward and the fold's released memory: their GPU tests with the fold, gate and
#       option tests, the layer with the q map in _fwd and without and at other LA state
#       spacings (kernel_anatomy); then `measure` for the ratios
#   bash benchmarks/validate_gpu.sh pair       (~5 min) session 24: the maps' GPU tests with
#       their softmax normalised by a reciprocal (HEDGECATS_TEST_SWITCHES=
#       feature_map.kernels.RECIPROCAL_SOFTMAX=True), what bounds the maps' forward pair (phi_bound.py:
#       the pair against kernels of its grid doing less), the layer with the reciprocal, the
#       pair on walking programs (triton_phi.FORWARD_WALK) and _fwd's key tiles through
#       descriptors (KernelConfig.fwd_tma)
#   bash benchmarks/validate_gpu.sh defaults   (~9 min) session 24's new defaults (the walking
#       pair, the reciprocal softmax): their GPU tests, phi_bound.py's rows, issue 11's five
#       ratios with them (attention_speed, no gate rows), the layer against the defaults
#       before (kernel_anatomy layer,layer-grid-div)
#   bash benchmarks/validate_gpu.sh occupancy  (~9 min) session 25: `_fwd` with more programs a
#       multiprocessor (KernelConfig.park_la, fwd_maxnreg, fwd_stages) and the maps' weights
#       rounded in the walking pair (triton_phi.WEIGHTS_IN_KERNEL "walk") against the layer
#       (kernel_anatomy); the T1k ratios with the defaults and with those candidates
#       (attention_speed --switches / --tiles, one run each); their GPU tests (options_give,
#       the walking pair's); `_fwd`'s time split between its branches
#   bash benchmarks/validate_gpu.sh bisect-gate (~6 min) session 25: the output gate's test and
#       the race / unwritten-memory test with each of session 25's candidates on alone and both
#       (the run with both failed the gate's)
#   bash benchmarks/validate_gpu.sh parked     (~9 min) the candidates as defaults: the five
#       ratios (attention_speed --switches), the kernel tests with them
#   bash benchmarks/validate_gpu.sh memory     (~6 min) the fold's memory tests, its peak taken
#       apart (fold_memory.py), session 23's held-fq forward tests, the recipes
#
# The predictions these are read against: benchmarks/README.md, "Written before measuring"
# for sessions 20 to 23. Run with the wheels carried (`.whl/`, ../shared/gpu/fetch-wheels.sh).
# Writes $OUT/r.tgz (every log, JSON and table; the device returns a few files only) and
# prints the lines to read. Each step has its own time limit; a step cut short keeps what it
# wrote.
set -o pipefail
source benchmarks/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}
R=$OUT/r
mkdir -p "$R"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format=%H 2>/dev/null
  git status --short 2>/dev/null | head
} > "$R/gpu.txt"
cat "$R/gpu.txt"
step() { echo "== $1: $(( SECONDS - t0 )) s"; }
# kernel_tests TIMEOUT [pytest -k expression]: the fused kernels' GPU tests (all, or those)
kernel_tests() {
  t0=$SECONDS
  GPU_TESTS_TIMEOUT=${KERNEL_TESTS_TIMEOUT:-$1} GPU_TESTS_WORKERS=${WORKERS:-14} \
    OUT=$R/kernels bash benchmarks/gpu_tests.sh tests/test_triton_kernels.py \
    ${2:+-k "$2"} > /dev/null 2>&1
  grep -E "FAILED|ERROR|AssertionError" "$R/kernels/gpu_tests.log" | head -20
  tail -1 "$R/kernels/gpu_tests.log"
  step "kernel tests"
}
# the recipes through `hedgecats pipeline` and stage 1's side streams
recipe_tests() {
  t0=$SECONDS
  GPU_TESTS_TIMEOUT=${RECIPE_TESTS_TIMEOUT:-200} GPU_TESTS_WORKERS=${WORKERS:-14} \
    OUT=$R/recipes bash benchmarks/gpu_tests.sh tests/test_recipes.py \
    tests/test_stage1_overlap_gpu.py > /dev/null 2>&1
  grep -E "FAILED|ERROR" "$R/recipes/gpu_tests.log" | head -20
  tail -1 "$R/recipes/gpu_tests.log"
  step "recipe tests"
}
# parked_forward: triton_hybrid.PARKED_FORWARD as a switch's value (HEDGECATS_TEST_SWITCHES,
# attention_speed's --switches)
parked_forward() {
  python -c "from hedgecats.models.ops import triton_hybrid as th; print(repr(th.PARKED_FORWARD))"
}
# anatomy TIMEOUT BRANCHES: the layer at 8 x 1k kernel by kernel (kernel_anatomy), per variant
anatomy() {
  t0=$SECONDS
  timeout "$1" python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default \
    --branches "$2" --out "$R/anatomy" > "$R/anatomy.log" 2>&1
  grep "^{" "$R/anatomy.log" | python -c "
import json, sys
for r in map(json.loads, sys.stdin):
    print(r.get('branches'), r.get('forward_device_ms'), r.get('fwd_bwd_device_ms'), r.get('error', ''))"
  step "anatomy"
}

case "${1:-}" in
  tests)
    kernel_tests 280
    recipe_tests
    ;;
  measure)
    # the five ratios (summary.json) with the output-gate rows beside them, no tile sweep
    t0=$SECONDS
    timeout ${SPEED_TIMEOUT:-300} python benchmarks/attention_speed.py \
      --shapes 8x1024,1x65536,2x4096 --check-max-tokens 8192 \
      --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed|hybrid gate|hybrid pieces gate)( fwd)?$" \
      --out "$R/speed" > "$R/speed.log" 2>&1
    grep -A8 '"layer_vs_teacher_T1k"' "$R/speed/summary.json" | head -12
    grep -E "hybrid gate|pieces gate" "$R/speed/attention_speed.md" | head -8
    step "ratios and gate rows"
    # the layer against fq held by the forward's programs and the call before the fold
    anatomy 150 layer,layer-hold-fq,layer-unfolded
    t0=$SECONDS
    timeout 80 python benchmarks/profile_hybrid.py --shapes 8x1024 --host --no-denominator \
      --out "$R/profile.json" > "$R/profile.log" 2>&1
    grep "^==" "$R/profile.log" | head -8
    step "host profile"
    ;;
  options)
    # the forward's options of sessions 22-23, each against the layer (predictions:
    # benchmarks/README.md, session 23)
    anatomy 330 layer,layer-phi-rcp,layer-phi32,layer-w-in-kernel,layer-hold-fq,layer-hold-fq-rcp
    ;;
  forward)
    # session 22's changes (~6 min): the q map inside the no-grad forward's _fwd
    # (KernelConfig.map_q_forward) tested against the map's kernel and the folded call, the
    # gate and option tests beside it, the fold's peak (the saved tensors released); the
    # layer at 8 x 1k with the q map in _fwd and without, and at other state spacings
    kernel_tests 200 "q_map or maps_folded or output_gate or options_give or folded_call_peaks"
    anatomy 240 layer,layer-map-q,layer-map-q-fwd128x32,layer-cs64,layer-fwd-cs64
    ;;
  pair)
    HEDGECATS_TEST_SWITCHES=feature_map.kernels.RECIPROCAL_SOFTMAX=True \
      kernel_tests 150 "feature_map or maps_folded or walking or options_give"
    t0=$SECONDS
    timeout 90 python benchmarks/phi_bound.py --shape 8x1024 --out "$R/phi_bound" \
      > "$R/phi_bound.log" 2>&1
    tail -8 "$R/phi_bound.log"
    step "phi bound"
    anatomy 260 layer,layer-phi-rcp,layer-walk1-tma,layer-fwd-tma,layer-fwd-tma-walk1-tma
    ;;
  defaults)
    # the ratios first, the tests last (a call cut short keeps what ran)
    t0=$SECONDS
    timeout ${SPEED_TIMEOUT:-250} python benchmarks/attention_speed.py \
      --shapes ${SPEED_SHAPES:-8x1024,1x65536,2x4096} --check-max-tokens 8192 \
      --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" \
      --out "$R/speed" > "$R/speed.log" 2>&1
    grep -A8 '"layer_vs_teacher_T1k"' "$R/speed/summary.json" | head -12
    step "ratios"
    t0=$SECONDS
    timeout 60 python benchmarks/phi_bound.py --shape 8x1024 --out "$R/phi_bound" \
      > "$R/phi_bound.log" 2>&1
    cut -c1-90 "$R/phi_bound.log"
    step "phi bound"
    [ -n "${SKIP_ANATOMY:-}" ] || anatomy 100 layer,layer-grid-div
    [ -n "${SKIP_TESTS:-}" ] || \
      kernel_tests 90 "maps_folded or walking or folded_call or feature_map_module"
    ;;
  occupancy)
    # session 25: `_fwd` with more programs a multiprocessor (the LA output parked through the
    # window's loop, its registers capped, one stage) and the maps' weights rounded in the
    # walking pair, each against the layer; the T1k ratios with the defaults and with those
    # candidates (one run each, here); their GPU tests; `_fwd`'s time split by branch
    anatomy ${ANATOMY_TIMEOUT:-270} \
      layer,layer-park-r168-s1,layer-w-in-kernel,layer-park-r168-bn16,layer-park-r128-s1,$(
      )layer-park-r128-bm128
    for run in base cand; do
      t0=$SECONDS
      extra=()
      [ $run = cand ] && extra=(--switches "feature_map.kernels.WEIGHTS_IN_KERNEL='walk'" \
        --tiles "${CAND_TILES:-park_la=True,fwd_maxnreg=168,fwd_stages=1}")
      timeout ${SPEED_TIMEOUT:-75} python benchmarks/attention_speed.py --shapes 8x1024 \
        --check-max-tokens 8192 --cases "^(teacher|hybrid fixed)( fwd)?$" "${extra[@]}" \
        --out "$R/speed-$run" > "$R/speed-$run.log" 2>&1
      grep -E "^B= 8 T=  1024 (teacher|hybrid fixed)" "$R/speed-$run.log" | cut -c1-100
      grep -A4 '"layer_vs_teacher_T1k"' "$R/speed-$run/attention_speed.json" | head -5
      step "speed $run"
    done
    [ -n "${SKIP_TESTS:-}" ] || kernel_tests 90 "(options_give and park) or walking"
    t0=$SECONDS
    timeout 50 python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default \
      --branches hybrid,swa,la --out "$R/split" > "$R/split.log" 2>&1
    grep -A6 "forward" "$R/split/kernel_anatomy.md" | head -9
    step "branch split"
    ;;
  bisect-gate)
    # session 25's candidates (triton_hybrid.PARKED_FORWARD as DEFAULT_FORWARD, triton_phi.
    # WEIGHTS_IN_KERNEL "walk"): the output gate's test read different outputs on two
    # identical calls with both on (call 2). That test and the one telling a race from a read
    # of memory nobody wrote (clean twice, then poisoned: test_the_layer_reads_no_memory_
    # nobody_wrote) with the defaults, each on alone, both, and the pair on one program a
    # block; then the fold's and walk's tests
    PARKED=$(parked_forward) || exit 1
    for sw in "" "feature_map.kernels.WEIGHTS_IN_KERNEL='walk'" "hybrid.kernels.DEFAULT_FORWARD=$PARKED" \
        "hybrid.kernels.DEFAULT_FORWARD=$PARKED,feature_map.kernels.WEIGHTS_IN_KERNEL='walk'" \
        "feature_map.kernels.FORWARD_WALK=None"; do
      echo "== switches: ${sw:-(defaults)}"
      HEDGECATS_TEST_SWITCHES="$sw" timeout ${BISECT_TIMEOUT:-75} python -m pytest -q -m gpu \
        -p no:cacheprovider tests/test_triton_kernels.py -k "output_gate or nobody_wrote" \
        -n 4 2>&1 | grep -E "passed|failed|^FAILED|^E  .*(differ|assert|retried)" | cut -c1-200
    done
    [ -n "${SKIP_TESTS:-}" ] || kernel_tests 100 "maps_folded or walking"
    ;;
  parked)
    # the candidates as defaults (once bisect-gate has cleared them): issue 11's five ratios
    # with them (attention_speed --switches: DEFAULT_FORWARD itself, which D >= 128 bf16 alone
    # take, as it would be the default), then the kernel tests with the same switches
    CANDIDATES="hybrid.kernels.DEFAULT_FORWARD=$(parked_forward),feature_map.kernels.WEIGHTS_IN_KERNEL='walk'" \
      || exit 1
    t0=$SECONDS
    timeout ${SPEED_TIMEOUT:-250} python benchmarks/attention_speed.py \
      --shapes ${SPEED_SHAPES:-8x1024,1x65536,2x4096} --check-max-tokens 8192 \
      --cases "^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$" \
      --switches "$CANDIDATES" --out "$R/speed" > "$R/speed.log" 2>&1
    grep -A8 '"layer_vs_teacher_T1k"' "$R/speed/summary.json" | head -12
    step "ratios"
    [ -n "${SKIP_TESTS:-}" ] || HEDGECATS_TEST_SWITCHES="$CANDIDATES" \
      kernel_tests ${KERNEL_TESTS_TIMEOUT:-250}
    ;;
  memory)
    # session 22's second call (~6 min): the fold's memory (the saved branches released, the
    # maps' dx written over the kernel's dq / dk) - its peak test with the fold and q-map
    # tests and session 23's held fq (KernelConfig.hold_fq), the peak taken apart by allocation site (fold_memory.py) - then the recipes
    # through `hedgecats pipeline` (the training backward releases its saved tensors)
    kernel_tests 150 "q_map or maps_folded or folded_call_peaks or output_gate or held_fq"
    t0=$SECONDS
    timeout 90 python benchmarks/fold_memory.py --shape 1x8192 \
      --out "$R/fold_memory.json" > "$R/fold_memory.log" 2>&1
    tail -40 "$R/fold_memory.log"
    step "fold memory"
    recipe_tests
    ;;
  *)
    echo "usage: bash benchmarks/validate_gpu.sh tests|measure|options|forward|pair|defaults|occupancy|parked|bisect-gate|memory" >&2
    exit 2
    ;;
esac
cd "$OUT" && tar czf r.tgz r && rm -rf r
