# Sourced by install_llama_cpp.sh and build_llama_server.sh: the pinned llama-cpp-python build and
# its cache key (version + CMAKE_ARGS + arch), one definition so that llama-server is built with
# exactly the wheel's flags and cached beside it.
LCP_VERSION="${LCP_VERSION:-0.3.36}"
# -Bsymbolic-functions: llama-cpp-python builds llama.cpp as shared libraries, whose calls from one
# function of a library to another of the same library would otherwise go through the PLT; bound
# inside the library they are direct calls, as in llama-server's static build (a Gemma prompt's
# prefill ~1.5 % faster: docs/performance.md, "Shared libraries bound to themselves"). It does
# nothing to a static build, so llama-server built with these same args is the same program.
LCP_CMAKE_ARGS="${LCP_CMAKE_ARGS:--DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DCMAKE_SHARED_LINKER_FLAGS=-Wl,-Bsymbolic-functions}"
PY="${PYTHON:-python}"
KEY=$(printf '%s|%s|%s' "$LCP_VERSION" "$LCP_CMAKE_ARGS" "$(uname -m)" | sha256sum | cut -c1-12)
CACHE="${LCP_WHEEL_CACHE:-$HOME/.cache/llama-cpp-wheels}"
