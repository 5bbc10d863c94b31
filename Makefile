# UGENT for Django. `make run` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PG_URL ?= postgres://root@127.0.0.1:5432/ugent
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# The suite runs on several processes (pytest-xdist), whole files to each, so a module's daemon or
# layout starts once; each keeps its own Redis database (TEST_REDIS_URL's number minus its own), pub/sub
# prefix and var/ directory (tests/support/workers.py). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 3
# Files are handed out slowest first, in the order tests/support/schedule.py gives the collection (xdist's own
# order, most tests first, left the end-to-end files to the end).
PYTEST_ARGS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: setup run test lint test-embedded test-servers services bench

# The bytecode every process of a test run imports, written once before the passes: where
# PYTHONDONTWRITEBYTECODE is set, each pytest worker rewrote every test file's asserts and each process the
# tests start compiled the project's modules, all from source (scripts/warm-bytecode.py). Made again when a
# source or the installed requirements change.
PY_SOURCES := $(shell find channels_app cron_app plugins_app rules_app ugent_common ugent_site tests manage.py -name '*.py' -not -path '*/__pycache__/*' 2>/dev/null)
BYTECODE := var/bytecode.stamp

$(BYTECODE): $(VENV)/.installed $(PY_SOURCES)
	@mkdir -p var
	@$(PY) scripts/warm-bytecode.py
	@touch $@

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e . --config-settings editable_mode=compat
	touch $@

# Embedded mode: one process, SQLite under var/, no server to install.
run: setup
	$(PY) manage.py rundaemon

# The import contracts (docs/design.md), then every test, in embedded mode and in servers mode (Redis +
# PostgreSQL): the two passes at once, each output printed whole at the end (scripts/test-passes.sh).
test: setup services lint $(BYTECODE)
	@TEST_WORKERS=$(TEST_WORKERS) MAKE="$(MAKE)" bash scripts/test-passes.sh

# Dependencies point one way between the apps: the contracts are in pyproject.toml.
lint: setup
	$(VENV)/bin/lint-imports

test-embedded: setup $(BYTECODE)
	env -u REDIS_URL -u DATABASE_URL $(PY) -m pytest -q $(PYTEST_ARGS)

test-servers: setup services $(BYTECODE)
	REDIS_URL=$(TEST_REDIS_URL) DATABASE_URL=$(PG_URL) $(PY) -m pytest -q $(PYTEST_ARGS)

services:
	@bash scripts/ensure-services.sh
	@bash scripts/ensure-chromium.sh || echo "WARNING: chromium could not be installed; the browser tests will fail"

bench: setup
	$(PY) bench/chat_latency.py
	$(PY) bench/events_fanout.py
	$(PY) bench/bridge_throughput.py
	$(PY) bench/channel_workers.py
	$(PY) bench/rules_eval.py
	$(PY) bench/first_answer.py
	$(PY) bench/daemon_start.py
	$(PY) bench/memory_rss.py
	$(PY) bench/tool_loop.py
	$(PY) bench/turn_cpu.py
	$(PY) bench/memory.py
