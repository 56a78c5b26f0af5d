"""The official Runway SDKs, unmodified, against a real `characters serve --livekit-dev` (Ray, the scheduler, the
real tiny pipeline, a real LiveKit server): PyPI `runwayml` 5.24.0 and npm `@runwayml/sdk` 4.20.1 (with
`@runwayml/avatars`' `pollUntilReady` and `consumeSession`, the web flow), both pinned.

Each does what an application written against Runway does: create an avatar (a data URI and a preset voice),
wait for READY, retrieve, list (paginated), update, and delete it; start a session with `integration: {type:
"livekit"}` into a room of its own and one without (a room of the service: READY with a session key, then
consume, then RUNNING), poll them, and delete them (CANCELLED). Every response is parsed by the SDK's own
models, and validated again strictly against them (pydantic, as no silent fallback to an unvalidated
object would be): each is the status's own member of the union, with no field outside it. Refusals come
back as the SDKs' exception classes.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from livekit import api as lkapi
from PIL import Image
from pydantic import TypeAdapter
from serve_helpers import ROOT, Served, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.livekit, pytest.mark.slow]

NODE_DIR = ROOT / "tests" / "clients" / "node"



def face_uri(level: int = 150) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.full((96, 128, 3), level, np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def room_token(served: Served, room: str, identity: str) -> str:
    return (lkapi.AccessToken(served.livekit_key, served.livekit_secret).with_identity(identity).with_kind("agent")
            .with_grants(lkapi.VideoGrants(room_join=True, room=room)).to_jwt())


def strict(raw: Any, model: Any, parsed: Any, member: type) -> None:
    """`parsed` (the SDK's object) is the union's `member`, built from every field of the JSON and nothing
    else, and the JSON validates against the SDK's model (no unvalidated construct)."""
    assert type(parsed) is member, (type(parsed), raw)
    assert parsed.model_extra == {}, parsed.model_extra
    assert type(TypeAdapter(model).validate_python(raw)) is member


# --------------------------------------------------------------------------------------------- Python


def test_the_python_sdk_avatars_and_sessions_with_and_without_an_integration(served: Served) -> None:
    import runwayml
    from runwayml.types import (
        avatar_create_response,
        avatar_list_response,
        avatar_retrieve_response,
        avatar_update_response,
        realtime_session_retrieve_response,
    )

    client = runwayml.RunwayML(base_url=served.url, api_key=served.keys["app"], max_retries=0)
    t0 = time.monotonic()
    # avatars: create -> PROCESSING; retrieve until READY
    raw = client.avatars.with_raw_response.create(
        name="Ada", personality="A patient guide.", reference_image=face_uri(),
        voice={"type": "runway-live-preset", "preset_id": "clara"}, start_script="Hello!", document_ids=["doc-1"])
    made = raw.parse()
    strict(raw.http_response.json(), avatar_create_response.AvatarCreateResponse, made,
           avatar_create_response.Processing)
    assert (made.name, made.personality, made.start_script, made.document_ids) == ("Ada", "A patient guide.", "Hello!",
                                                                                 ["doc-1"])
    assert isinstance(made.created_at, datetime) and made.voice.preset_id == "clara"  # type: ignore[union-attr]
    ready = wait_for(lambda: (r := client.avatars.retrieve(made.id)).status == "READY" and r, 20, "avatar READY", 0.1)
    raw = client.avatars.with_raw_response.retrieve(made.id)
    strict(raw.http_response.json(), avatar_retrieve_response.AvatarRetrieveResponse, raw.parse(),
           avatar_retrieve_response.Ready)
    assert ready.voice.name == "Clara" and ready.updated_at >= ready.created_at  # type: ignore[union-attr]
    second = client.avatars.create(name="Bea", personality="Brisk.", reference_image=face_uri(90),
                                   voice={"type": "custom", "id": "my-voice"})
    listed = [a.id for a in client.avatars.list(limit=1)]  # one per page: the SDK follows nextCursor
    assert [i for i in listed if i in (made.id, second.id)] == [second.id, made.id]  # newest first (the server
    # is shared by the client tests: avatars of a test before may be listed too)
    page = client.avatars.with_raw_response.list(limit=1)
    for item in page.http_response.json()["data"]:
        TypeAdapter(avatar_list_response.AvatarListResponse).validate_python(item)
    raw = client.avatars.with_raw_response.update(made.id, name="Ada II", start_script=None)
    updated = raw.parse()
    strict(raw.http_response.json(), avatar_update_response.AvatarUpdateResponse, updated,
           avatar_update_response.Ready)
    assert (updated.name, updated.start_script) == ("Ada II", None)

    retrieve = realtime_session_retrieve_response
    union = retrieve.RealtimeSessionRetrieveResponse

    def status(sid: str) -> Any:
        raw = client.realtime_sessions.with_raw_response.retrieve(sid)
        got = raw.parse()
        member = {"NOT_READY": retrieve.NotReady, "READY": retrieve.Ready, "RUNNING": retrieve.Running,
                  "COMPLETED": retrieve.Completed, "FAILED": retrieve.Failed, "CANCELLED": retrieve.Cancelled}
        strict(raw.http_response.json(), union, got, member[got.status])
        return got

    # a session in a room of the caller's own (integration), then one in a room of the service
    room = "sdk-integration"
    created = client.realtime_sessions.create(
        model="gwm1_avatars", avatar={"type": "custom", "avatar_id": made.id}, max_duration=60,
        personality="Be brief.", start_script="Hi!", tools=[{"type": "client_event", "name": "show_caption",
                                                              "description": "Show a caption"}],
        integration={"type": "livekit", "url": served.livekit_url, "token": room_token(served, room, "character-int"),
                     "room_name": room, "agent_identity": "agent-int"})
    assert created.model_extra == {} and set(created.model_fields_set) == {"id"}
    seen = [status(created.id).status]
    running = wait_for(lambda: seen.append((s := status(created.id)).status) or (s.status == "RUNNING" and s), 60,
                       "the integration session RUNNING", 0.2)
    assert set(seen) <= {"NOT_READY", "RUNNING"} and isinstance(running.created_at, datetime), seen
    client.realtime_sessions.delete(created.id)
    cancelled = wait_for(lambda: (s := status(created.id)).status == "CANCELLED" and s, 20, "CANCELLED")
    assert cancelled.id == created.id

    own = client.realtime_sessions.create(model="gwm1_avatars", avatar={"type": "runway-preset",
                                                                        "preset_id": "cooking-teacher"})
    seen = []
    ready_s = wait_for(lambda: seen.append((s := status(own.id)).status) or (s.status == "READY" and s), 60,
                       "the service-room session READY", 0.2)
    assert set(seen) <= {"NOT_READY", "READY"} and ready_s.expires_at > ready_s.created_at, seen
    import httpx  # the Python SDK has no consume: what @runwayml/avatars' consumeSession posts, by hand

    consumed = httpx.post(f"{served.url}/v1/realtime_sessions/{own.id}/consume",
                          headers={"Authorization": f"Bearer {ready_s.session_key}"}, timeout=10)
    assert consumed.status_code == 200, consumed.text
    creds = consumed.json()
    assert set(creds) == {"url", "token", "roomName"} and creds["url"] == served.livekit_url
    assert creds["roomName"] == f"watch-{own.id}"
    assert status(own.id).status == "RUNNING"
    again = httpx.post(f"{served.url}/v1/realtime_sessions/{own.id}/consume",
                       headers={"Authorization": f"Bearer {ready_s.session_key}"}, timeout=10)
    assert again.status_code == 401 and again.json()["error"]["code"] == "invalid_session_key"
    client.realtime_sessions.delete(own.id)
    assert wait_for(lambda: status(own.id).status == "CANCELLED", 20, "CANCELLED")

    # refusals as the SDK's exception classes
    with pytest.raises(runwayml.NotFoundError):
        client.realtime_sessions.retrieve("0" * 32)
    with pytest.raises(runwayml.UnprocessableEntityError) as bad:
        client.avatars.create(name="x", personality="y", reference_image="https://example.com/a.png",
                              voice={"type": "runway-live-preset", "preset_id": "clara"})
    assert bad.value.body["error"]["field"] == "referenceImage"  # type: ignore[index]
    with pytest.raises(runwayml.AuthenticationError):
        runwayml.RunwayML(base_url=served.url, api_key="not-a-key-0123456789", max_retries=0).avatars.list(limit=1)
    other = runwayml.RunwayML(base_url=served.url, api_key=served.keys["other"], max_retries=0)
    with pytest.raises(runwayml.NotFoundError):
        other.avatars.retrieve(made.id)  # another key's avatar is not found, as an unknown one
    client.avatars.delete(made.id)
    client.avatars.delete(second.id)
    with pytest.raises(runwayml.NotFoundError):
        client.avatars.retrieve(made.id)
    assert "runway client 'RunwayML/Python 5.24.0' (key app)" in served.log.read_text()
    print(f"python sdk: avatars + 2 sessions in {time.monotonic() - t0:.1f} s")


def test_the_python_sdk_reads_usage_per_tenant(served: Served) -> None:
    """`avatars.get_usage` (GET /v1/avatar_usage) as Runway shapes it, for the caller's sessions only, equal to what
    its sessions' records say (seconds streamed of the ended ones, every session counted on its UTC day); the
    native /v1/usage agrees, and the operator sees every tenant."""
    import runwayml
    from runwayml.types import avatar_get_usage_response

    other = runwayml.RunwayML(base_url=served.url, api_key=served.keys["other"], max_retries=0)
    status, made = served.request("POST", "/v1/sessions", {"avatar": {"image": face_uri().split(",", 1)[1]},
                                                           "maxDuration": 60}, key="other")
    assert status == 201, made

    def running() -> bool:
        return served.request("GET", f"/v1/sessions/{made['id']}", key="other")[1]["status"] == "RUNNING"

    wait_for(running, 120, "the session to run", every_s=0.25)
    time.sleep(2.0)
    status, ended = served.request("DELETE", f"/v1/sessions/{made['id']}", key="other")
    assert status == 200 and ended["status"] == "ENDED", ended

    today = datetime.now(UTC).date()
    start, end = today - timedelta(days=2), today + timedelta(days=1)
    raw = other.avatars.with_raw_response.get_usage(start_date=datetime.combine(start, datetime.min.time(), UTC),
                                                    end_date=end.isoformat())
    parsed = raw.parse()
    assert type(parsed) is avatar_get_usage_response.AvatarGetUsageResponse
    usage = TypeAdapter(avatar_get_usage_response.AvatarGetUsageResponse).validate_python(raw.http_response.json())
    assert usage.model_extra == {} and usage.total_seconds == parsed.total_seconds  # every field the model's own

    mine = served.request("GET", "/v1/sessions", key="other")[1]["sessions"]
    assert made["id"] in {s["id"] for s in mine}
    days = [start + timedelta(days=i) for i in range(3)]
    seconds = {d: 0.0 for d in days}
    sessions = dict.fromkeys(days, 0)
    measured = [s["endedAt"] - s["startedAt"] for s in mine if s["startedAt"] and s["endedAt"]]
    for s in mine:
        day = datetime.fromtimestamp(s["createdAt"], UTC).date()
        sessions[day] += 1
        if s["startedAt"] and s["endedAt"]:
            seconds[day] += s["endedAt"] - s["startedAt"]
    assert [(b.date, b.seconds, b.sessions) for b in usage.by_day] == [
        (d, round(seconds[d]), sessions[d]) for d in days]
    assert usage.total_sessions == len(mine) and usage.total_seconds == sum(round(v) for v in seconds.values())
    assert usage.avg_duration_seconds == round(sum(measured) / len(measured)) and usage.total_seconds >= 2

    native = served.request("GET", f"/v1/usage?startDate={start}&endDate={end}", key="other")[1]["data"]
    assert {u["tenant"] for u in native} == {"other"} and sum(u["sessions"] for u in native) == len(mine)
    assert sum(u["secondsStreamed"] for u in native) == usage.total_seconds
    everyone = served.request("GET", f"/v1/usage?startDate={start}&endDate={end}", key="ops")[1]["data"]
    assert [u for u in everyone if u["tenant"] == "other"] == native
    with pytest.raises(runwayml.UnprocessableEntityError):
        other.avatars.get_usage(start_date=end.isoformat(), end_date=start.isoformat())


# ----------------------------------------------------------------------------------------------- Node


def test_the_node_sdk_does_the_same_and_the_web_flow(served: Served) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed (Debian: apt-get install nodejs npm)"
    assert (NODE_DIR / "node_modules" / "@runwayml" / "sdk").is_dir(), (
        "the Node clients are not installed; run `npm ci` in tests/clients/node (scripts/setup.sh --dev does)")
    room = "node-integration"
    env = {**os.environ, "RUNWAYML_BASE_URL": served.url, "RUNWAYML_API_SECRET": served.keys["app"],
           "OTHER_API_SECRET": served.keys["other"], "FACE_URI": face_uri(), "ROOM": room,
           "ROOM_TOKEN": room_token(served, room, "character-node"), "LIVEKIT_URL": served.livekit_url}
    t0 = time.monotonic()
    run = subprocess.run([node, str(NODE_DIR / "sdk_flow.mjs")], env=env, capture_output=True, text=True,
                         timeout=300, cwd=NODE_DIR)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["avatar"]["statuses"][0] == "PROCESSING" and report["avatar"]["statuses"][-1] == "READY"
    assert report["avatar"]["listed"] == report["avatar"]["ids"]  # newest first, one per page
    assert report["integration"]["statuses"][-1] == "RUNNING" and report["integration"]["end"] == "CANCELLED"
    assert report["own"]["ready"] is True and report["own"]["consumed"] == {"roomName": report["own"]["room"],
                                                                           "url": served.livekit_url}
    assert report["own"]["after"] == "RUNNING" and report["own"]["end"] == "CANCELLED"
    assert report["errors"] == {"notFound": "NotFoundError", "unprocessable": "UnprocessableEntityError",
                                "auth": "AuthenticationError", "otherTenant": "NotFoundError"}
    assert "runway client 'RunwayML/JS 4.20.1' (key app)" in Path(served.log).read_text()
    print(f"node sdk: avatars + 2 sessions + the web flow in {time.monotonic() - t0:.1f} s")
