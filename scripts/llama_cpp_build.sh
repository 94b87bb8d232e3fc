# Sourced by install_llama_cpp.sh and build_llama_server.sh: the pinned llama-cpp-python build and
# its cache key (version + CMAKE_ARGS + arch), one definition so that llama-server is built with
# exactly the wheel's flags and cached beside it.
LCP_VERSION="${LCP_VERSION:-0.3.36}"
LCP_CMAKE_ARGS="${LCP_CMAKE_ARGS:--DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF}"
PY="${PYTHON:-python}"
KEY=$(printf '%s|%s|%s' "$LCP_VERSION" "$LCP_CMAKE_ARGS" "$(uname -m)" | sha256sum | cut -c1-12)
CACHE="${LCP_WHEEL_CACHE:-$HOME/.cache/llama-cpp-wheels}"
