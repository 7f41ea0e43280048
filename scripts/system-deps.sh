#!/usr/bin/env bash
# Installs the system packages the tests need (redis-server, Chromium and its driver, g++) when
# they are missing. As root it runs apt-get; otherwise it prints the one command to run and
# exits 1. `make setup` and .ci/run call it; it does nothing when everything is there.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v g++ >/dev/null 2>&1 || missing+=(g++)  # builds the C++ CPU attention kernel
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "pagedserve's tests need these system packages: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "pagedserve's tests need these system packages: ${missing[*]}; this machine has no apt-get: install them with its package manager" >&2
    exit 1
fi
echo "installing system packages: ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
