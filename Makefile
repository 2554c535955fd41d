# Quick start: `make demo`, then `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ppmedia-installed
# The tested stack: torch 2.14.1 (the index's standard build; it runs on CPU too) with torchvision 0.29.1,
# installed together so pip never pairs torchvision with another torch build.
TORCH := torch==2.14.1 torchvision==0.29.1
TRANSFORMERS := transformers==5.23.0
PEFT := peft==0.21.2

.PHONY: demo test bench fixtures clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q $(TORCH) $(TRANSFORMERS) $(PEFT) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ppmedia demo

test: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python tests/bench/run.py

fixtures: $(STAMP)
	$(BIN)/python fixtures/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis bench-results.json bench-stage0-costs.json
