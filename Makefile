# te_v2_executor: set-up, tests, the main job. `make help` lists the targets.
# PY is the interpreter the targets run; `make install` makes it a fresh virtualenv. On a machine
# whose Python already has torch, Thunder and TE (the GPU kit), pass PY=python3.
VENV ?= .venv
PY ?= $(VENV)/bin/python

.PHONY: help install test test-gpu test-distributed fuzz explain bench bench-ddp bench-hf lint format

help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install: ## create $(VENV) and install the package with its test and dev extras (add [te] on a GPU machine)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,dev]"

test: ## the whole suite: CPU tests run, GPU tests are collected and skipped with a reason without CUDA+TE
	$(PY) -m pytest -q -rs

test-gpu: ## the GPU suite (needs CUDA and TransformerEngine); prints kernel counts and saved bytes
	$(PY) -m pytest -q -rA -s -m gpu tests/gpu

test-distributed: ## the 2-GPU suite: torchrun, DDP / FSDP / torch DDP / FSDP2 around thunderfx, amax all-reduce and GEMM counts (needs 2 GPUs with TE; on one GPU, one NCCL rank)
	$(PY) -m pytest -q -rA -s -m distributed tests/distributed

fuzz: ## differential fuzzing for 10 minutes: random programs through te_v2 vs eager and its kernels' eager emulation; prints each failure as a shrunk standalone script
	$(PY) -m tests.fuzz --seconds 600

explain: ## the main job: compile a small frozen-base model, print per linear what runs and what is saved
	$(PY) -m te_v2_executor

bench: ## side-by-side benchmark on a GPU with TE: markdown tables on stdout, JSON and PNGs in results/ (its ddp suite needs 2 GPUs, skipped on 1; its hf suite needs the [bench] extra)
	$(PY) -m benchmarks.run --suite all --out results

bench-hf: ## only the Hugging Face Llama suite, each variant in its own process: table on stdout, JSON in results/hf/
	$(PY) -m benchmarks.hf --out results/hf

bench-ddp: ## the multi-GPU suites (torchrun): FSDP2 scaling of a HF Llama on 1, 2 and 4 GPUs (results/scaling/), then the 2-GPU DDP MLP suite (results/ddp/)
	$(PY) -m benchmarks.scaling --out results/scaling
	$(PY) -m benchmarks.run --suite ddp --out results/ddp

lint: ## ruff check and format check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: ## ruff fix and format
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
