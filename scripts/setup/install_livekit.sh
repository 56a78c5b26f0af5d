#!/usr/bin/env bash
# Install the pinned LiveKit server into a cache directory (default: <repo>/.cache/bin) and print its path.
# Reused when the cached binary already reports the pinned version; otherwise built once with
# `go install` from the Go module proxy (needs Go >= 1.26 on PATH; no other network access). There is no
# server binary on PyPI, npm or Debian; later commits of the module add `replace` lines that break
# `go install`, hence the pinned tag. The module's binary is named `server`; it is installed as
# `livekit-server`.
#   scripts/setup/install_livekit.sh              # -> /path/to/repo/.cache/bin/livekit-server
#   LIVEKIT_BIN_DIR=/tmp/bin scripts/setup/install_livekit.sh
set -euo pipefail

LIVEKIT_VERSION="1.13.5"
MODULE="github.com/livekit/livekit-server/cmd/server"

repo="$(cd "$(dirname "$0")/../.." && pwd)"
bin_dir="${LIVEKIT_BIN_DIR:-$repo/.cache/bin}"
target="$bin_dir/livekit-server"

# `server --version` prints e.g. "server version 1.13.5".
cached_version() {
    [ -x "$target" ] && "$target" --version 2>/dev/null | awk '{print $NF}' | head -n1 || true
}

if [ "$(cached_version)" = "$LIVEKIT_VERSION" ]; then
    echo "$target"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "install_livekit.sh: 'go' is not on PATH; install Go >= 1.26 (https://go.dev/dl/) or put a" \
         "livekit-server $LIVEKIT_VERSION binary at $target" >&2
    exit 1
fi

mkdir -p "$bin_dir"
build_dir="$(mktemp -d "$bin_dir/.livekit-build.XXXXXX")"
trap 'rm -rf "$build_dir"' EXIT

echo "install_livekit.sh: building $MODULE@v$LIVEKIT_VERSION with $(go version) (a few minutes, once)" >&2
# GOTOOLCHAIN=local: build with the installed Go, never download another toolchain.
GOBIN="$build_dir" CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false" \
    go install "$MODULE@v$LIVEKIT_VERSION" >&2

got="$("$build_dir/server" --version 2>/dev/null | awk '{print $NF}' | head -n1)"
if [ "$got" != "$LIVEKIT_VERSION" ]; then
    echo "install_livekit.sh: built server reports version '$got', expected $LIVEKIT_VERSION" >&2
    exit 1
fi
mv -f "$build_dir/server" "$target"  # atomic within one directory: a concurrent run sees old or new
echo "$target"
