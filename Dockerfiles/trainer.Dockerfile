# syntax=docker/dockerfile:1
# kuberl/kuberl-trainer: CUDA PyTorch, DeepSpeed and kuberl's trainer, run by the chart as
# `torchrun ... -m kuberl.cli serve trainer --config /etc/kuberl/job.yaml` on every node.
# PyTorch's Linux wheels on PyPI carry the CUDA 12 runtime, cuDNN and NCCL, so the base needs no
# CUDA toolkit; the GPU driver comes from the node. DeepSpeed ops are not pre-built (kuberl uses a
# torch optimizer), so no compiler is needed either. Build from the repository root:
#   docker build -f Dockerfiles/trainer.Dockerfile -t kuberl/kuberl-trainer:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    DS_BUILD_OPS=0
RUN python -m venv /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH
WORKDIR /src
RUN pip install --no-cache-dir torch==2.13.0
COPY Dockerfiles/constraints.txt /src/Dockerfiles/constraints.txt
COPY pyproject.toml setup.py README.md LICENSE /src/
COPY services /src/services
COPY protos /src/protos
RUN pip install --no-cache-dir --constraint Dockerfiles/constraints.txt ".[trainer]" \
    && pip check

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kuberl-trainer" \
      org.opencontainers.image.description="kuberl trainer: PyTorch (CUDA), DeepSpeed, torchrun" \
      org.opencontainers.image.licenses="Apache-2.0"
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
