# The one entry point. `make demo` and `make test` set everything up on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
VENV_PY := $(BIN)/python
STAMP  := $(VENV)/.installed
# torch first, exactly this version: a CPU wheel of it ships with the machine (see README).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
BENCH_OUT ?= bench-results
FUZZ_EXAMPLES ?= 200
EXPERIMENT_OUT ?= experiment-results/demo
# `make wheelhouse`: the nodes' Python, the folder, the extras, what the nodes have already
PY ?= 3.12
WHEELHOUSE ?= wheelhouse
EXTRAS ?= gpu-cu13 gpu-test
LEAVE_OUT ?=
# `make gpu-check`: where its logs, JSON and summary go
OUT ?= gpu-check-results

.PHONY: help venv demo test test-unit test-component test-cluster test-hosts test-long test-gpu proto proto-check lint \
	bench fuzz experiment-demo wheelhouse gpu-wheels gpu-check clean

help:
	@echo "make demo   - set up, build a tiny model, start a local cluster, serve requests"
	@echo "make test   - set up, then the whole test suite (every tier but hosts; not the long runs)"
	@echo "make test-long - the soak's and bench scaling's short runs (a few minutes)"
	@echo "make test-hosts - emulated hosts with real sshd and Slurm (root; installs Debian packages)"
	@echo "make test-gpu - tests/gpu (each test skips with its reason where CUDA is absent)"
	@echo "make gpu-check OUT=DIR - on one NVIDIA GPU without a registry: nvidia-smi, tests/gpu, bench gpu into DIR"
	@echo "make wheelhouse PY=3.12 - pdcluster's wheels and its dependencies' (not torch) under $(WHEELHOUSE)/"
	@echo "make gpu-wheels - the wheels gpu-check needs on the lent GPU host, under .whl/ (carry it)"
	@echo "make lint   - ruff, mypy and the import rules (import-linter)"
	@echo "make proto  - regenerate the gRPC stubs from protos/*.proto"
	@echo "make bench  - benchmarks, JSON under $(BENCH_OUT)/"
	@echo "make fuzz   - the HTTP schema and gRPC fuzz tests with FUZZ_EXAMPLES examples (a long run)"
	@echo "make experiment-demo - a small experiment matrix and its report under $(EXPERIMENT_OUT)/"

$(STAMP): pyproject.toml
	test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --quiet --upgrade pip
	$(VENV_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VENV_PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

proto: $(STAMP)
	$(VENV_PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto

# The committed stubs must be exactly what `make proto` generates.
proto-check: $(STAMP)
	$(VENV_PY) scripts/proto_check.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy protos replica transfer router pdcluster scripts tests
	$(BIN)/lint-imports

# Every tier but `hosts`, `gpu` and the benchmarks' own short runs (`long`); CI runs those after this.
test: $(STAMP) proto-check
	$(BIN)/pytest -q -m "not hosts and not long and not gpu" --durations=25 $(PYTEST_ARGS)

# No set-up: a GPU node may have no venv and no registry (the venv's pytest if there is one, else $(PYTHON)'s).
test-gpu:
	$(if $(wildcard $(BIN)/pytest),$(BIN)/pytest,$(PYTHON) -m pytest) -q tests/gpu $(PYTEST_ARGS)

# Every GPU test and benchmark in one run, with timeouts, into $(OUT)/ (scripts/gpu_check.sh; PYTHON=... picks
# the interpreter). Needs no venv and no registry: a carried wheelhouse/ or .whl/ folder is installed from.
gpu-check:
	PYTHON=$(PYTHON) scripts/gpu_check.sh $(OUT)

# The wheels `make gpu-check` needs on the lent GPU host (Python 3.12, CUDA 13) less what its image already
# has (the device tool's package list, KINDS.md): about 21 MB, under the 64 MiB one call carries. Carry `.whl`.
GPU_IMAGE_HAS ?= cupy-cuda13x numpy jinja2 markupsafe safetensors tokenizers huggingface-hub hf-xet matplotlib \
	contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six packaging tqdm uvloop \
	prometheus-client transformers regex pyyaml requests urllib3 certifi charset-normalizer filelock fsspec \
	pytest pluggy iniconfig pytest-timeout httpx httpcore rich markdown-it-py mdurl pygments sympy mpmath \
	networkx cuda-bindings cuda-pathfinder cuda-core fastrlock hypothesis sortedcontainers attrs typer shellingham
gpu-wheels: $(STAMP)
	rm -rf .whl
	$(BIN)/pdcluster wheelhouse --python 3.12 --out .whl --extra gpu-cu13 gpu-test --leave-out $(GPU_IMAGE_HAS)

# For nodes without a package registry (pdcluster/cluster/wheelhouse.py): `pip install --no-index --find-links DIR`.
wheelhouse: $(STAMP)
	$(BIN)/pdcluster wheelhouse --python $(PY) --out $(WHEELHOUSE) $(if $(EXTRAS),--extra $(EXTRAS)) \
		$(if $(LEAVE_OUT),--leave-out $(LEAVE_OUT))

# the slow tier: the soak's and bench scaling's short runs, the fault matrix, whole launch cycles (minutes)
test-long: $(STAMP)
	$(BIN)/pytest -q -m long $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/pytest -q -m unit $(PYTEST_ARGS)

test-component: $(STAMP)
	$(BIN)/pytest -q -m component $(PYTEST_ARGS)

test-cluster: $(STAMP)
	$(BIN)/pytest -q -m cluster $(PYTEST_ARGS)

# emulated hosts with real sshd and Slurm: root; installs the Debian packages it needs, or skips saying why
test-hosts: $(STAMP)
	$(BIN)/pytest -q -m hosts $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/pdcluster demo --workdir .demo

bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(BIN)/pdcluster bench replica --json $(BENCH_OUT)/replica.json
	$(BIN)/pdcluster bench transfer --algo p2p --size 256MiB --ranks 2 --json $(BENCH_OUT)/transfer-p2p.json
	$(BIN)/pdcluster bench transfer --algo chain --size 256MiB --ranks 4 --json $(BENCH_OUT)/transfer-chain.json

# The suite runs these fuzz tests briefly; this is the long run (PDCLUSTER_FUZZ_SEED=S to replay one).
fuzz: $(STAMP)
	PDCLUSTER_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -q -s --timeout 3600 \
		tests/component/router_http/test_router_http_schemathesis.py tests/cluster/fuzz $(PYTEST_ARGS)
# Resumable: run it again and only unfinished cells run (FORCE=--force runs them all).
experiment-demo: $(STAMP)
	$(BIN)/pdcluster experiment run examples/experiment-demo.toml --out $(EXPERIMENT_OUT) $(FORCE)

clean:
	rm -rf $(VENV) .demo .experiment experiment-results $(BENCH_OUT) $(WHEELHOUSE) $(OUT) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
