# syntax=docker/dockerfile:1
# kuberl/kuberl: the slim image of the CPU services (buffer, reward, weight-sync) and of the Helm
# chart's `helm test` pod. Its entry point is the `kuberl` CLI; the chart runs
# `kuberl serve <service> --config /etc/kuberl/job.yaml`. Build from the repository root:
#   docker build -f Dockerfiles/kuberl.Dockerfile -t kuberl/kuberl:0.1.0 .
# Nothing secret is baked in: Redis passwords and the job file arrive at run time.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# torch's CPU build from PyTorch's CPU index; a machine without that index passes its own
# (`make images` here: --find-links to a local wheel directory and torch==2.13.0+cpu).
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ARG TORCH_REQUIREMENT=torch==2.13.0

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_PIP_ARGS
ARG TORCH_REQUIREMENT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH
WORKDIR /src
# torch's CPU build (weight-sync's snapshot transport), the version the test suite runs on.
# The requirement is the pinned TORCH_REQUIREMENT; TORCH_PIP_ARGS splits into pip options.
# hadolint ignore=SC2086,DL3013
RUN pip install --no-cache-dir ${TORCH_PIP_ARGS} ${TORCH_REQUIREMENT}
COPY Dockerfiles/constraints.txt /src/Dockerfiles/constraints.txt
COPY pyproject.toml setup.py README.md LICENSE /src/
COPY services /src/services
COPY protos /src/protos
RUN pip install --no-cache-dir --constraint Dockerfiles/constraints.txt ".[buffer,reward,weight-sync]" \
    && pip check

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kuberl" \
      org.opencontainers.image.description="kuberl buffer, reward and weight-sync services" \
      org.opencontainers.image.licenses="Apache-2.0"
# tini forwards SIGTERM (graceful drain) and reaps whatever orphan reaches pid 1 (the sandbox
# launcher already waits for every process it killed, so none should).
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 kuberl \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kuberl --shell /usr/sbin/nologin kuberl
COPY --from=build /opt/kuberl /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KUBERL_LOG_FORMAT=json
USER 10001:10001
WORKDIR /home/kuberl
EXPOSE 50051 50052 50053 9101 9102 9103
ENTRYPOINT ["tini", "--", "kuberl"]
CMD ["--help"]
