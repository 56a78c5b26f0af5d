"""The load test's admission checks on a real local Ray + Serve (the real ingress and scheduler, tiny preset
cut to one DiT layer, capacity 1, queue 1), then a short schemathesis run against the same deployment.

`scripts/tools/loadtest.py` fires 60 concurrent creates: exactly one is admitted, one waits in the queue, the 58
others are 503 with Retry-After and `no_capacity`; deletes of the queued one and of unknown ids answer
200 / 404; after the admitted session is deleted the capacity is whole again. The fuzz run then sends
schema-generated requests (valid and invalid) to every operation over real HTTP: no 5xx but 503, each
response as documented, and a session appears in the list exactly when a create answered 2xx.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("loadtest", ROOT / "scripts" / "tools" / "loadtest.py")
assert _spec is not None and _spec.loader is not None
loadtest = importlib.util.module_from_spec(_spec)
sys.modules["loadtest"] = loadtest
_spec.loader.exec_module(loadtest)

CREATES = {("POST", "/v1/sessions"), ("POST", "/v1/realtime_sessions")}
SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    database=None)


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[str, str]]:
    with loadtest.local_service(capacity=1, queue_max=1, model="small", num_cpus=4) as (base, key):
        yield base, key


def test_burst_admits_exactly_the_capacity_and_refuses_the_rest_with_retry_after(service: tuple[str, str]) -> None:
    base, key = service
    report = loadtest.run_load(base, key, capacity=1, queue_max=1, creates=60, concurrency=32, churn_s=0)
    assert report["checks"] and report["ok"], report["checks"]
    burst = report["burst"]
    assert (burst["admitted"], burst["queued"], burst["refused_503"]) == (1, 1, 58)
    assert burst["retry_after_s"] and min(burst["retry_after_s"]) >= 1
    create = report["latency"]["create"]
    assert create["n"] == 60 and create["status"] == {"201": 2, "503": 58}
    assert report["latency"]["delete_unknown"]["status"] == {"404": 15}
    assert 0 < create["p50_ms"] <= create["p99_ms"] <= create["max_ms"]


def _ids(base: str, key: str) -> set[str]:
    req = urllib.request.Request(base + "/v1/sessions", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return {s["id"] for s in json.loads(resp.read())["sessions"]}


def test_schema_fuzz_against_the_serve_deployment(service: tuple[str, str]) -> None:
    base, key = service
    auth = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_url(base + "/openapi.json", headers=auth)
    served = [op.ok() for op in schema.get_all_operations()]
    assert len(served) >= 12  # native, Runway (and watch page) operations

    def check(case: Any) -> None:
        before = _ids(base, key)
        response = case.call(headers=auth, timeout=30)
        excluded = [positive_data_acceptance] + ([negative_data_rejection] if response.status_code == 413 else [])
        case.validate_response(response, headers=auth, excluded_checks=excluded)  # 413 refuses too (size limits)
        assert response.status_code < 500 or response.status_code == 503, response.text
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"code", "message", "field"}, response.text
        made = _ids(base, key) - before
        if (case.method.upper(), case.path) in CREATES and response.status_code in (200, 201):
            sid = response.json()["id"]
            assert made == {sid}
            req = urllib.request.Request(f"{base}/v1/sessions/{sid}", method="DELETE", headers=auth)
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert json.loads(resp.read())["status"] == "ENDED"
        else:
            assert not made, (case.method, case.path, response.status_code, made)

    for op in served:
        if op.tags and "watch" in op.tags:
            continue  # the watch page's routes: fuzzed with the page (see docs/security.md)
        strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))
        SETTINGS(given(case=strategy)(lambda case: check(case)))()
