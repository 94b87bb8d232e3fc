#!/usr/bin/env bash
# System tools the end-to-end tests use (packet capture for the inspector tests: tcpdump for
# `inspect -i`, tshark for the Lua dissector).
# Installs what is missing when it can (root and apt-get); an install that was tried and failed
# exits non-zero with apt-get's output, so CI does not go on to skip the capture tests silently.
# Without root or apt-get nothing is tried: the tests that need a missing tool skip with a reason.
set -uo pipefail
need=()
command -v tcpdump >/dev/null 2>&1 || need+=(tcpdump)
command -v tshark >/dev/null 2>&1 || need+=(tshark)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_test_tools: ${need[*]} missing and not installable here (needs root and apt-get); capture tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections 2>/dev/null || true
log=$(mktemp)
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install_test_tools: installing ${need[*]} failed (apt-get output above)" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
for tool in "${need[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || { echo "install_test_tools: $tool is still missing after the install" >&2; exit 1; }
done
