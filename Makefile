# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv (CPU torch pinned through constraints.txt) when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
OUTPUT  ?= runs/tiny

.PHONY: setup demo test test-all test-gpu lint clean

setup: $(STAMP)

$(STAMP): setup.cfg constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[eval,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hedgecats pipeline configs/pipelines/tiny.yaml --output $(OUTPUT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks experiments scripts

clean:
	rm -rf $(VENV) runs
