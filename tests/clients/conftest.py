"""One `characters serve --livekit-dev` for every client test (the Runway SDKs, the voice agent, the React call
UI): the first test that asks for `served` starts it, and it stops right after the last test that uses it
(pytest_runtest_teardown), so the suite pays one cold start and no idle cluster outlives them. Each test gets
it with no live session left by the one before (`served` waits for that)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from serve_helpers import Served, characters_serve, wait_for

IDLE_S = 60.0  # a previous test's session ends (its room empties, its slot is reset) well within this

_stack = ExitStack()
_shared: list[Served] = []
_last_user: list[str] = []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    users = [item.nodeid for item in items if "served" in getattr(item, "fixturenames", ())]
    _last_user[:] = users[-1:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _last_user and item.nodeid == _last_user[0]:
        _stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _stop()  # -x, Ctrl-C or a deselected last user: stopped all the same


def _stop() -> None:
    _shared.clear()
    _stack.close()


def _live(served: Served) -> list[dict[str, object]]:
    out = []
    for key in served.keys:
        status, body = served.request("GET", "/v1/sessions", key=key)
        assert status == 200, body
        out += [s for s in body["sessions"] if s["status"] not in ("ENDED", "FAILED")]
    return out


@pytest.fixture()
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not _shared:
        _shared.append(_stack.enter_context(characters_serve(tmp_path_factory.mktemp("serve"))))
    shared = _shared[0]
    wait_for(lambda: not _live(shared), IDLE_S, "the previous test's sessions to end", every_s=0.5)
    yield shared
