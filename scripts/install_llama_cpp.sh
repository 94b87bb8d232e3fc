#!/usr/bin/env bash
# Install the pinned llama-cpp-python with ggml-RPC support from a local wheel cache.
#
# llama-cpp-python ships only an sdist for Linux: installing it compiles llama.cpp
# (~5 min on 2 cores). We compile once into a wheel directory keyed on
# version + CMAKE_ARGS + arch and install from there afterwards (~4 s).
# pip's own wheel cache is keyed on the sdist URL only and would happily hand back
# a wheel built with other flags, hence --no-cache-dir and our own key.
set -euo pipefail
LCP_VERSION="${LCP_VERSION:-0.3.36}"
LCP_CMAKE_ARGS="${LCP_CMAKE_ARGS:--DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF}"
PY="${PYTHON:-python}"
KEY=$(printf '%s|%s|%s' "$LCP_VERSION" "$LCP_CMAKE_ARGS" "$(uname -m)" | sha256sum | cut -c1-12)
WHEEL_DIR="${LCP_WHEEL_CACHE:-$HOME/.cache/llama-cpp-wheels}/$LCP_VERSION-$KEY"
if ! ls "$WHEEL_DIR"/llama_cpp_python-"$LCP_VERSION"-*.whl >/dev/null 2>&1; then
  echo "install_llama_cpp: building llama-cpp-python $LCP_VERSION ($LCP_CMAKE_ARGS) into $WHEEL_DIR (about 5 minutes)" >&2
  TMP="$WHEEL_DIR.tmp.$$"
  rm -rf "$TMP"; mkdir -p "$TMP"
  CMAKE_ARGS="$LCP_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip wheel --no-cache-dir --no-deps -w "$TMP" "llama-cpp-python==$LCP_VERSION"
  rm -rf "$WHEEL_DIR"; mv "$TMP" "$WHEEL_DIR"      # publish atomically
fi
"$PY" -m pip install -q --only-binary llama-cpp-python --find-links "$WHEEL_DIR" "llama-cpp-python==$LCP_VERSION"
"$PY" -c "import llama_cpp,sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 'llama-cpp-python was built without GGML_RPC')"
