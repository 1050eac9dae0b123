# `make run`: set up and generate with the default model.  `make test`: set up and run the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Call the get_weather tool for Paris. Reply with the tool call as JSON.
SCHEMA ?= docs/examples/get_weather.schema.json

HOST ?= 127.0.0.1
PORT ?= 8000
# pytest-xdist workers for `make test` (each loads the model: a few GB). One more than a 2-core machine's cores:
# the server tests spend much of their time waiting on their servers' processes
TEST_WORKERS ?= 3

.PHONY: run test gpu-test setup bench serve clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# torch first: CPU machines take the local 2.13 CPU wheel; GPU machines keep the torch they have
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q torch

# installed again whenever setup.py changes (a new test dependency reaches an existing .venv); uv installs the rest
# (~50 s against pip's ~100, the extensions' build included) and keeps the torch already there. Compiled to
# bytecode once here: where PYTHONDONTWRITEBYTECODE is set, every process (servers, their engine and API
# processes, CLI runs) would otherwise compile transformers, FastAPI and the rest again at each start.
$(VENV)/.installed: $(BIN)/activate setup.py
	$(BIN)/pip install -q uv
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e ".[test]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/specdec generate --prompt "$(PROMPT)" --json-schema $(SCHEMA) --max-tokens 128

test: setup
	$(BIN)/ruff check .
	@# the project's own modules too, for the same reason
	$(BIN)/python -m compileall -q -j 0 engine specdec hostfunc bench tests > /dev/null
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

# on a GPU machine, the package built in place (README, "On the GPU machine"; no venv: that machine has no
# internet): every test that runs on CUDA there, GPU_TESTS="<files>" for a part of them, GPU_TEST_ARGS for pytest's
# own (e.g. "-n 8 --dist loadfile" where pytest-xdist is installed: the kernel tests mostly wait on compiles).
# An engine without num_kv_blocks takes half the free device memory for its KV pages, so concurrent workers
# squeeze each other: -n 8 fits a 141 GB card, -n 2 an 80 GB one.
GPU_TESTS ?= tests
GPU_TEST_ARGS ?=
gpu-test:
	$(PY) -m pytest -q -ra -m "gpu or kernels" $(GPU_TEST_ARGS) $(GPU_TESTS)

serve: setup
	$(BIN)/specdec serve --host $(HOST) --port $(PORT)

bench: setup
	$(BIN)/python -m bench.step.throughput

clean:
	rm -rf $(VENV) build *.egg-info
