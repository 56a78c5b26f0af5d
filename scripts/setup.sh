#!/usr/bin/env bash
# Create .venv with this project installed (editable). `--agent` adds what examples/voice_agent.py needs (LiveKit
# Agents, the Runway avatar plugin, espeak-ng for its stand-in voice); `--dev` adds that and the test and lint tools.
# Idempotent: a second run only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
for arg in "$@"; do
    case "$arg" in
        --dev) extra="[dev]" ;;
        --agent) [ "$extra" = "[dev]" ] || extra="[agent]" ;;
        *) echo "setup.sh: unknown option '$arg' (options: --agent, --dev)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || { echo "setup.sh: creating .venv ($("$PY" --version))" >&2; "$PY" -m venv .venv; }
.venv/bin/python -m pip install -q --upgrade "pip==26.3"
echo "setup.sh: installing the project into .venv (editable${extra:+, with the extra $extra})" >&2
# setuptools tells every editable install that same-named folders may shadow the package: it is the point here.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".${extra}"
# The watch page (web/ -> deployments/api/watch_page/) and, for its browser test, Debian's Chromium; with --dev
# also the npm projects and espeak-ng of the client tests.
if [ "$extra" = "[agent]" ]; then
    scripts/setup/build_web.sh || echo "setup.sh: the watch page (/watch/) is not built; the API works without it" >&2
    scripts/setup/install_espeak.sh || echo "setup.sh: without espeak-ng the example's stand-in voice will not speak;" \
        "CHARACTER_AGENT=pipeline (your own TTS) works without it" >&2
elif [ -n "$extra" ]; then
    scripts/setup/build_web.sh
    scripts/setup/install_chromium.sh
    scripts/setup/install_postgres.sh  # the server the database tests start on loopback (tests/postgres.py)
    scripts/setup/install_otelcol.sh >/dev/null  # the collector the telemetry test runs the shipped config on
    scripts/setup/build_examples.sh   # examples/web (the React call page) and tests/clients/node (the Runway Node SDK)
    scripts/setup/install_espeak.sh   # the voice agent example's stand-in TTS
else
    scripts/setup/build_web.sh || echo "setup.sh: the watch page (/watch/) is not built; the API works without it" >&2
fi
