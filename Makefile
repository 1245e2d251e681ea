# Two commands do everything on a fresh machine (see README.md):
#   make demo   - set up, then train a tiny Llama on 4 CPU processes (NCCL on GPUs)
#   make test   - set up, then run the linter and the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The recipes' default text (recipes/corpus.py): three public-domain books from a pinned PyPI archive.
CORPUS := recipes/data/gutenberg/SOURCE.json

.PHONY: setup test test-gpu demo bench lint clean

# tools/check_disk.py: the pinned stack needs ~9 GiB free while it installs (a CUDA torch from PyPI);
# with less, one line says so before pip runs out of disk minutes in.
$(STAMP): requirements.txt requirements-dev.txt setup.py pyproject.toml
	$(PYTHON) tools/check_disk.py $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=24" "setuptools>=68" wheel
	$(PY) -m pip install -r requirements-dev.txt
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

$(CORPUS): recipes/corpus.py | $(STAMP)
	$(PY) -m recipes.corpus --force

setup: $(STAMP) $(CORPUS)

# ruff (rules, format, complexity <= 15: pyproject.toml) everywhere; mypy over the package.
lint: setup
	$(PY) -m ruff check dist_optim plugins tests bench recipes tools
	$(PY) -m ruff format --check dist_optim plugins tests bench recipes tools
	$(PY) -m mypy

# runs/junit.xml: the outcomes the README's support table is built from (python -m tests.helpers.support
# --junit runs/junit.xml); the run itself fails if the README's copy differs (tests/conftest.py).
# TEST_JOBS pytest processes (pytest-xdist), whole files each: the distributed tests leave part of
# a core idle (ranks wait in collectives) and the unit tests use one, so two fill the 2 cores CI
# has. Each process starts its own pools of 4 and 2 ranks; TEST_JOBS=0 runs in one process.
TEST_JOBS ?= 2
test: setup lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=30 --junitxml=runs/junit.xml

# The GPU smoke suite (tests/distributed/test_devices.py, marked gpu): every optimizer's device branches against
# the float64 CPU result, and a 1-rank NCCL booster run; skipped with a reason without CUDA.
test-gpu: setup
	$(PY) -m pytest -q -m gpu

demo: setup
	$(PY) -m recipes.demo

bench: setup
	$(PY) bench/bench_step.py

clean:
	rm -rf $(VENV) runs
