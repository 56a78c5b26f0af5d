"""Load test: hundreds of concurrent creates and deletes against a service of small capacity, while the
admitted sessions run; checks admission and measures API latency and the running sessions' fps.

    python scripts/tools/loadtest.py                                  # own local cluster: capacity 2, queue 2
    python scripts/tools/loadtest.py --creates 300 --concurrency 64 --out benchmarks/cpu/loadtest.json
    python scripts/tools/loadtest.py --url http://127.0.0.1:8000 --key KEY --capacity 2 --queue-max 2   # a running one

Own cluster (no --url): a local Ray on 127.0.0.1 with `--capacity` logical GPUs, the Serve app of
`deployments.api.app` (real ingress, real scheduler) with topology `gpu1` (one bundle per logical GPU; the
workers run on the CPU), the `tiny` preset (`--model small`, the default: one DiT layer and a decoder
without res blocks, so that several sessions run in real time on 2 cores), API keys on.

Phases (every request over real HTTP, `--concurrency` client threads):
  1. burst: `--creates` concurrent POST /v1/sessions on an idle service. Exactly `capacity` are admitted
     (201, STARTING), `min(queue_max, creates - capacity)` wait in the queue (201, QUEUED), every other
     one is 503 with Retry-After and the error body `no_capacity`. Then the queued ones are deleted
     (concurrently, with as many deletes of unknown ids: 404).
  2. steady: the admitted sessions reach RUNNING; their frames are read (GET, stats) before and after
     `--churn-s` seconds of churn: waves of concurrent creates (queued or 503), deletes of the queued
     ones, GETs and capacity reads. Their fps over that window (frames delivered / seconds) and late
     chunks are reported beside the fps before it.
  3. end: every session deleted; the capacity is whole again.
Latency: p50 / p99 / max per operation (client side, whole HTTP request). Writes JSON with the command
and the machine's 1-minute load average before and after (on shared cores, other jobs lower the fps).
Exit status 1 when an admission check fails (the JSON says which).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import platform
import secrets
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks import results  # noqa: E402

# The tiny preset with one DiT layer and a decoder without res blocks, at the preset's resolution (the API
# sizes images to the preset, so the resolution is not cut).
SMALL = {"dit": {"num_layers": 1}, "vae": {"num_res_blocks": 0}}
ADMITTED = ("STARTING", "READY", "RUNNING")


@dataclass
class Reply:
    op: str
    status: int
    seconds: float
    body: Any
    retry_after: str | None = None


@dataclass
class Client:
    """Blocking JSON-over-HTTP client (one connection per request: what hundreds of independent callers do)."""

    base: str
    key: str | None
    replies: list[Reply] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, op: str, method: str, path: str, body: Any = None, timeout_s: float = 60.0) -> Reply:
        url = urlsplit(self.base)
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=timeout_s)
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        t0 = time.perf_counter()
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            seconds = time.perf_counter() - t0
            data = json.loads(raw) if raw and "json" in (resp.getheader("content-type") or "") else raw.decode()
            reply = Reply(op, resp.status, seconds, data, resp.getheader("retry-after"))
        except (OSError, http.client.HTTPException) as e:  # a hung or dropped request is a result too
            reply = Reply(op, 0, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
        finally:
            conn.close()
        with self.lock:
            self.replies.append(reply)
        return reply


def avatar_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (190, 150, 120)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ms = sorted(v * 1000 for v in values)
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    return {"n": len(ms), "p50_ms": round(q[49], 2), "p99_ms": round(q[98], 2), "max_ms": round(ms[-1], 2)}


def fan_out(pool: ThreadPoolExecutor, fns: list[Callable[[], Reply]]) -> list[Reply]:
    return list(pool.map(lambda f: f(), fns))


def wait_until(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := fn()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.25)
    return value


def run_load(base: str, key: str | None, capacity: int, queue_max: int, creates: int = 300, concurrency: int = 64,
             churn_s: float = 10.0, churn_wave: int = 50, churn_rps: float = 0.0,
             start_timeout_s: float = 180.0) -> dict[str, Any]:
    """The three phases against the service at `base` (see the module docstring); the report and its checks.
    `churn_s <= 0` skips phase 2 (no fps measurement); `churn_rps > 0` paces the churn's creates."""
    client, image = Client(base, key), avatar_b64()
    body = {"avatar": {"image": image}, "maxDuration": 600}
    checks: dict[str, bool] = {}
    cap0 = client.call("capacity", "GET", "/v1/capacity").body
    checks["idle_at_start"] = cap0.get("bundlesFree") == cap0.get("bundlesTotal") == capacity and not cap0["queued"]

    with ThreadPoolExecutor(concurrency) as pool:
        # 1. burst
        t0 = time.monotonic()
        burst = fan_out(pool, [lambda: client.call("create", "POST", "/v1/sessions", body)] * creates)
        burst_s = time.monotonic() - t0
        admitted = [r.body["id"] for r in burst if r.status == 201 and r.body["status"] in ADMITTED]
        queued = [r.body["id"] for r in burst if r.status == 201 and r.body["status"] == "QUEUED"]
        refused = [r for r in burst if r.status == 503]
        checks["exactly_capacity_admitted"] = len(admitted) == capacity
        checks["queue_filled_exactly"] = len(queued) == min(queue_max, creates - capacity)
        checks["rest_503_retry_after"] = len(refused) == creates - len(admitted) - len(queued) and all(
            r.retry_after and int(r.retry_after) >= 1 and r.body["error"]["code"] == "no_capacity" for r in refused)
        deletes = [lambda sid=sid: client.call("delete", "DELETE", f"/v1/sessions/{sid}") for sid in queued]
        deletes += [lambda i=i: client.call("delete_unknown", "DELETE", f"/v1/sessions/nope-{i}")
                    for i in range(max(len(queued), creates // 4))]
        gone = fan_out(pool, deletes)
        checks["queued_deleted"] = all(r.status == 200 and r.body["status"] == "ENDED" for r in gone
                                       if r.op == "delete")
        checks["unknown_delete_404"] = all(r.status == 404 for r in gone if r.op == "delete_unknown")

        # 2. steady: the admitted sessions run while the API churns
        sessions: list[dict[str, Any]] = []
        waves = 0
        if churn_s > 0 and admitted:
            sessions, waves = steady(client, pool, admitted, body, checks, churn_s, churn_wave, churn_rps,
                                     start_timeout_s)
        # 3. end
        ended = fan_out(pool, [lambda sid=sid: client.call("delete", "DELETE", f"/v1/sessions/{sid}")
                               for sid in admitted])
        checks["running_deleted"] = all(r.status == 200 and r.body["status"] == "ENDED" for r in ended)
        cap = wait_until(lambda: (c := client.call("capacity", "GET", "/v1/capacity").body)["bundlesFree"] == capacity
                         and not c["queued"] and c, 60, "capacity back")
        checks["capacity_back"] = cap["sessionsRunning"] == 0

    by_op: dict[str, list[Reply]] = {}
    for r in client.replies:
        by_op.setdefault(r.op, []).append(r)
    latency = {op: {**percentiles([r.seconds for r in rs]),
                    "status": {str(s): sum(r.status == s for r in rs) for s in sorted({r.status for r in rs})}}
               for op, rs in sorted(by_op.items())}
    latency["all"] = percentiles([r.seconds for r in client.replies])
    checks["no_5xx_but_503"] = all(r.status < 500 or r.status == 503 for r in client.replies)
    checks["no_dropped_request"] = all(r.status != 0 for r in client.replies)
    return {"capacity": capacity, "queue_max": queue_max, "creates": creates, "concurrency": concurrency,
            "burst": {"seconds": round(burst_s, 2), "admitted": len(admitted), "queued": len(queued),
                      "refused_503": len(refused),
                      "retry_after_s": sorted({int(r.retry_after) for r in refused if r.retry_after})},
            "churn": {"seconds": churn_s, "waves": waves, "creates_per_wave": churn_wave, "creates_per_s": churn_rps},
            "sessions": sessions, "latency": latency, "requests": len(client.replies), "checks": checks,
            "ok": all(checks.values())}


def steady(client: Client, pool: ThreadPoolExecutor, admitted: list[str], body: dict[str, Any],
           checks: dict[str, bool], churn_s: float, churn_wave: int, churn_rps: float,
           start_timeout_s: float) -> tuple[list[dict[str, Any]], int]:
    """Phase 2: the admitted sessions' fps, quiet and under churn (see the module docstring)."""
    capacity = len(admitted)

    def session(sid: str) -> dict[str, Any]:
        return client.call("get", "GET", f"/v1/sessions/{sid}").body  # type: ignore[no-any-return]

    def all_running() -> bool:
        states = [session(s)["status"] for s in admitted]
        if any(s in ("ENDED", "FAILED") for s in states):
            raise RuntimeError(f"an admitted session ended before it ran: {states}")
        return all(s == "RUNNING" and session(sid)["stats"]["frames"] > 0 for s, sid in zip(states, admitted,
                                                                                              strict=True))

    wait_until(all_running, start_timeout_s, f"{capacity} admitted sessions RUNNING")
    time.sleep(3.0)  # past start-up
    quiet0 = {s: (time.monotonic(), session(s)["stats"]) for s in admitted}
    time.sleep(min(churn_s, 5.0))
    quiet1 = {s: (time.monotonic(), session(s)["stats"]) for s in admitted}
    churn0 = quiet1
    deadline = time.monotonic() + churn_s
    waves = 0
    while time.monotonic() < deadline:
        wave_t0 = time.monotonic()
        wave = fan_out(pool, [lambda: client.call("create", "POST", "/v1/sessions", body)] * churn_wave
                       + [lambda: client.call("capacity", "GET", "/v1/capacity")] * (churn_wave // 5)
                       + [lambda sid=s: client.call("get", "GET", f"/v1/sessions/{sid}") for s in admitted])
        waiting = [r.body["id"] for r in wave if r.op == "create" and r.status == 201]
        checks.setdefault("churn_never_over_admits", True)
        checks["churn_never_over_admits"] &= all(
            r.body["status"] == "QUEUED" for r in wave if r.op == "create" and r.status == 201)
        checks.setdefault("churn_refusals_503_retry_after", True)
        checks["churn_refusals_503_retry_after"] &= all(
            r.status in (201, 503) and (r.status == 201 or bool(r.retry_after)) for r in wave if r.op == "create")
        fan_out(pool, [lambda sid=sid: client.call("delete", "DELETE", f"/v1/sessions/{sid}") for sid in waiting])
        waves += 1
        if churn_rps > 0:  # pace: this wave's creates over churn_wave / churn_rps seconds
            time.sleep(max(0.0, churn_wave / churn_rps - (time.monotonic() - wave_t0)))
    churn1 = {s: (time.monotonic(), session(s)["stats"]) for s in admitted}

    def fps(a: dict[str, Any], b: dict[str, Any], sid: str) -> float:
        (ta, sa), (tb, sb) = a[sid], b[sid]
        return round((sb["frames"] - sa["frames"]) / (tb - ta), 2)

    sessions = [{"id": s, "fps_quiet": fps(quiet0, quiet1, s), "fps_churn": fps(churn0, churn1, s),
                 "fps_reported_end": churn1[s][1]["fps"],
                 "late_chunks_churn": churn1[s][1]["lateChunks"] - churn0[s][1]["lateChunks"],
                 "chunks_churn": churn1[s][1]["chunks"] - churn0[s][1]["chunks"],
                 "step_ms_p95": churn1[s][1]["stepMsP95"]} for s in admitted]
    status_counts = {s: sum(1 for x in admitted if session(x)["status"] == s) for s in ("RUNNING",)}
    checks["admitted_still_running"] = status_counts["RUNNING"] == capacity
    return sessions, waves


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_service(capacity: int, queue_max: int, model: str = "small", num_cpus: int = 8,
                  api: dict[str, Any] | None = None) -> Iterator[tuple[str, str]]:
    """A local Ray + Serve with the real app and scheduler; yields (base URL, API key). Stops everything after."""
    key = "load-" + secrets.token_urlsafe(24)
    os.environ["CHARACTERS_API_KEYS"] = f"load:{key}"  # before ray.init: the ingress replica inherits it
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    from deployments.api.app import APP_NAME, build_app
    from deployments.sessions.cluster import init_local, stop_local
    from deployments.types import NAMESPACE, SCHEDULER_NAME

    service: dict[str, Any] = {"topology": "gpu1", "queue_max": queue_max, "queue_timeout_s": 120.0,
                               "placement_timeout_s": 60.0, "model_overrides": SMALL if model == "small" else {}}
    init_local(num_cpus=num_cpus, num_gpus=capacity, configure_logging=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"service": service, "api": api or {}, "ingress": {"num_cpus": 0}}), name=APP_NAME,
                  route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        client = Client(base, key)
        wait_until(lambda: client.call("capacity", "GET", "/v1/capacity").status == 200, 120, "the scheduler")
        yield base, key
    finally:
        os.environ.pop("CHARACTERS_API_KEYS", None)
        with suppress(ValueError, ray.exceptions.RayError):  # no scheduler was started
            ray.get(ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE).shutdown.remote(), timeout=60)
        serve.shutdown()
        stop_local()


def table(report: dict[str, Any]) -> str:
    lines = [f"burst: {report['creates']} creates -> {report['burst']['admitted']} admitted, "
             f"{report['burst']['queued']} queued, {report['burst']['refused_503']} x 503 "
             f"(Retry-After {report['burst']['retry_after_s']}) in {report['burst']['seconds']} s",
             f"{'operation':<16}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}  status"]
    for op, row in report["latency"].items():
        lines.append(f"{op:<16}{row['n']:>6}{row.get('p50_ms', 0):>10}{row.get('p99_ms', 0):>10}"
                     f"{row.get('max_ms', 0):>10}  {row.get('status', '')}")
    for s in report["sessions"]:
        lines.append(f"session {s['id'][:8]}: fps quiet {s['fps_quiet']}, under churn {s['fps_churn']} "
                     f"({s['late_chunks_churn']} late of {s['chunks_churn']} chunks)")
    lines.append(f"checks: {'all passed' if report['ok'] else [k for k, v in report['checks'].items() if not v]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running service (default: start a local cluster)")
    p.add_argument("--key", help="API key for --url")
    p.add_argument("--capacity", type=int, default=2, help="bundles (own cluster: logical GPUs)")
    p.add_argument("--queue-max", type=int, default=2, help="queue length (own cluster: CHARACTERS_QUEUE_MAX)")
    p.add_argument("--model", choices=["small", "tiny"], default="small", help="own cluster: the tiny preset "
                   "cut down (small) or whole")
    p.add_argument("--creates", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--churn-s", type=float, default=10.0)
    p.add_argument("--churn-wave", type=int, default=50, help="concurrent creates per churn wave")
    p.add_argument("--churn-rps", type=float, default=0.0, help="pace the churn's creates (0: back to back)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu" / "loadtest.json"))
    a = p.parse_args(argv)
    load_before = os.getloadavg()
    kw = {"creates": a.creates, "concurrency": a.concurrency, "churn_s": a.churn_s, "churn_wave": a.churn_wave,
          "churn_rps": a.churn_rps}
    if a.url:
        report = run_load(a.url, a.key, a.capacity, a.queue_max, **kw)
    else:
        with local_service(a.capacity, a.queue_max, a.model) as (base, key):
            report = run_load(base, key, a.capacity, a.queue_max, **kw)
    import ray

    report = {"command": "python scripts/tools/loadtest.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": a.model if not a.url else "as served", "machine": platform.node(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__,
              "loadavg_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **report}
    print(table(report))
    results.record(a.out, report)
    print(f"wrote {a.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
