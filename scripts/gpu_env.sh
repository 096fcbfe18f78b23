# Sourced by the GPU-machine scripts (CI has no GPU), from the repository root: installs the
# carried wheels (.whl/) into /tmp/site once per machine (a lock and a marker, so that scripts
# started side by side in one call install once and never import a half-installed package),
# links src/ as the hedgecats package and exports PYTHONPATH.
#   source scripts/gpu_env.sh || exit 1
(
  flock 9
  if [ ! -f /tmp/site/.hedgecats-wheels ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.hedgecats-wheels
  fi
) 9>/tmp/hedgecats-wheels.lock || return 1
mkdir -p /tmp/pkg && ln -sfn "$PWD/src" /tmp/pkg/hedgecats
export PYTHONPATH=/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
