# The two commands of the README: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.meshtrain-installed

.PHONY: setup cluster-deps train test stress bench clean

setup: $(STAMP)

# Re-runs only when the package metadata or the pins change (idempotent).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

# The default job: tiny Llama on the Python standard library, 2 processes, DDP.
train: setup
	$(BIN)/meshtrain train --config configs/tiny.toml --nproc 2

# Open MPI and MPICH for the launch tests (apt-get, as root; skipped otherwise).
cluster-deps:
	bash scripts/install-cluster-deps.sh

# Lint and format check first (seconds), then the suite with its 15 slowest tests; the last line is its
# wall-clock time. On TEST_WORKERS pytest-xdist workers, each with its share of the cores: two on CI's 2
# cores take about 0.7 of one's time (one test's processes leave the cores idle while they import torch,
# wait on each other and on timers); more on a machine with the cores for them.
TEST_WORKERS ?= 2
test: setup cluster-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@start=$$(date +%s); $(BIN)/python -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadgroup; code=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s"; exit $$code

# Before a submission: the recovery, chaos and launcher tests again and again, every process pausing
# a seeded random moment at each write, truncation, rename and deletion of run files (tests/faults/),
# so that races a fast or slow machine would hit show up here first. STRESS_ROUNDS=N, STRESS_SEED=S.
STRESS_ROUNDS ?= 3
STRESS_SEED ?= 1
stress: setup cluster-deps
	for round in $$(seq $(STRESS_ROUNDS)); do \
	  MESHTRAIN_JITTER=$$(( $(STRESS_SEED) + round )):0.05 $(BIN)/python -m pytest -q -x -p no:cacheprovider \
	    tests/test_chaos.py tests/test_launchers.py \
	    "tests/test_checkpoint.py::test_stop_and_resume_is_exact" \
	    "tests/test_checkpoint.py::test_a_skipped_checkpoint_leaves_the_lineage_so_no_logged_step_is_lost" \
	    "tests/test_checkpoint.py::test_a_signal_to_the_launcher_checkpoints_and_the_next_run_continues" \
	    || exit 1; \
	done

# The benchmark suite (tens of minutes on 2 CPU cores): bench/results/*.json, *.md and *.png.
bench: setup
	$(BIN)/python -m bench all

clean:
	rm -rf $(VENV) runs
