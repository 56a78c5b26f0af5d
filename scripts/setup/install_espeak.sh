#!/usr/bin/env bash
# Install Debian's espeak-ng, the stand-in text-to-speech of examples/voice_agent.py (and so of its test,
# tests/clients/test_voice_agent.py). A no-op when espeak-ng is on PATH. Needs root (apt-get) and Debian's
# package archive; nothing else.
set -euo pipefail

if command -v espeak-ng >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "install_espeak.sh: espeak-ng is missing and this is not root; run 'sudo apt-get install -y espeak-ng'" \
         "(Debian), then retry" >&2
    exit 1
fi
echo "install_espeak.sh: installing Debian's espeak-ng (once)" >&2
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
if ! { apt-get update -qq && apt-get install -y -qq espeak-ng; } >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
rm -f "$log"
