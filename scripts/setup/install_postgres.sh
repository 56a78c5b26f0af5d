#!/usr/bin/env bash
# Install Debian's PostgreSQL server binaries for the database tests (tests/postgres.py starts a throwaway server
# on 127.0.0.1 from them; the service itself needs none: SQLite by default, a PostgreSQL of yours by URL). A no-op
# when initdb is there. Needs root (apt-get) and Debian's package archive. The package's own cluster is not used.
#   scripts/setup/install_postgres.sh        # -> /usr/lib/postgresql/<version>/bin/{initdb,pg_ctl,postgres}
set -euo pipefail

if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "install_postgres.sh: PostgreSQL's initdb is missing and this is not root; run" \
         "'sudo apt-get install -y postgresql' (Debian), then retry" >&2
    exit 1
fi
echo "install_postgres.sh: installing Debian's postgresql (a minute, once)" >&2
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql; } >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
rm -f "$log"
echo "install_postgres.sh: $(ls /usr/lib/postgresql/*/bin/initdb)" >&2
