# Everything runs from .venv, built from pyproject.toml on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The SDK alone, from the wheel, on the oldest grpcio and protobuf that
# pyproject.toml admits (tests/commands/test_packaging.py keeps the three in step).
SDK_GRPCIO := 1.49.1
SDK_PROTOBUF := 4.21.6
SDK_VENV := $(VENV)/sdk-oldest
SDK_STAMP := $(SDK_VENV)/.installed
WHEELS := build/wheels
# Other Pythons the package is tested on: the machine's own, or pyenv's.
PYTHON312 := $(firstword $(wildcard /usr/bin/python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12))
PYTHON313 := $(firstword $(wildcard /usr/bin/python3.13 $(HOME)/.pyenv/versions/3.13*/bin/python3.13))

.PHONY: install test test-sdk test-pythons wheel lint demo bench stubs clean test-vllm demo-vllm bench-vllm

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# Python 3.11's venv brings setuptools 65.5, older than its fixed CVEs; the
	@# editable install builds in an isolated env, so nothing here needs it.
	$(BIN)/python -m pip uninstall --quiet --yes setuptools
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m handoff_server.commands.stubs --toolchain >/dev/null
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# pytest exits 5 when it collected nothing; that is a failure here, not a pass.
COLLECTED = rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest ran no tests" >&2; exit 1; fi; exit $$rc
# The suite on one worker per core (pytest-xdist); then, alone, the tests
# marked serial, which compare rates or time the event loop and must not
# measure another test's load.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/pytest -n $(TEST_WORKERS) -m 'not serial'; $(COLLECTED)
	$(BIN)/pytest -m serial; $(COLLECTED)
	$(MAKE) test-sdk test-pythons

$(SDK_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv --clear $(SDK_VENV)
	$(SDK_VENV)/bin/python -m pip uninstall --quiet --yes setuptools
	$(SDK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --only-binary=:all: \
		grpcio==$(SDK_GRPCIO) protobuf==$(SDK_PROTOBUF) \
		'pytest==9.*' pytest-asyncio==1.5.0 'pytest-timeout==2.*'
	touch $(SDK_STAMP)

# The SDK as an engine's image gets it: `pip wheel .`, installed without the
# server extra at the oldest grpcio/protobuf, its tests (tests/sdk) against a
# coordinator run from .venv as a separate process.
test-sdk: wheel $(SDK_STAMP)
	$(SDK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
		--force-reinstall $(WHEELS)/kv_handoff-*.whl
	$(SDK_VENV)/bin/python -m pip check
	HANDOFF_SDK_ONLY=1 HANDOFF_COORDINATOR="$(abspath $(BIN))/handoff" \
		$(SDK_VENV)/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/sdk tests/sdk

# The same tests on Python 3.12 and 3.13, the coordinator too, on the
# versions the server extra pins.
test-pythons: wheel
	@test -n "$(PYTHON312)" -a -n "$(PYTHON313)" || \
		echo "test-pythons: Python 3.12 or 3.13 not found; tested: $(PYTHON312) $(PYTHON313)" >&2
	set -e; for python in $(PYTHON312) $(PYTHON313); do \
		venv=$(VENV)/py$$($$python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
		if [ ! -f $$venv/.installed ] || [ pyproject.toml -nt $$venv/.installed ]; then \
			$$python -m venv --clear $$venv; \
			$$venv/bin/python -m pip install --quiet --disable-pip-version-check \
				"$$(echo $(WHEELS)/kv_handoff-*.whl)[server]" \
				'pytest==9.*' pytest-asyncio==1.5.0 'pytest-timeout==2.*'; \
			touch $$venv/.installed; \
		fi; \
		$$venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
			--force-reinstall $(WHEELS)/kv_handoff-*.whl; \
		HANDOFF_COORDINATOR="$(abspath $$venv)/bin/handoff" \
			$$venv/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/sdk tests/sdk; \
	done

wheel: $(STAMP)
	rm -rf $(WHEELS)
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir $(WHEELS) .

# A real coordinator on a free local port and simulated engines against it,
# with every fault on; under a minute, ending with a summary (leaked: 0).
demo: $(STAMP)
	$(BIN)/handoff demo

# The service benchmark (bench/service.py): about 20 minutes, 10 of them the soak.
bench: $(STAMP)
	$(BIN)/python -m bench.service

# Regenerate client/handoff_proto/v1 with the pinned generator (handoff_server/commands/stubs.py).
stubs: $(STAMP)
	$(BIN)/python -m handoff_server.commands.stubs --write

# vLLM on the CPU with NIXL, for tests/vllm, bench/vllm.py and demo-vllm:
# every wheel pinned in tests/vllm/requirements.txt (why each: there). This
# project goes in editable and without its deps (vLLM's grpcio/protobuf are
# in the SDK's ranges); the coordinator runs from .venv (HANDOFF_COORDINATOR).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQUIREMENTS := tests/vllm/requirements.txt
VLLM_CONSTRAINTS := tests/vllm/constraints.txt
$(VLLM_STAMP): $(VLLM_REQUIREMENTS) $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r $(VLLM_REQUIREMENTS) \
		-c $(VLLM_CONSTRAINTS)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
		nixl==1.5.1 nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(VLLM_STAMP)

# Real vLLM engines (tiny model built by the test) under a real coordinator.
# Not part of `make test`: .ci/run calls it after.
# Its mypy --strict runs here, where vLLM is importable. PYTEST_ARGS picks tests.
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(VLLM_VENV)/bin/mypy --config-file tests/vllm/mypy.ini client/handoff_vllm
	HANDOFF_COORDINATOR="$(abspath $(BIN))/handoff" \
		$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/vllm \
		$(if $(PYTEST_ARGS),$(PYTEST_ARGS),tests/vllm); \
		rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest ran no tests" >&2; exit 1; fi; exit $$rc

# Their processes start engines while a gRPC client runs: each child execs at
# once, so gRPC's fork handlers (and their log line) are not needed.
demo-vllm: $(STAMP) $(VLLM_STAMP)
	GRPC_ENABLE_FORK_SUPPORT=false HANDOFF_COORDINATOR="$(abspath $(BIN))/handoff" \
		$(VLLM_VENV)/bin/python -m bench.vllm_demo

bench-vllm: $(STAMP) $(VLLM_STAMP)
	GRPC_ENABLE_FORK_SUPPORT=false HANDOFF_COORDINATOR="$(abspath $(BIN))/handoff" \
		$(VLLM_VENV)/bin/python -m bench.vllm $(BENCH_ARGS)

clean:
	rm -rf $(VLLM_VENV) $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
