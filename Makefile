# areal_jobs: every entry point. `make run` and `make test` install what they need on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OVERRIDES ?=
EXTRAS := train,slurm,reward,viz,dev
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install system-packages run test test-gpu test-unit lint format bench clean ci warmstart

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
run: install
	$(PY) -m launch.local $(OVERRIDES)

# Rebuild the committed built-in model (tokenizer + tiny Qwen2 + supervised warm start).
warmstart: install
	$(PY) -m areal_jobs.data.tiny_model --out areal_jobs/data/builtin_model

# CPU test suite (unit + integration against real SGLang, Megatron-Core, SLURM, ZeroMQ, sandbox).
test: install system-packages
	$(PY) -m pytest -m "not gpu" tests

test-unit: install
	$(PY) -m pytest -m "not gpu" tests/unit

test-gpu: install
	$(PY) -m pytest -m gpu tests/gpu

lint: install
	$(PY) -m ruff check areal_jobs launch tests bench requirements
	$(PY) -m ruff format --check areal_jobs launch tests bench requirements

format: install
	$(PY) -m ruff format areal_jobs launch tests bench requirements

bench: install
	$(PY) -m bench $(OVERRIDES)

ci: lint test

# ---------------------------------------------------------------- SLURM job suite (docs/slurm.md)
# make submit EXP=math_qwen2_1p5b OVERRIDES="cluster.account=rl algo.max_staleness=8"
# make render EXP=...        same config, launch.dry_run=true: writes <run dir>/job.sbatch, no sbatch
# make status JOB=<id>       make cancel JOB=<id>
# make golden                re-render the committed reference scripts sbatch/*.sbatch
.PHONY: submit render golden status cancel
SUBMIT_ARGS = $(if $(EXP),experiment=$(EXP)) $(OVERRIDES)

submit: install
	$(PY) -m launch.submit $(SUBMIT_ARGS)

render: install
	$(PY) -m launch.submit $(SUBMIT_ARGS) launch.dry_run=true

golden: install
	$(PY) -m launch.golden

# ops commands: standard library only (launch/slurm.py), no venv needed, nothing installed
status cancel:
	@test -n "$(JOB)" || { echo "usage: make $@ JOB=<job id printed by make submit>" >&2; exit 2; }
	@$(PYTHON) -m launch.slurm $@ $(JOB)
# ---------------------------------------------------------------- end of the SLURM job suite

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
