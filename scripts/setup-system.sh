#!/usr/bin/env bash
# Install the system binaries the test tiers use, idempotently. Each step says what it did; a step that cannot run on
# this machine says why, and the tests that need it report themselves skipped with that reason.
set -uo pipefail
cd "$(dirname "$0")/.."
cache="${DAEDALUS_CACHE:-$HOME/.cache/daedalus}"
mkdir -p "$cache"

# Prometheus (promtool + a real server for the observability tests): Debian package.
if ! command -v promtool >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian prometheus (promtool, server)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
      >"$cache/apt-prometheus.log" 2>&1 || echo "setup: prometheus install failed (see $cache/apt-prometheus.log)"
    # The package starts a system daemon where an init system runs; the tests start their own servers.
    (service prometheus stop || systemctl stop prometheus) >/dev/null 2>&1 || true
  else
    echo "setup: promtool missing and apt-get unavailable (not root?): Prometheus tests will skip"
  fi
fi

[ -x scripts/fetch-helm.sh ] && bash scripts/fetch-helm.sh
[ -x scripts/build-kube.sh ] && bash scripts/build-kube.sh
exit 0
