"""Cluster membership as the scheduler sees it (`deployments.sessions.membership`), on plain values: the GCS's
table and the raylet probes merged, each change reported once; `NodeWatch` on virtual tables and probes;
`placement.explain_fit`, the reason a request is queued or refused; and the autoscaler demand's publisher."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from characters.config import TopologyConfig
from deployments.sessions.membership import Membership, NodeChange, NodeWatch
from placement import NodeCapacity, explain_fit

TOPO_1P1 = TopologyConfig(name="dit1+decoder1", dit_ranks=1, decoder_gpus=1)


def row(nid: str, *, alive: bool = True, gpus: float = 4, port: int = 7000, why: str = "") -> dict[str, Any]:
    return {"NodeID": nid, "Alive": alive, "Resources": {"GPU": gpus, "CPU": 8}, "NodeManagerAddress": "127.0.0.1",
            "NodeManagerPort": port, "DeathReasonMessage": why}


def kinds(changes: list[NodeChange]) -> list[tuple[str, str, str]]:
    return [(c.kind, c.node_id, c.by) for c in changes]


def test_the_first_table_is_the_baseline_and_later_ones_report_joins_and_losses_once():
    m = Membership()
    assert m.sync([row("head", gpus=0), row("a"), row("b", alive=False)]) == []  # a dead row never known: skipped
    assert m.states() == {"head": "live", "a": "live"}
    joined = m.sync([row("head", gpus=0), row("a"), row("c", gpus=8)])
    assert kinds(joined) == [("joined", "c", "gcs")] and joined[0].gpus == 8.0
    assert joined[0].detail == "registered with 8 GPUs"
    assert m.sync([row("head", gpus=0), row("a"), row("c", gpus=8)]) == []  # nothing new: nothing reported
    lost = m.sync([row("head", gpus=0), row("a", alive=False, why="health check failed"), row("c", gpus=8)])
    assert kinds(lost) == [("lost", "a", "gcs")]
    assert lost[0].reason.startswith("node_lost: node a left the cluster (the GCS lists it dead: health check failed)")
    assert m.sync([row("head", gpus=0), row("a", alive=False), row("c", gpus=8)]) == []  # dead and forgotten
    gone = m.sync([row("head", gpus=0)])  # no longer listed at all
    assert kinds(gone) == [("lost", "c", "gcs")] and gone[0].detail == "left the cluster (the GCS no longer lists it)"
    assert m.states() == {"head": "live"} and [r["NodeID"] for r in m.placeable()] == ["head"]


def test_two_refused_probes_in_a_row_lose_a_node_before_the_gcs_does_and_the_gcs_then_changes_nothing():
    m = Membership(failures=2, silent_s=5.0)
    m.sync([row("a", port=7001), row("b", port=7002)])
    assert m.to_probe(["a", "b", "unknown"]) == {"a": "127.0.0.1:7001", "b": "127.0.0.1:7002"}
    assert m.probed("a", "refused", 0.0) is None  # one refusal is not a loss
    assert m.probed("a", "ok", 0.5) is None  # ... and an answer resets the count
    assert m.probed("a", "refused", 1.0) is None
    lost = m.probed("a", "refused", 1.5)
    assert lost is not None and (lost.kind, lost.by) == ("lost", "probe")
    assert lost.detail == "stopped answering (its raylet refused 2 health checks in a row)"
    assert m.probed("a", "refused", 2.0) is None  # reported once
    assert m.state("a") == "lost" and [r["NodeID"] for r in m.placeable()] == ["b"]
    assert m.sync([row("a", port=7001), row("b", port=7002)]) == []  # the GCS still lists it: still lost
    assert m.sync([row("a", alive=False), row("b", port=7002)]) == []  # the GCS catches up: already reported
    assert m.state("a") is None and m.probed("a", "ok", 3.0) is None  # forgotten for good


def test_a_slow_raylet_is_not_lost_until_it_has_been_silent_for_silent_s():
    """A probe that times out may be a busy raylet (these 2 cores, a GC pause): only `silent_s` of no answer at
    all (a machine gone from the network) makes the node lost; a refused connection is the quick way."""
    m = Membership(failures=2, silent_s=5.0)
    m.sync([row("a")])
    for t in (0.0, 1.0, 2.0, 3.0, 4.5):
        assert m.probed("a", "silent", t) is None
    lost = m.probed("a", "silent", 5.0)
    assert lost is not None and lost.detail == "stopped answering (no answer to its raylet's health checks for 5.0 s)"
    m.sync([row("b"), row("a")])
    assert m.probed("b", "silent", 10.0) is None and m.probed("b", "ok", 11.0) is None
    assert m.probed("b", "silent", 12.0) is None and m.probed("b", "silent", 16.9) is None  # the clock restarted
    assert m.state("b") == "live"


def test_a_node_lost_by_its_probes_that_answers_again_is_live_again():
    m = Membership(failures=1)
    m.sync([row("a")])
    assert kinds([m.probed("a", "refused", 0.0)]) == [("lost", "a", "probe")]  # type: ignore[list-item]
    back = m.probed("a", "ok", 1.0)
    assert back is not None and (back.kind, back.detail) == ("joined", "is answering again")
    assert m.state("a") == "live"


def test_a_draining_node_takes_no_new_slots_and_is_reported_once():
    m = Membership()
    m.sync([row("a"), row("b")])
    changes = m.sync([row("a"), row("b")], draining={"b"})
    assert kinds(changes) == [("draining", "b", "gcs")]
    assert m.sync([row("a"), row("b")], draining={"b"}) == []
    assert [r["NodeID"] for r in m.placeable()] == ["a"] and m.counts() == {"live": 1, "draining": 1, "lost": 0}
    assert m.to_probe(["b"]) == {"b": "127.0.0.1:7000"}  # its sessions still run there: still probed
    new = m.sync([row("a"), row("b"), row("c")], draining={"b", "c"})  # joins already draining
    assert kinds(new) == [("joined", "c", "gcs")] and m.state("c") == "draining"
    lost = m.sync([row("a"), row("c")], draining={"c"})
    assert kinds(lost) == [("lost", "b", "gcs")]
    undrained = m.sync([row("a"), row("c")])  # (Ray does not cancel a drain; were it to, c would take slots again)
    assert kinds(undrained) == [("joined", "c", "gcs")] and undrained[0].detail == "is no longer draining"


def test_failures_below_one_are_refused():
    with pytest.raises(ValueError, match="failures=0 must be >= 1"):
        Membership(failures=0)
    with pytest.raises(ValueError, match="silent_s=0 > 0"):
        Membership(silent_s=0)


def test_node_watch_reads_the_table_and_probes_only_the_nodes_holding_slots_when_due():
    tables = [([row("a", port=1), row("b", port=2)], set())]
    answers = {"127.0.0.1:1": "refused", "127.0.0.1:2": "ok", "127.0.0.1:3": "ok"}
    probed: list[str] = []
    forgotten: list[set[str]] = []

    def table() -> tuple[list[dict[str, Any]], set[str]]:
        return tables[-1]

    async def probe(address: str) -> str:
        probed.append(address)
        return answers[address]

    async def forget(keep: Any) -> None:
        forgotten.append(set(keep))

    async def go() -> None:
        watch = NodeWatch(table, probe, refresh_s=0.0, probe_s=0.0, failures=2, forget=forget)
        await watch.start()
        assert await watch.poll(["a"]) == [] and probed == ["127.0.0.1:1"]  # b holds no slot: not probed
        lost = await watch.poll(["a"])
        assert kinds(lost) == [("lost", "a", "probe")]
        tables.append(([row("b", port=2), row("c", port=3)], set()))
        changes = await watch.poll([])
        assert kinds(changes) == [("joined", "c", "gcs")]  # a's disappearance was already reported
        assert forgotten[-1] == set()  # no node holds a slot: every channel closed
        slow = NodeWatch(table, probe, refresh_s=3600.0, probe_s=3600.0)
        await slow.start()
        probed.clear()
        assert await slow.poll(["c"]) == [] and probed == ["127.0.0.1:3"]  # the first probe is due at once
        assert await slow.poll(["c"]) == [] and probed == ["127.0.0.1:3"]  # then not for an hour
        assert not slow.due()

    asyncio.run(go())


def node(nid: str, gpu: float, cpu: float = 8.0, total_gpu: float = 8.0) -> NodeCapacity:
    return NodeCapacity(nid, {"GPU": gpu, "CPU": cpu}, {"GPU": total_gpu, "CPU": 8.0})


def test_explain_fit_says_when_free_gpus_add_up_but_no_single_node_has_a_bundle():
    why = explain_fit([node("a", 1), node("b", 2)], {"GPU": 3.0, "CPU": 1.0})
    assert why == ("no node has a whole bundle of {CPU: 1, GPU: 3} free (a session's bundle must fit one node, "
                   "STRICT_PACK): the roomiest of 2 nodes has {CPU: 8, GPU: 2} free, all of them together "
                   "{CPU: 16, GPU: 3}")
    assert explain_fit([node("a", 4)], {"GPU": 3.0}) == ("a bundle of {GPU: 3} is free, but it is owed to the "
                                                         "requests queued ahead (FIFO)")
    assert explain_fit([], {"GPU": 1.0}) == "no node is live to place a bundle of {GPU: 1} on"
    cpu_only = explain_fit([node("a", 0, cpu=1.5)], {"CPU": 2.0})
    assert cpu_only.endswith("the roomiest of 1 nodes has {CPU: 1.5} free, all of them together {CPU: 1.5}")


def test_the_demand_publisher_sends_one_request_at_a_time_and_the_last_one_is_the_latest(monkeypatch):
    """(`placement.actor.DemandPublisher`: `request_resources` calls racing in threads once left an older
    demand in the GCS than the scheduler's last.)"""
    import threading

    from placement import actor, bundles_for
    from placement.actor import DemandPublisher

    spec = bundles_for(TOPO_1P1, use_gpus=True)
    sent: list[int] = []
    inside = threading.Lock()

    def slow_publish(specs: Any) -> bool:
        assert inside.acquire(blocking=False), "two publishes at once"
        try:
            threading.Event().wait(0.05)
            sent.append(len(specs))
        finally:
            inside.release()
        return True

    monkeypatch.setattr(actor, "publish_demand", slow_publish)

    async def go() -> None:
        tasks: list[asyncio.Task[Any]] = []
        pub = DemandPublisher(lambda coro: tasks.append(asyncio.get_running_loop().create_task(coro)))
        pub.publish([])  # the first call publishes even an empty demand
        for n in (1, 2, 3):
            pub.publish([spec] * n)
            await asyncio.sleep(0)
        pub.publish([spec] * 3)  # unchanged: nothing more
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        assert sent[-1] == 3 and len(sent) <= 2 and len(tasks) == 1  # the in-between values may be skipped
        pub.publish([spec])
        await asyncio.gather(*tasks)
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        assert sent[-1] == 1 and len(tasks) == 2 and len(pub.want) == 1
        fresh = DemandPublisher(lambda coro: tasks.append(asyncio.get_running_loop().create_task(coro)))
        fresh.publish([])  # a new scheduler clears what a predecessor asked for
        await asyncio.gather(*tasks)
        assert sent[-1] == 0 and len(tasks) == 3

    asyncio.run(go())
