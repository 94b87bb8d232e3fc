#!/usr/bin/env bash
# Build llama-server from the llama.cpp vendored in the pinned llama-cpp-python sdist,
# with the same CMAKE_ARGS as the wheel (scripts/install_llama_cpp.sh), for
# `hydra-rpc bench vs-llama-server`.
#
# Cached next to the wheel cache and keyed like the wheel (version + CMAKE_ARGS + arch):
#   ${LCP_WHEEL_CACHE:-~/.cache/llama-cpp-wheels}/<version>-<key>-llama-server/llama-server
# Built once (~5-10 min on 2 cores: ggml + llama + common + server, target llama-server only),
# published atomically (build in <dir>.tmp.PID, then mv), serialised with flock.
#
# Usage:
#   scripts/build_llama_server.sh            build if missing, print the binary's path
#   scripts/build_llama_server.sh --path     print where the binary is/would be, build nothing
#
# Environment:
#   LCP_VERSION, LCP_CMAKE_ARGS, LCP_WHEEL_CACHE   as in scripts/install_llama_cpp.sh
#   LCP_SDIST_DIR   an already extracted llama_cpp_python-<version> directory (skips the download)
#   PYTHON          python with pip, used for `pip download` of the sdist
# Offline-safe once the sdist is present: no curl, no OpenSSL, no web UI download or npm build.
set -euo pipefail
. "$(dirname "$0")/llama_cpp_build.sh"
OUT="$CACHE/$LCP_VERSION-$KEY-llama-server"
BIN="$OUT/llama-server"

if [ "${1:-}" = "--path" ]; then echo "$BIN"; exit 0; fi
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null 2>&1 || { echo "build_llama_server: $tool not found" >&2; exit 2; }
done
mkdir -p "$CACHE"
exec 9>"$OUT.lock"
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi        # another process built it meanwhile

TMP="$OUT.tmp.$$"
rm -rf "$TMP"; mkdir -p "$TMP"
trap 'rm -rf "$TMP"' EXIT

SRC="${LCP_SDIST_DIR:-}"
if [ -z "$SRC" ]; then
  echo "build_llama_server: downloading the llama-cpp-python $LCP_VERSION sdist" >&2
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LCP_VERSION" -d "$TMP/sdist" >&2
  tar -xzf "$TMP"/sdist/llama_cpp_python-"$LCP_VERSION".tar.gz -C "$TMP/sdist"
  SRC="$TMP/sdist/llama_cpp_python-$LCP_VERSION"
fi
grep -qx "Version: $LCP_VERSION" "$SRC/PKG-INFO" \
  || { echo "build_llama_server: $SRC is not llama-cpp-python $LCP_VERSION" >&2; exit 2; }
LLAMA_SRC="$SRC/vendor/llama.cpp"
[ -f "$LLAMA_SRC/tools/server/CMakeLists.txt" ] \
  || { echo "build_llama_server: no tools/server in $LLAMA_SRC" >&2; exit 2; }

GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
echo "build_llama_server: building llama-server $LCP_VERSION ($LCP_CMAKE_ARGS) into $OUT" >&2
# shellcheck disable=SC2086  # LCP_CMAKE_ARGS is a word list on purpose, as in install_llama_cpp.sh
env "${LCP_COMPILER_ENV[@]}" cmake -S "$LLAMA_SRC" -B "$TMP/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  $LCP_CMAKE_ARGS -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$TMP/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$TMP/out"
cp "$TMP/build/bin/llama-server" "$TMP/out/llama-server"
printf 'llama-cpp-python %s\nCMAKE_ARGS %s -DLLAMA_CURL=OFF\nCFLAGS -include %s\narch %s\nkey %s\nbuilt %s\n' \
  "$LCP_VERSION" "$LCP_CMAKE_ARGS" "$(basename "$LCP_HIDDEN_TABLES")" "$(uname -m)" "$KEY" "$(date -u +%FT%TZ)" \
  > "$TMP/out/BUILD_INFO"
"$TMP/out/llama-server" --version >&2 || true
rm -rf "$OUT"; mv "$TMP/out" "$OUT"                   # publish atomically
echo "$BIN"
