#!/usr/bin/env bash
# Install the pinned kustomize into a cache directory (default: <repo>/.cache/bin) and print its path.
# Reused when the cached binary already reports the pinned version; otherwise built with `go install`
# from the Go module proxy (needs Go >= 1.26 on PATH; no other network access).
#   scripts/setup/install_kustomize.sh            # -> /path/to/repo/.cache/bin/kustomize
#   KUSTOMIZE_BIN_DIR=/tmp/bin scripts/setup/install_kustomize.sh
set -euo pipefail

KUSTOMIZE_VERSION="v5.8.2"
MODULE="sigs.k8s.io/kustomize/kustomize/v5"

repo="$(cd "$(dirname "$0")/../.." && pwd)"
bin_dir="${KUSTOMIZE_BIN_DIR:-$repo/.cache/bin}"
target="$bin_dir/kustomize"

cached_version() {
    [ -x "$target" ] && "$target" version 2>/dev/null | head -n1 || true
}

if [ "$(cached_version)" = "$KUSTOMIZE_VERSION" ]; then
    echo "$target"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "install_kustomize.sh: 'go' is not on PATH; install Go >= 1.26 (https://go.dev/dl/) or put a" \
         "kustomize $KUSTOMIZE_VERSION binary at $target" >&2
    exit 1
fi

mkdir -p "$bin_dir"
build_dir="$(mktemp -d "$bin_dir/.kustomize-build.XXXXXX")"
trap 'rm -rf "$build_dir"' EXIT

echo "install_kustomize.sh: building $MODULE@$KUSTOMIZE_VERSION with $(go version)" >&2
# GOTOOLCHAIN=local: build with the installed Go, never download another toolchain.
GOBIN="$build_dir" CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-trimpath" \
    go install "$MODULE@$KUSTOMIZE_VERSION" >&2

got="$("$build_dir/kustomize" version 2>/dev/null | head -n1)"
if [ "$got" != "$KUSTOMIZE_VERSION" ]; then
    echo "install_kustomize.sh: built kustomize reports version '$got', expected $KUSTOMIZE_VERSION" >&2
    exit 1
fi
mv -f "$build_dir/kustomize" "$target"  # atomic within one directory: a concurrent run sees old or new
echo "$target"
