#!/usr/bin/env bash
# Every GPU figure and GPU test in one run, for a lent GPU machine whose time is scarce:
#
#   1. trainer MFU (benchmarks/trainer_mfu.py: stock DeepSpeed ZeRO-2 and kuberl's step, with a
#      torch.profiler table of one step of each),
#   2. the GPU tests (tests/gpu: CUDA IPC, weight-sync's GPU transports, the offloaded reference,
#      CUDA IPC into SGLang's consumer code, `kuberl run --device cuda`),
#   3. GAE, the CUDA-IPC weight-sync update and the torch rollout engine on the GPU,
#   4. more trainer MFU settings (micro-batch token budget, activation checkpointing), while time
#      is left.
#
# Each step has its own time limit and all of them share a deadline ($GPU_CHECKS_SECONDS, default
# 540), so one hang costs one step. Logs go to $OUT (default runs/gpu): six files, the most a
# device call brings back is eight. Wheels from benchmarks/gpu_wheels.sh are installed first
# when .whl/ exists (the GPU machine has torch but no DeepSpeed and no network).
#
#     bash benchmarks/gpu_wheels.sh                 # here: fill .whl/
#     bash benchmarks/gpu_checks.sh                 # there, with .whl carried
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/runs/gpu}
mkdir -p "$OUT"
WHL=${KUBERL_GPU_WHEELS:-.whl}
BUDGET=${GPU_CHECKS_SECONDS:-540}
T0=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TOKENIZERS_PARALLELISM=false

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv || true
  if [ -d "$WHL" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$WHL"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/$WHL/sg
    [ -x "$WHL/redis-server" ] && export KUBERL_REDIS_SERVER=$PWD/$WHL/redis-server
  fi
  "$PY" -c 'import torch, transformers, deepspeed, grpc, kuberl.cli
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
print("transformers", transformers.__version__, "deepspeed", deepspeed.__version__,
      "grpc", grpc.__version__)'
} >"$OUT/env.log" 2>&1 || {
  cat "$OUT/env.log"
  exit 1
}
cat "$OUT/env.log"

# step LOG LIMIT COMMAND...: run COMMAND appending to $OUT/LOG, within LIMIT seconds and the
# deadline; print its status and the last lines of its output.
step() {
  local log=$1 limit=$2 left
  shift 2
  left=$((BUDGET - ($(date +%s) - T0) - 10))
  if [ "$left" -lt 30 ]; then
    echo "== skipped (deadline): $*"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  local start
  start=$(date +%s)
  echo "== $* (limit ${limit}s)" >>"$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
  echo "== rc=$? $(($(date +%s) - start))s: $*"
  tail -n 2 "$OUT/$log" | cut -c1-2500
}

step mfu.log 240 "$PY" benchmarks/trainer_mfu.py --steps 5 --warmup 2 --profile-dir "$OUT"
step tests.log 260 "$PY" -m pytest -p no:cacheprovider -v -rs --timeout 240 tests/gpu
step bench.log 60 "$PY" benchmarks/gae.py --sizes 1024,8192,32768
step bench.log 90 "$PY" benchmarks/weight_sync.py --engines 1 --transports shm --repeat 2 --gpu
step bench.log 90 "$PY" benchmarks/rollout_engine.py --no-cpu
step mfu.log 100 "$PY" benchmarks/trainer_mfu.py --variants kuberl --micro-batch-seqs 8
step mfu.log 100 "$PY" benchmarks/trainer_mfu.py --variants kuberl --micro-batch-seqs 16 \
  --gradient-checkpointing
echo "== done in $(($(date +%s) - T0))s"
