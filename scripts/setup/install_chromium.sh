#!/usr/bin/env bash
# Install Debian's Chromium for the browser test (tests/browser; Playwright drives it headless through
# executable_path, so no browser is downloaded). A no-op when /usr/bin/chromium is there. Needs root
# (apt-get) and Debian's package archive; nothing else.
#   scripts/setup/install_chromium.sh        # -> /usr/bin/chromium
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "install_chromium.sh: /usr/bin/chromium is missing and this is not root; run" \
         "'sudo apt-get install -y chromium' (Debian), then retry" >&2
    exit 1
fi
echo "install_chromium.sh: installing Debian's chromium (a minute, once)" >&2
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
if ! { apt-get update -qq && apt-get install -y -qq chromium; } >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
rm -f "$log"
echo "install_chromium.sh: $(/usr/bin/chromium --version)" >&2
