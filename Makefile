PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

train: setup
	$(BIN)/python train.py $(ARGS)

test: setup
	$(BIN)/python -m pytest -n auto $(PYTEST_ARGS)

# GPU tables of docs/performance.md: the goals (trainer vs a bare compiled loop, each fix, monitors, MFU), then AdamW² vs
# fused AdamW alone; ARGS go to bench_train.py, OPTIM_ARGS to bench_optim.py (their options differ)
bench: setup
	$(BIN)/python scripts/bench_train.py $(ARGS)
	$(BIN)/python scripts/bench_optim.py --optims adamw,adamw2,adamw2-overlap $(OPTIM_ARGS)

lint: setup
	$(BIN)/ruff check stabletrain tests scripts examples train.py

clean:
	rm -rf outputs multirun .pytest_cache
