# kuberl developer commands. `make test` and `make demo` work on a fresh machine: they create
# .venv and install everything first (torch's CPU wheel before the rest, so no CUDA build is pulled).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kuberl-setup
EXTRAS := buffer,reward,rollout,trainer,weight-sync,local,tracking,dev

.PHONY: setup test lint mypy format protos demo chaos bench images image-test clean help

help:
	@echo "make setup   - create .venv and install kuberl with every extra (idempotent)"
	@echo "make test    - lint, type-check and run the whole test suite"
	@echo "make lint    - ruff (lint + format check) and mypy on services/"
	@echo "make format  - apply ruff's formatting and fixes"
	@echo "make protos  - regenerate the gRPC Python code from protos/"
	@echo "make demo    - a real local RL job that learns (about 2-6 min on 2 CPU cores)"
	@echo "make chaos   - the long fault-injection run (31 faults, 10+ min; docs/reliability.md)"
	@echo "make bench   - every CPU benchmark, then docs/benchmarks.md (15-25 min)"
	@echo "make images  - build the images here with buildah (root; docs/images.md)"
	@echo "make image-test - build them, then run the chart's pods from them through a small job"

$(STAMP): pyproject.toml setup.py tests/helm/fetch-prometheus.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PY) -m pip install --quiet --no-deps sglang==0.5.23 msgspec==0.22.0
	tests/helm/fetch-prometheus.sh $(VENV)/bin
	@touch $(STAMP)

setup: $(STAMP)

# lint and mypy assume `make setup` has run (test does it first); they never install anything,
# so several can run at once.
lint:
	$(VENV)/bin/ruff check services tests benchmarks protos/generate.py
	$(VENV)/bin/ruff format --check services tests benchmarks protos/generate.py
	@$(MAKE) --no-print-directory mypy

# mypy cannot map services/weight-sync to kuberl.weight_sync, so it checks a temporary tree of
# symlinks that spells the installed package layout (kuberl/common -> services/common, ...).
mypy:
	@tree=$$(mktemp -d) && mkdir $$tree/kuberl && \
	for entry in services/*; do ln -s $$PWD/$$entry $$tree/kuberl/$$(basename $$entry | tr - _); done && \
	ln -s $$PWD/protos/kuberl $$tree/kuberl/api && \
	(cd $$tree && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.mypy_cache -p kuberl); rc=$$?; rm -rf $$tree; exit $$rc

format: setup
	$(VENV)/bin/ruff check --fix services tests benchmarks protos/generate.py
	$(VENV)/bin/ruff format services tests benchmarks protos/generate.py

# .venv/bin first on PATH: the dashboard tests find the prometheus and promtool fetched there.
test: setup
	@$(MAKE) --no-print-directory lint
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n 2

protos: setup
	$(PY) protos/generate.py

# The end-to-end demo (docs/local.md): every service as its own process, live progress, a run
# folder under runs/ with summary.json and plots. About 2-6 minutes on a 2-core CPU (141 s idle
# in the latest recorded run, up to 354 s under load: docs/local.md), plus setup on a fresh clone.
demo: setup
	$(PY) -m kuberl.cli run examples/demo.yaml

# The long chaos run (docs/reliability.md): the demo job under 31 seeded faults, chaos.json in
# its run folder.
chaos: setup
	$(PY) -m kuberl.cli run examples/chaos.yaml --chaos long --chaos-seed 0

# Every CPU benchmark in its own process, then docs/benchmarks.md (benchmarks/report.py).
bench: setup
	$(PY) benchmarks/report.py

# The images built here without Docker or a registry (docs/images.md): buildah on a debootstrapped
# Debian base, torch from the local wheel directory; an image whose inputs did not change is
# reused. Needs root and `apt-get install buildah debootstrap iproute2`.
images: setup
	$(PY) -m tests.images.build

# The chart's pods (Redis, buffer, reward, weight-sync, rollout, trainer and the `helm test` pod)
# run from those images, each in its own network namespace, through a small CPU job
# (tests/images/test_chart_pods.py; `make test` skips it).
image-test: setup
	KUBERL_IMAGE_TEST=1 $(PY) -m pytest -q -p no:xdist -s tests/images

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
