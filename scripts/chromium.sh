#!/usr/bin/env bash
# Make sure headless Chromium and its WebDriver are installed (the status page's browser tests).
# Usage: scripts/chromium.sh   -> prints the chromedriver path
#
# Installs Debian's `chromium` and `chromium-driver` when chromedriver is missing (as root;
# otherwise it says what to run). Nothing is downloaded outside the Debian archive: the tests
# drive this Chromium through Selenium, never a browser build of their own.
set -euo pipefail
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "chromium is not installed and this is not root: run 'sudo apt-get install -y chromium chromium-driver', then retry" >&2
    exit 1
  fi
  echo "chromium is not installed: installing the Debian packages chromium and chromium-driver" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 chromium chromium-driver fonts-dejavu-core >&2
fi
command -v chromedriver
