#!/usr/bin/env bash
# System tools the end-to-end tests use (packet capture for the inspector tests).
# Best effort: tests that need a missing tool skip with a reason.
set -uo pipefail
need=()
command -v tcpdump >/dev/null 2>&1 || need+=(tcpdump)
command -v tshark >/dev/null 2>&1 || need+=(tshark)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections 2>/dev/null || true
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}") >/dev/null 2>&1 \
    || echo "install_test_tools: could not install ${need[*]}; capture tests will skip" >&2
fi
exit 0
