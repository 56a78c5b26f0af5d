"""The pure parts of fault handling and recovery: slot naming, adopting slots into the warm pool,
a session's audio history and the priming windows cut from it (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from characters.audio import chunk_sample_range
from deployments.sessions.recovery import History, prime_windows, recoverable
from deployments.types import SessionStats
from placement import Lease, WarmPool
from placement.names import parse_pg_name, pg_name, session_actor_name, session_actors_of, worker_name


def test_slot_names_round_trip_and_scope_to_their_scheduler() -> None:
    assert pg_name("slot-0a1b2c3d4e", "characters-scheduler") == "slot-0a1b2c3d4e@characters-scheduler"
    assert parse_pg_name("slot-0a1b2c3d4e@characters-scheduler") == ("slot-0a1b2c3d4e", "characters-scheduler")
    assert parse_pg_name("slot-0a1b2c3d4e") is None  # an old unnamed-owner group: not adopted
    assert parse_pg_name("SERVE_REPLICA::x@y") is None
    with pytest.raises(ValueError, match="must start with 'slot-'"):
        pg_name("warm-1", "s")
    with pytest.raises(ValueError, match="'@'"):
        pg_name("slot-1", "a@b")
    assert [worker_name("slot-1", "dit", 2), worker_name("slot-1", "decoder"), worker_name("slot-1", "room")] == [
        "slot-1.dit2", "slot-1.decoder", "slot-1.room"]
    names = ["slot-1.dit0", session_actor_name("slot-1", "bb"), session_actor_name("slot-1", "aa"),
             session_actor_name("slot-10", "cc")]
    assert session_actors_of("slot-1", names) == ["slot-1.session.aa", "slot-1.session.bb"]


def test_adopted_slots_are_free_or_leased_and_behave_like_any_other() -> None:
    pool = WarmPool(target=2)
    pool.add("slot-new")
    assert pool.adopt("slot-free", leased=False) is None
    lease = pool.adopt("slot-busy", leased=True)
    assert lease == Lease("slot-busy", 1)
    assert pool.counts() == {"warming": 1, "free": 1, "leased": 1, "draining": 0}
    assert pool.deficit() == 0 and pool.surplus() == ("slot-free",)  # 3 live slots, target 2
    assert pool.acquire() == Lease("slot-free", 2)  # lease ids stay unique across adopted slots
    assert pool.release(lease, healthy=True) == "returned" and pool.state("slot-busy") == "free"
    with pytest.raises(ValueError, match="already in the pool"):
        pool.adopt("slot-busy", leased=False)


def test_history_resumes_from_published_chunks_and_replays_the_lost_ones() -> None:
    h = History(keep=2)
    pcm = [np.full(n, k, np.float32) for k, n in enumerate([3, 4, 3, 4, 3])]
    for k, p in enumerate(pcm):
        assert h.taken(k, p) is p
    for k in range(3):
        h.on_published(k)  # chunks 3 and 4 were in flight when the bundle was lost
    r = h.resume(chunks=3, queued=np.array([9, 9], np.float32), stats=SessionStats(chunks=3), attempt=1,
                 reason="actor_died: DiTWorker rank 0 died")
    assert (r.chunks, r.primed, r.attempt) == (3, 2, 1)
    assert r.prime.tolist() == [1.0] * 4 + [2.0] * 3  # the last `keep` published chunks, oldest first
    assert r.pending.tolist() == [3.0] * 4 + [4.0] * 3 + [9.0, 9.0]  # unpublished speech, then the queue
    empty = History(keep=4).resume(chunks=0, queued=np.zeros(0, np.float32), stats=SessionStats(), attempt=1,
                                   reason="")
    assert (empty.primed, empty.prime.size, empty.pending.size) == (0, 0, 0)


def test_prime_windows_have_each_local_chunks_exact_length_and_the_newest_audio() -> None:
    fpc, rate, fps = 4, 16000, 24
    total = chunk_sample_range(2, fpc, rate, fps)[1]
    stream = np.arange(total + 5, dtype=np.float32)  # a little longer than 3 local chunks
    windows = prime_windows(stream, 3, fpc, rate, fps)
    assert [w.size for w in windows] == [b - a for a, b in (chunk_sample_range(j, fpc, rate, fps) for j in range(3))]
    assert np.concatenate(windows).tolist() == stream[5:].tolist()
    short = prime_windows(np.ones(10, np.float32), 1, fpc, rate, fps)[0]
    assert short[:-10].sum() == 0 and short[-10:].tolist() == [1.0] * 10  # silence in front
    assert prime_windows(stream, 0, fpc, rate, fps) == []


def test_only_failures_a_new_bundle_can_cure_are_recovered() -> None:
    assert recoverable("actor_died: DecoderWorker died (ActorDiedError)")
    assert recoverable("session_failed: actor_died: SessionActor died (ActorDiedError)")
    assert recoverable("chunk_timeout: GetTimeoutError")
    assert recoverable("start_failed: actor_died: RoomWorker died")
    assert not recoverable("worker_error: step raised SessionMismatch: ...")
    assert not recoverable("start_failed: worker_error: encode_reference raised ValueError: ...")
    assert not recoverable("max_duration")
