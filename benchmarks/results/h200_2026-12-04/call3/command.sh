#!/bin/bash
# session 17, call 3 (trees: for c in 8e7ee00 83529a4 e631755 3aaab88; do mkdir -p .testbed/trees/$c && git archive $c src benchmarks/attention_speed.py benchmarks/profile_hybrid.py | tar x -C .testbed/trees/$c; done): the layer's host time across versions (call 2 read 2.789 ms per fwd + bwd
# at 8 x 1k against session 14's 2.264): each version's own profile_hybrid.py --host on its own
# src (8e7ee00: session 14's reading; 83529a4: session 15's end; e631755: + FastLaunch's
# addresses; 3aaab88: session 16's end; HEAD: the fused backward by default), two rounds in
# turn; then HEAD's host breakdown. Beside the compile phase: the GPU test two calls cut
source benchmarks/gpu_env.sh || exit 1
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --format=%h; nproc; lscpu | grep "Model name"; } > $R/gpu.txt
TREES="8e7ee00 83529a4 e631755 3aaab88"
run_tree() {  # $1 tree (or HEAD), then profile_hybrid args
  t=$1; shift
  if [ $t = HEAD ]; then python benchmarks/profile_hybrid.py "$@"
  else mkdir -p /tmp/pk_$t && ln -sfn $PWD/.testbed/trees/$t/src /tmp/pk_$t/hedgecats
    PYTHONPATH=/tmp/pk_$t:/tmp/site:$PWD/tests python .testbed/trees/$t/benchmarks/profile_hybrid.py "$@"; fi
}
s=$SECONDS
GPU_TESTS_TIMEOUT=280 GPU_TESTS_WORKERS=2 OUT=$R/t1 bash benchmarks/gpu_tests.sh "tests/test_triton_kernels.py::test_routing_head_dim_80_goes_to_the_pieces" > /dev/null 2>&1 &
for t in $TREES HEAD; do (timeout 200 bash -c "$(declare -f run_tree); run_tree $t --shapes 8x1024 --no-denominator" > $R/warm_$t.log 2>&1) & done
wait; echo "warm + test $((SECONDS-s)) s"; tail -1 $R/t1/gpu_tests.log
for round in 1 2; do for t in $TREES HEAD; do
  timeout 60 bash -c "$(declare -f run_tree); run_tree $t --shapes 8x1024 --no-denominator --host --out $R/host_${t}_$round.json" > $R/host_${t}_$round.log 2>&1
  echo "round $round $t: $(grep '^== .*host_ms' $R/host_${t}_$round.log | tr '\n' ' ')"
done; done
sed -n '/host us per call/,/^== .*host profile/p' $R/host_HEAD_2.log | head -60
echo "all $((SECONDS-s)) s"
cd $OUT && tar czf r.tgz r && rm -rf r
true
