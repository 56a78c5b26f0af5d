#!/usr/bin/env bash
# Build the OpenTelemetry Collector that runs k8s/base/otel-collector-config.yaml in the tests (tools/otelcol:
# exactly the components that config names, at the release of the image k8s/base/otel-collector.yaml pins)
# into a cache directory (default: <repo>/.cache/bin) and print its path. Rebuilt only when tools/otelcol
# changed (its sources' hash is stored beside the binary); needs Go >= 1.26 and the Go module proxy.
#   scripts/setup/install_otelcol.sh              # -> /path/to/repo/.cache/bin/characters-otelcol
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
src="$repo/tools/otelcol"
bin_dir="${OTELCOL_BIN_DIR:-$repo/.cache/bin}"
target="$bin_dir/characters-otelcol"
want="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -d' ' -f1)"

if [ -x "$target" ] && [ "$(cat "$target.sha256" 2>/dev/null || true)" = "$want" ]; then
    echo "$target"
    exit 0
fi
if ! command -v go >/dev/null 2>&1; then
    echo "install_otelcol.sh: 'go' is not on PATH; install Go >= 1.26 (https://go.dev/dl/)" >&2
    exit 1
fi
mkdir -p "$bin_dir"
echo "install_otelcol.sh: building the collector of tools/otelcol with $(go version) (a few minutes, once)" >&2
tmp="$target.tmp.$$"
trap 'rm -f "$tmp"' EXIT
(cd "$src" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly" \
    go build -ldflags="-s -w" -o "$tmp" .) >&2
"$tmp" --version >/dev/null
mv -f "$tmp" "$target"  # atomic within one directory
echo "$want" > "$target.sha256"
echo "$target"
