# Sourced by install_llama_cpp.sh and build_llama_server.sh: the pinned llama-cpp-python build and
# its cache key (version + CMAKE_ARGS + arch + the forced header below), one definition so that
# llama-server is built with exactly the wheel's flags and cached beside it.
LCP_VERSION="${LCP_VERSION:-0.3.36}"
LCP_CMAKE_ARGS="${LCP_CMAKE_ARGS:--DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF}"
# Compiler flags of every C and C++ file of both builds (CFLAGS, CXXFLAGS): ggml-cpu's internal
# conversion tables declared hidden, so the shared libraries address them directly, as a static
# build does (the header says why). Its content is part of the key; its path is not.
LCP_HIDDEN_TABLES="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ggml_cpu_tables_hidden.h"
LCP_CFLAGS="-include $LCP_HIDDEN_TABLES"
LCP_COMPILER_ENV=(CFLAGS="$LCP_CFLAGS ${CFLAGS:-}" CXXFLAGS="$LCP_CFLAGS ${CXXFLAGS:-}")  # env "${LCP_COMPILER_ENV[@]}" CMD
PY="${PYTHON:-python}"
KEY=$(printf '%s|%s|%s|%s' "$LCP_VERSION" "$LCP_CMAKE_ARGS" "$(uname -m)" "$(sha256sum < "$LCP_HIDDEN_TABLES" | cut -c1-64)" \
  | sha256sum | cut -c1-12)
CACHE="${LCP_WHEEL_CACHE:-$HOME/.cache/llama-cpp-wheels}"
