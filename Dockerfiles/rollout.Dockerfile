# syntax=docker/dockerfile:1
# kuberl/kuberl-rollout: a pinned SGLang image with kuberl's rollout service added. One image for
# both containers of a rollout pod: the SGLang server (`python3 -m sglang.launch_server ...`, set by
# the chart) and the kuberl rollout worker (the entry point, `kuberl serve rollout ...`); the chart
# also runs weight-sync on it when weight-sync relays over NCCL, so that both ends of the NCCL group
# run SGLang's PyTorch and NCCL.
# SGLang brings its own CUDA, PyTorch and transformers; kuberl is added without replacing them
# (`pip check` fails the build on a conflict). Build from the repository root:
#   docker build -f Dockerfiles/rollout.Dockerfile -t kuberl/kuberl-rollout:0.1.0 .

# The tag is SGLang's own: its release workflow (sgl-project/sglang
# .github/workflows/_docker-build-and-publish.yml, called by release-docker.yml with a tag_config)
# builds docker/Dockerfile with CUDA_VERSION=13.0.x as the "cu130" lane, tagged v<version>-cu130.
# The CUDA 12 ("cu129") lane was retired in sglang PR #38404 (v0.5.19 was its last release), and
# the sglang 0.5.23 wheel requires torch==2.14.1, whose PyPI wheel is built for CUDA 13.0
# (cuda-toolkit 13.0.3): so GPU nodes need an NVIDIA driver of the 580 series or newer. No digest
# is pinned: that workflow pushes by digest and keeps it in a job output, not in the repository;
# pin `@sha256:...` here once the digest has been read from the registry you pull from.
# tests/helm/test_dockerfiles.py checks this tag against the installed sglang wheel's metadata.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130

FROM ${SGLANG_IMAGE}
LABEL org.opencontainers.image.title="kuberl-rollout" \
      org.opencontainers.image.description="SGLang server and the kuberl rollout service" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.kuberl.cuda="13.0" \
      io.kuberl.nvidia-driver-min="580"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY Dockerfiles/constraints.txt /src/Dockerfiles/constraints.txt
COPY pyproject.toml setup.py README.md LICENSE /src/
COPY services /src/services
COPY protos /src/protos
# kuberl's own package without dependencies, then only the dependencies SGLang does not ship,
# pinned (google-crc32c: the weight-sync client's chunk checks, which rollout and, with a GPU,
# the chart's weight-sync pod import; peft: a LoRA job's adapter folders for SGLang); torch,
# transformers and safetensors stay SGLang's.
RUN python3 -m pip install --no-cache-dir --no-deps . \
    && python3 -m pip install --no-cache-dir --constraint Dockerfiles/constraints.txt \
        grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        protobuf==7.36.2 prometheus-client==0.26.0 httpx==0.28.1 google-crc32c==1.9.0 \
        peft==0.21.2 \
    && python3 -m pip check \
    && rm -rf /src \
    && groupadd --gid 10001 kuberl \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kuberl --shell /usr/sbin/nologin kuberl
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KUBERL_LOG_FORMAT=json \
    HOME=/home/kuberl
USER 10001:10001
WORKDIR /home/kuberl
EXPOSE 30000 50060 9110
ENTRYPOINT ["kuberl"]
CMD ["--help"]
