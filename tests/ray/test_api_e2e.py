"""End to end with the real scheduler (deployments.sessions.scheduler): HTTP create -> RUNNING -> gRPC audio in,
events out -> 503 while the only bundle is busy -> DELETE -> capacity back. Tiny preset on 2 CPUs."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1 (before importing ray)

import base64
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import ray
from ray import serve

from characters.audio import SAMPLE_AUDIO, load_audio
from characters.media import SAMPLE_IMAGE
from deployments.api.app import APP_NAME, GRPC_SERVICER_FUNCTIONS, build_app
from deployments.api.proto import characters_pb2 as pb
from deployments.api.proto import characters_pb2_grpc as pb_grpc
from deployments.sessions.cluster import init_local, stop_local
from deployments.types import NAMESPACE, SCHEDULER_NAME

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Api:
    def __init__(self, http_port: int, grpc_port: int) -> None:
        self.base = f"http://127.0.0.1:{http_port}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = pb_grpc.CharactersStub(self.channel)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


@pytest.fixture(scope="module")
def api() -> Iterator[Api]:
    os.environ.pop("CHARACTERS_API_KEYS", None)
    init_local(num_cpus=2, configure_logging=False)
    try:
        srv = Api(http_port := free_port(), grpc_port := free_port())
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options={"port": grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)})
        serve.run(build_app({"service": {"queue_max": 0}}), name=APP_NAME, route_prefix="/")
        yield srv
        srv.channel.close()
    finally:
        try:
            ray.get(ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE).shutdown.remote(), timeout=30)
        finally:
            serve.shutdown()
            stop_local()


def wait_status(api: Api, sid: str, want: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        body = api.call("GET", f"/v1/sessions/{sid}")[2]
        if body["status"] == want or body["status"] == "FAILED" or time.monotonic() > deadline:
            assert body["status"] == want, body
            return body
        time.sleep(0.5)


def test_session_lifecycle_with_the_real_scheduler(api: Api) -> None:
    image = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
    status, _, created = api.call("POST", "/v1/sessions", {"avatar": {"image": image}, "maxDuration": 120})
    assert status == 201 and created["status"] in ("QUEUED", "STARTING"), created
    sid = created["id"]
    try:
        # The only bundle is taken and the queue holds nobody: the next request is refused with Retry-After.
        status, headers, refused = api.call("POST", "/v1/sessions", {"avatar": {"image": image}})
        assert status == 503 and refused["error"]["code"] == "no_capacity", refused
        assert int(headers["retry-after"]) >= 1

        wait_status(api, sid, "RUNNING", timeout_s=120)
        speech = load_audio(SAMPLE_AUDIO)[:16000]  # 1 s, float32 mono 16 kHz
        pcm = (np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes()
        chunks = [pb.AudioChunk(session_id=sid, pcm=pcm[:6400], sample_rate=16000, channels=1)]
        chunks += [pb.AudioChunk(pcm=pcm[i:i + 6400], sample_rate=16000, channels=1)
                   for i in range(6400, len(pcm), 6400)]
        kinds: list[int] = []
        stream = api.stub.StreamAudio(iter(chunks), timeout=60)
        for event in stream:
            assert event.session_id == sid
            kinds.append(event.kind)
            if kinds.count(pb.SessionEvent.KIND_CHUNK) >= 3:
                break
        stream.cancel()
        assert pb.SessionEvent.KIND_STATUS in kinds and kinds.count(pb.SessionEvent.KIND_CHUNK) >= 3
        assert api.call("GET", f"/v1/sessions/{sid}")[2]["stats"]["chunks"] >= 3
    finally:
        status, _, ended = api.call("DELETE", f"/v1/sessions/{sid}")
    assert status == 200 and ended["status"] == "ENDED" and ended["reason"] == "deleted", ended
    deadline = time.monotonic() + 60
    while (cap := api.call("GET", "/v1/capacity")[2])["bundlesFree"] != cap["bundlesTotal"]:
        assert time.monotonic() < deadline, cap
        time.sleep(0.5)
    assert cap["sessionsRunning"] == 0
