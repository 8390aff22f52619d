#!/usr/bin/env bash
# Every GPU figure and GPU test in one run, for a lent GPU machine whose time is scarce:
#
#   1. the GPU tests (tests/gpu: CUDA IPC, weight-sync's GPU transports, the offloaded reference,
#      CUDA IPC into SGLang's consumer code; the chunked logprob head on a 150k vocabulary),
#   2. `kuberl run --device cuda` (the demo, shortened as tests/gpu/test_local_run_cuda.py runs
#      it), with the lines of its service logs that say what happened: not yet repeated since
#      the CUDA IPC handle fix,
#   3. trainer MFU (benchmarks/trainer_mfu.py: stock DeepSpeed ZeRO-2 and kuberl's step) at the
#      fastest settings measured (micro-batch 16, selective activation checkpointing,
#      trainer.compile_logprobs and trainer.compile_model), with a torch.profiler table of one
#      step of each,
#   4. the chunked logprob head (Qwen2-0.5B's head, bf16) and the CUDA-IPC weight-sync update,
#   5. what was measured on 2026-11-27 already (the eager step, each compile alone), then GAE
#      and the torch rollout engine, while time is left.
#
# Each step has its own time limit and all of them share a deadline ($GPU_CHECKS_SECONDS, default
# 540), so one hang costs one step. Logs go to $OUT (default runs/gpu): seven files, the most a
# device call brings back is eight. Wheels from benchmarks/gpu_wheels.sh are installed first
# when .whl/ exists (the GPU machine has torch but no DeepSpeed and no network).
#
#     bash benchmarks/gpu_wheels.sh                 # here: fill .whl/
#     bash benchmarks/gpu_checks.sh                 # there, with .whl carried
#     python benchmarks/report.py --merge-gpu-run DIR   # here: DIR holds what came back
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
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv || true
  if [ -d "$WHL" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$WHL"/*.whl || exit 1
    # kuberl itself from this checkout, never from a wheel built earlier: a stale wheel once
    # made a whole GPU run measure the code of the commit before the fix it was meant to test.
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --no-cache-dir --upgrade --target /tmp/site . || exit 1
    rm -rf build
    export PYTHONPATH=/tmp/site:$PWD/$WHL/sg
    # The device copy does not keep the executable bit.
    if [ -f "$WHL/redis-server" ]; then
      install -m 755 "$WHL/redis-server" /tmp/redis-server
      export KUBERL_REDIS_SERVER=/tmp/redis-server
    fi
  fi
  git log -1 --format='checkout %h %s' 2>/dev/null | cut -c1-120
  "$PY" -c 'import torch, transformers, deepspeed, grpc, kuberl.cli
print("kuberl from", kuberl.cli.__file__)
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

# The tests first (quick; they say whether the GPU paths work at all: the CPU-compiled variant of
# test_trainer_logprobs.py takes minutes there, so only its GPU test runs), `kuberl run --device
# cuda` separately so that its service logs can be shown when it fails.
step tests.log 120 "$PY" -m pytest -p no:cacheprovider -v -rs --timeout 110 --tb=short tests/gpu \
  tests/unit/test_trainer_logprobs.py::test_a_150k_vocabulary_in_bf16_never_materialises_full_logits_on_gpu \
  --deselect \
  tests/gpu/test_local_run_cuda.py::test_kuberl_run_on_one_gpu_loads_versions_into_the_engine_by_cuda_ipc
grep -E "^(FAILED|ERROR)|^E  " "$OUT/tests.log" | cut -c1-300 | head -n 20
RUN=/tmp/kuberl-gpu-run
rm -rf "$RUN" && mkdir -p "$RUN"
JOB=$("$PY" -c 'import sys; from pathlib import Path
from tests.e2e.test_local_run import _short_job
print(_short_job(Path(sys.argv[1]), warm_start=False))' "$RUN")
step run.log 200 "$PY" -m kuberl.cli run "$JOB" --device cuda --run-dir "$RUN/run" --plain
for f in "$RUN"/run/logs/*.log; do
  echo "== $f"
  grep -E "update_loaded|Traceback|Error|error" "$f" | tail -n 12 | cut -c1-400
done >>"$OUT/run.log" 2>&1
grep -h "update_loaded" "$RUN"/run/logs/rollout-0.log 2>/dev/null | cut -c1-200 | tail -n 5
# The fastest settings measured (2026-11-27, H100: 37.6%), with stock in the same run and a
# torch.profiler table of one step of each: the profile of the fused step was still missing.
step mfu.log 200 "$PY" benchmarks/trainer_mfu.py --steps 3 --warmup 1 --micro-batch-seqs 4 \
  --kuberl-micro-batch-seqs 16 --chunk 16384 --gradient-checkpointing selective \
  --compile-logprobs --compile-model --profile-dir "$OUT"
step bench.log 90 "$PY" benchmarks/trainer_logprobs.py --device cuda --dtype bfloat16 \
  --tokens 8192 --vocab 151936 --hidden 896 --chunk 16384
step bench.log 60 "$PY" benchmarks/weight_sync.py --engines 1 --transports shm --repeat 2 --gpu
grep -E "Error|error" "$OUT/bench.log" | cut -c1-300 | tail -n 5
# Measured on 2026-11-27 (docs/benchmarks.md), again while time is left: the eager step at the
# defaults' micro-batch, then each compile alone.
step mfu.log 150 "$PY" benchmarks/trainer_mfu.py --steps 3 --warmup 1 --micro-batch-seqs 4 \
  --kuberl-micro-batch-seqs 8 --chunk 16384
step mfu.log 120 "$PY" benchmarks/trainer_mfu.py --variants kuberl --steps 3 --warmup 1 \
  --kuberl-micro-batch-seqs 8 --chunk 16384 --compile-logprobs
step mfu.log 150 "$PY" benchmarks/trainer_mfu.py --variants kuberl --steps 3 --warmup 1 \
  --kuberl-micro-batch-seqs 8 --chunk 16384 --compile-logprobs --compile-model
step bench.log 60 "$PY" benchmarks/gae.py --sizes 1024,8192,32768
step bench.log 90 "$PY" benchmarks/rollout_engine.py --no-cpu
echo "== done in $(($(date +%s) - T0))s"
