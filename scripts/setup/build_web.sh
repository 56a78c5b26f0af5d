#!/usr/bin/env bash
# Build the watch page (web/: TypeScript + livekit-client, bundled by vite) into deployments/api/watch_page/,
# the package data the ingress serves at /watch/. Idempotent: `npm ci` runs only when package-lock.json
# changed since the last install, the build only when a source is newer than the built page.
# Needs Node.js >= 20 and npm (the npm registry); the build output is not committed (.gitignore).
set -euo pipefail
cd "$(dirname "$0")/../../web"

if ! command -v npm >/dev/null 2>&1; then
    echo "build_web.sh: npm is not on PATH; install Node.js >= 20 with npm (Debian: apt-get install -y nodejs npm)" >&2
    exit 1
fi
stamp=node_modules/.lock-sha256
lock_sha="$(sha256sum package-lock.json | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$lock_sha" ]; then
    echo "build_web.sh: installing the page's npm packages (package-lock.json)" >&2
    log="$(mktemp)"
    npm ci --no-audit --no-fund --loglevel=error >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
    rm -f "$log"
    echo "$lock_sha" > "$stamp"
fi
page=../deployments/api/watch_page/index.html
if [ ! -f "$page" ] || [ -n "$(find index.html src vite.config.ts tsconfig.json package-lock.json -newer "$page" | head -n1)" ]; then
    npm run --silent build >/dev/null
fi
echo "build_web.sh: watch page at deployments/api/watch_page/" >&2
