# Two commands do everything on a fresh machine (see README.md):
#   make demo   - set up, then train a tiny Llama on 4 CPU processes (NCCL on GPUs)
#   make test   - set up, then run the linter and the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench lint clean

$(STAMP): requirements.txt requirements-dev.txt setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=24" "setuptools>=68" wheel
	$(PY) -m pip install -r requirements-dev.txt
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(PY) -m ruff check dist_optim plugins tests bench recipes

test: setup lint
	$(PY) -m pytest -q

demo: setup
	$(PY) -m recipes.demo

bench: setup
	$(PY) bench/bench_step.py

clean:
	rm -rf $(VENV) runs
