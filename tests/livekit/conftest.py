"""A real LiveKit server for the `livekit` tests: built once by scripts/setup/install_livekit.sh (cached under
.cache/bin), started on free loopback ports for the test session, stopped (killed if need be) after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deployments.livekit.server import LiveKitServer, install_server


@pytest.fixture(scope="session")
def livekit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveKitServer]:
    binary = install_server()
    server = LiveKitServer(binary, tmp_path_factory.mktemp("livekit"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
