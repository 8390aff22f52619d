# syntax=docker/dockerfile:1
# kuberl/kuberl-trainer: CUDA PyTorch, DeepSpeed, kuberl's trainer and the experiment trackers
# of `job.tracking` (the `tracking` extra), run by the chart as
# `torchrun ... -m kuberl.cli serve trainer --config /etc/kuberl/job.yaml` on every node.
# PyTorch's Linux x86_64 wheel on PyPI carries the CUDA 13.0 runtime (cuda-toolkit 13.0.3), cuDNN
# and NCCL (nvidia-*-cu13), so the base needs no CUDA toolkit, but GPU nodes need an NVIDIA driver
# of the 580 series or newer (CUDA 13.0's floor). DeepSpeed ops are not pre-built (kuberl uses a
# torch optimizer), so no compiler is needed either. Build from the repository root:
#   docker build -f Dockerfiles/trainer.Dockerfile -t kuberl/kuberl-trainer:0.1.0 .
# The CPU variant (the chart's trainer pod in `make image-test`, CPU-only clusters):
#   docker build -f Dockerfiles/trainer.Dockerfile --build-arg TORCH_CUDA=cpu \
#     --build-arg NVIDIA_DRIVER_MIN=none \
#     --build-arg "TORCH_PIP_ARGS=--index-url https://download.pytorch.org/whl/cpu" \
#     -t kuberl/kuberl-trainer:0.1.0-cpu .

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# Where torch comes from: PyPI (CUDA 13.0) by default; TORCH_CUDA and NVIDIA_DRIVER_MIN label what
# was installed (tests/helm/test_dockerfiles.py checks them against torch's wheel metadata).
ARG TORCH_PIP_ARGS=""
ARG TORCH_REQUIREMENT=torch==2.13.0
ARG TORCH_CUDA=13.0
ARG NVIDIA_DRIVER_MIN=580

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_PIP_ARGS
ARG TORCH_REQUIREMENT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    DS_BUILD_OPS=0
RUN python -m venv /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH
WORKDIR /src
# The requirement is the pinned TORCH_REQUIREMENT; TORCH_PIP_ARGS splits into pip options.
# hadolint ignore=SC2086,DL3013
RUN pip install --no-cache-dir ${TORCH_PIP_ARGS} ${TORCH_REQUIREMENT}
COPY Dockerfiles/constraints.txt /src/Dockerfiles/constraints.txt
COPY pyproject.toml setup.py README.md LICENSE /src/
COPY services /src/services
COPY protos /src/protos
RUN pip install --no-cache-dir --constraint Dockerfiles/constraints.txt ".[trainer,tracking]" \
    && pip check

FROM ${PYTHON_IMAGE}
ARG TORCH_CUDA
ARG NVIDIA_DRIVER_MIN
LABEL org.opencontainers.image.title="kuberl-trainer" \
      org.opencontainers.image.description="kuberl trainer: PyTorch, DeepSpeed, torchrun" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.kuberl.cuda="${TORCH_CUDA}" \
      io.kuberl.nvidia-driver-min="${NVIDIA_DRIVER_MIN}"
# InfiniBand verbs for NCCL's IB transport (unused, and harmless, on Ethernet-only nodes).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1=44.0-2 ibverbs-providers=44.0-2 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 kuberl \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kuberl --shell /usr/sbin/nologin kuberl
COPY --from=build /opt/kuberl /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KUBERL_LOG_FORMAT=json \
    DS_BUILD_OPS=0
USER 10001:10001
WORKDIR /home/kuberl
EXPOSE 50054 9104 29500
ENTRYPOINT ["torchrun"]
CMD ["--help"]
