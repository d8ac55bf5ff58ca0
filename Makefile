# Everything a fresh CPU machine needs: `make demo` runs the CPU demo, `make test` runs the tests.
# Both create .venv first (torch 2.13.0 CPU build, then the rest pinned by constraints-cpu.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two pytest-xdist workers, each test file whole in one worker (tests/conftest.py schedules them): the launches'
# import-bound start-ups and the single-process tests then overlap on a 2-core machine. PYTEST_WORKERS=0: serial.
PYTEST_WORKERS ?= 2

.PHONY: setup test demo style quality

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: setup
	OMP_NUM_THREADS=1 PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/cpu_demo.sh

style: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

quality: setup
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .
