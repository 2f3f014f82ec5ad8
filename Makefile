# The two commands of the README: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.meshtrain-installed

.PHONY: setup cluster-deps train test bench clean

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

test: setup cluster-deps
	$(BIN)/python -m pytest -q -rs --durations=30

# The benchmark suite (tens of minutes on 2 CPU cores): bench/results/*.json, *.md and *.png.
bench: setup
	$(BIN)/python -m bench all

clean:
	rm -rf $(VENV) runs
