#!/usr/bin/env bash
# The npm side of the client tests and examples: examples/web/ (the unmodified @runwayml/avatars-react call
# page, bundled by vite into examples/web/dist/, served by its server.mjs) and tests/clients/node/ (the
# official @runwayml/sdk and @runwayml/avatars that tests/clients/test_runway_sdks.py drives from Node).
# Idempotent: `npm ci` runs only when a package-lock.json changed since the last install, the build only when
# a source is newer than the built page. Needs Node.js >= 20 and npm (the npm registry); nothing is committed.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v npm >/dev/null 2>&1; then
    echo "build_examples.sh: npm is not on PATH; install Node.js >= 20 with npm (Debian: apt-get install -y nodejs npm)" >&2
    exit 1
fi
install() {  # $1: a folder with a package-lock.json
    local stamp="$1/node_modules/.lock-sha256" lock_sha
    lock_sha="$(sha256sum "$1/package-lock.json" | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null || true)" != "$lock_sha" ]; then
        echo "build_examples.sh: installing the npm packages of $1 (package-lock.json)" >&2
        local log
        log="$(mktemp)"
        (cd "$1" && npm ci --no-audit --no-fund --loglevel=error) >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
        rm -f "$log"
        echo "$lock_sha" > "$stamp"
    fi
}
install tests/clients/node
install examples/web
page=examples/web/dist/index.html
if [ ! -f "$page" ] || [ -n "$(find examples/web/index.html examples/web/src examples/web/vite.config.js \
        examples/web/package-lock.json -newer "$page" | head -n1)" ]; then
    (cd examples/web && npm run --silent build >/dev/null)
fi
echo "build_examples.sh: examples/web/dist/ and tests/clients/node/ ready" >&2
