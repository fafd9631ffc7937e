# Two commands do all the setup on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick wheel-check lint format typecheck proto bench clean strace promtool systemd-analyze

# Bytecode is written where a module is first imported, once, and only for the modules something imports: where
# PYTHONDONTWRITEBYTECODE is set (as on these machines) every process would compile again what it imports (pyspark,
# grpc, the node's modules), and writing all of the dependencies' bytecode up front (pip, or compileall) compiles
# about 6,700 files to use 1,300: 17 core-seconds and about half a minute of a fresh clone's setup.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -r requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-compile --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# The project's own bytecode, written on every core before the test workers start, so that four of them do not
# each compile the same modules at once.
PACKAGES := georep cluster topology offsets dedup spark_jobs tests

demo: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES) > /dev/null
	$(BIN)/georep demo

# Debian packages some tests use, installed here when they can be (root and apt-get), else those tests are skipped
# with a message that says how to get them: strace (tests/test_raft_durability.py shows the Raft journal's fdatasync
# calls), prometheus (promtool and a Prometheus server: tests/test_audit_history.py, tests/test_alerts.py) and
# systemd (systemd-analyze: tests/test_deploy_kit.py). $(1): the command, $(2): its package.
apt_tool = @command -v $(1) > /dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null 2>&1 && \
	{ apt-get install -y -qq $(2) > /dev/null 2>&1 || \
	  { apt-get update -qq > /dev/null 2>&1 && apt-get install -y -qq $(2) > /dev/null 2>&1; }; }; } || \
	echo "$(1) could not be installed: its tests are skipped (apt-get install -y $(2))"

strace:
	$(call apt_tool,strace,strace)

promtool:
	$(call apt_tool,promtool,prometheus)

systemd-analyze:
	$(call apt_tool,systemd-analyze,systemd)

# ruff's lint rules, and ruff format's layout: `make format` rewrites the tree as the check wants it
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check --quiet .

format: $(STAMP)
	$(BIN)/ruff format .

# mypy --strict over the packages and tests/support (pyproject.toml's [tool.mypy] files)
typecheck: $(STAMP)
	$(BIN)/mypy

# The type check runs beside the suite, whose multi-process tests leave part of two cores idle (they wait on
# sessions and pauses); so do five workers (12:10 and 157% of the cores with five on a quiet machine; 13:11 and 136%
# with four, a helper's venv build beside it at first). make test fails if either fails.
test: $(STAMP) strace promtool systemd-analyze lint
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES) > /dev/null
	$(BIN)/mypy > $(VENV)/typecheck.log 2>&1 & typecheck=$$!; \
	$(BIN)/python -m pytest -q -n 5 --dist loadgroup -m "not wheel" --durations=20; tests=$$?; \
	wait $$typecheck; typed=$$?; cat $(VENV)/typecheck.log; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

# The quick loop: no slow scenario, and a quarter of each property test's examples (tests/support/examples.py).
# The release check CI runs after make test: the wheel built by python -m build, installed with
# requirements-runtime.lock alone into a fresh venv, runs georep --version and a node. Out of make test: its time
# is pip's, fetching and unpacking the runtime packages (37 to 74 s), which make test's budget cannot carry.
wheel-check: $(STAMP)
	$(BIN)/python -m pytest -q -m wheel tests/test_packaging.py

test-quick: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES) > /dev/null
	GEOREP_EXAMPLES_SCALE=0.25 $(BIN)/python -m pytest -q -n 5 --dist loadgroup -m "not slow" --durations=10

# The generated code is committed; this regenerates it with the pinned grpcio-tools and mypy-protobuf
# (typed stubs for the messages and the service, so mypy --strict checks every call).
proto: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m grpc_tools.protoc -I. --python_out=. --mypy_out=. \
		--grpc_python_out=. --mypy_grpc_out=. georep/proto/georep.proto

bench: $(STAMP)
	$(BIN)/python bench/produce.py

clean:
	rm -rf $(VENV) .georep .pytest_cache .mypy_cache .ruff_cache
