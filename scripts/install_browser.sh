#!/usr/bin/env bash
# Install Debian's chromium for the browser tests (tests/book/test_browser.py).
# Idempotent: does nothing when /usr/bin/chromium already exists.
# Never downloads a browser build of its own (no `playwright install`): the
# tests drive this system chromium through the python playwright package.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium

/usr/bin/chromium --version
