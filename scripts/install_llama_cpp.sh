#!/usr/bin/env bash
# Install the pinned llama-cpp-python with ggml-RPC support from a local wheel cache.
#
# llama-cpp-python ships only an sdist for Linux: installing it compiles llama.cpp
# (~5 min on 2 cores). We compile once into a wheel directory keyed on
# version + CMAKE_ARGS + arch and install from there afterwards (~4 s).
# pip's own wheel cache is keyed on the sdist URL only and would happily hand back
# a wheel built with other flags, hence --no-cache-dir and our own key.
#
# LCP_CMAKE_ARGS selects the build (README: GPU nodes), e.g. a CUDA one:
#   LCP_CMAKE_ARGS='-DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_CUDA=ON' \
#     PYTHON=.venv/bin/python bash scripts/install_llama_cpp.sh
# (or `make install LCP_CMAKE_ARGS=...`). Keep -DGGML_RPC=ON: the engine needs ggml-RPC.
# pip considers any installed llama-cpp-python==VERSION satisfied, whatever it was built with,
# so the key of the installed build is recorded in the environment (.llama-cpp-build) and a
# different one is replaced by the wheel built for these args (--force-reinstall).
set -euo pipefail
. "$(dirname "$0")/llama_cpp_build.sh"
WHEEL_DIR="$CACHE/$LCP_VERSION-$KEY"
MARKER="$("$PY" -c 'import sys; print(sys.prefix)')/.llama-cpp-build"
if ! ls "$WHEEL_DIR"/llama_cpp_python-"$LCP_VERSION"-*.whl >/dev/null 2>&1; then
  echo "install_llama_cpp: building llama-cpp-python $LCP_VERSION ($LCP_CMAKE_ARGS) into $WHEEL_DIR (about 5 minutes; a GPU backend takes longer)" >&2
  TMP="$WHEEL_DIR.tmp.$$"
  rm -rf "$TMP"; mkdir -p "$TMP"
  env "${LCP_COMPILER_ENV[@]}" CMAKE_ARGS="$LCP_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip wheel --no-cache-dir --no-deps -w "$TMP" "llama-cpp-python==$LCP_VERSION"
  rm -rf "$WHEEL_DIR"; mv "$TMP" "$WHEEL_DIR"      # publish atomically
fi
if [ "$(cat "$MARKER" 2>/dev/null | head -n1)" = "$KEY" ] && "$PY" -c 'import llama_cpp' 2>/dev/null; then
  :  # the build for these args is the installed one
else
  # another build (or an unknown one) may be installed: pip would keep it; replace it
  echo "install_llama_cpp: installing the llama-cpp-python $LCP_VERSION build for: $LCP_CMAKE_ARGS" >&2
  rm -f "$MARKER"
  "$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/llama_cpp_python-"$LCP_VERSION"-*.whl
  "$PY" -m pip install -q --only-binary llama-cpp-python --find-links "$WHEEL_DIR" "llama-cpp-python==$LCP_VERSION"
  printf '%s\n%s\n' "$KEY" "$LCP_CMAKE_ARGS" > "$MARKER"
fi
"$PY" -c "import llama_cpp,sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 'llama-cpp-python was built without GGML_RPC')"
# the devices this build sees (a GPU build lists CUDA0 / Vulkan0 / ROCm0 …; no GPU device means
# the toolkit or the driver is missing at run time, and nothing will be offloaded)
"$PY" - <<'PYEOF' >&2 || true
import ctypes, importlib.util, os
lib = os.path.join(importlib.util.find_spec("llama_cpp").submodule_search_locations[0], "lib", "libggml.so.0")
g = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
g.ggml_backend_dev_get.restype, g.ggml_backend_dev_get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
for f in (g.ggml_backend_dev_name, g.ggml_backend_dev_description):
    f.restype, f.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
devs = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
print("install_llama_cpp: ggml devices: " + ", ".join(
    f"{g.ggml_backend_dev_name(d).decode()} ({g.ggml_backend_dev_description(d).decode()})" for d in devs))
PYEOF
