# A stand-in for the chart's official Redis image (docker.io/library/redis), for `make image-test`
# on a machine that cannot pull from a registry: Debian bookworm's redis-server on the locally
# bootstrapped base. The chart's Redis container only needs `/bin/sh`, `sed`, `redis-server` and
# `redis-cli` on PATH and runs as uid 999 (its securityContext), so nothing else is set here.
# Debian's version is not pinned: bookworm's security updates replace it.
ARG BASE_IMAGE=localhost/kuberl-base:bookworm
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/*
USER 999:999
EXPOSE 6379
CMD ["redis-server"]
