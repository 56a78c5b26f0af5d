"""The chunk path's policy on virtual time (no Ray, no clock): when each chunk goes, how it is marked, and how
the typed config reaches it; `ServiceConfig`'s former flat keys of the chunk path."""

from __future__ import annotations

import pytest

from characters.chunk_policy import ChunkPathConfig, ChunkPlan, ChunkPolicy
from characters.pacing import PacingConfig, TrimPolicy
from deployments.settings import ServiceConfig

CHUNK_S = 4 / 24


def policy(**kw: object) -> ChunkPolicy:
    args: dict[str, object] = {"chunk_s": CHUNK_S, "depth": 2, "start": 10.0, "max_duration_s": 60.0,
                               "run_ahead_chunks": 2.0, "onsets": True, "urgent_chunks": 3, "preempt": True}
    return ChunkPolicy(**(args | kw))  # type: ignore[arg-type]


def test_a_chunk_waits_for_its_boundary_unless_its_window_is_full() -> None:
    p = policy()
    assert p.go_at(full=0) == 10.0 and p.go_at(full=1) == pytest.approx(10.0 - 2 * CHUNK_S)
    p.plan(10.0, speech=False, full=0)
    assert p.go_at(full=0) == pytest.approx(10.0 + CHUNK_S)  # chunk 1's boundary
    assert p.go_at(full=2) == pytest.approx(10.0 - CHUNK_S)  # two chunks of run-ahead before it
    assert policy(run_ahead_chunks=0.0).go_at(full=2) == 10.0


def test_idle_chunks_are_urgent_and_preemptible_and_never_onsets() -> None:
    p = policy()
    plans = [p.plan(10.0 + k * CHUNK_S, speech=False, full=0) for k in range(3)]
    assert plans[0] == ChunkPlan(0, 10.0, False, 0.0, True, True, None)
    assert [(x.chunk, x.onset, x.urgent, x.preemptible, x.preempt) for x in plans] == [
        (k, False, True, True, None) for k in range(3)]


def test_an_onset_takes_the_idle_chunk_in_flights_place_and_the_next_chunks_stay_urgent() -> None:
    p = policy(urgent_chunks=3)
    p.plan(10.0, speech=False, full=0)  # chunk 0, idle, in flight
    now = 10.0 + 0.05  # speech arrived with two windows queued: chunk 1 goes 0.1167 s before its boundary
    onset = p.plan(now, speech=True, full=2)
    assert (onset.chunk, onset.onset, onset.preempt, onset.preemptible) == (1, True, 0, False)
    assert onset.early_s == pytest.approx(CHUNK_S - 0.05) and onset.urgent
    assert p.must_collect()
    assert p.collected(0.1) == 10.0  # chunk 0's submit time; the room cut 0.1 s ahead of the onset
    assert p.due == pytest.approx(10.0 - 0.1 + 2 * CHUNK_S)  # the boundaries moved as much earlier
    # the speech after it, made a chunk or more ahead: urgent for the onset's burst only
    follow = [p.plan(p.due - 2 * CHUNK_S, speech=True, full=2) for _ in range(3)]
    assert [(x.onset, x.urgent) for x in follow] == [(False, True), (False, True), (False, False)]
    assert follow[-1].early_s == pytest.approx(2 * CHUNK_S)


def test_speech_without_a_second_window_or_after_speech_is_no_onset() -> None:
    p = policy()
    assert not p.plan(10.0, speech=True, full=1).onset  # the next window is not queued: about real time
    assert not p.plan(10.0, speech=True, full=2).onset  # speech after speech
    assert p.plan(10.0 + 2 * CHUNK_S - 0.01, speech=True, full=2).urgent  # less than a chunk ahead: no run-ahead
    q = policy(onsets=False)
    q.plan(10.0, speech=False, full=0)
    assert not q.plan(10.0, speech=True, full=2).onset


def test_no_preemption_unless_asked_and_nothing_to_give_up_when_nothing_is_in_flight() -> None:
    p = policy(preempt=False)
    p.plan(10.0, speech=False, full=0)
    plan = p.plan(10.0, speech=True, full=2)
    assert plan.onset and plan.preempt is None and not plan.preemptible
    assert policy().plan(10.0, speech=True, full=2).preempt is None  # an onset first: nothing in flight


def test_depth_and_max_duration() -> None:
    p = policy(depth=3, max_duration_s=1.0, first_chunk=5)
    for _ in range(2):
        p.plan(10.0, speech=False, full=0)
        assert not p.must_collect()
    p.plan(10.0, speech=False, full=0)
    assert p.must_collect() and p.submitted == 3 and p.chunk == 8
    assert not p.expired(10.99) and p.expired(11.0)


def test_the_policy_a_config_asks_for() -> None:
    cfg = ChunkPathConfig(run_ahead_chunks=1.0, urgent_chunks=1, depth=3)
    p = ChunkPolicy.of(cfg, chunk_s=CHUNK_S, start=0.0, max_duration_s=5.0, livekit=True)
    assert (p.depth, p.lead_s, p.urgent_chunks, p.preempt, p.onsets) == (3, pytest.approx(CHUNK_S), 1, True, True)
    assert not ChunkPolicy.of(cfg, chunk_s=CHUNK_S, start=0.0, max_duration_s=5.0).preempt  # a file output
    off = ChunkPolicy.of(cfg.model_copy(update={"onset_slack_s": None}), chunk_s=CHUNK_S, start=0.0,
                         max_duration_s=5.0, livekit=True)
    assert not off.onsets and not off.preempt  # no onsets: nothing to preempt for
    unpaced = ChunkPolicy.of(cfg, chunk_s=CHUNK_S, start=0.0, max_duration_s=5.0, paced=False)
    unpaced.plan(0.0, speech=False, full=0)
    assert unpaced.go_at(0) == 0.0  # back to back


def test_playout_settings_come_from_the_chunk_path_in_its_units() -> None:
    cfg = ChunkPathConfig(jitter_buffer_chunks=1.5, min_slack_s=0.15, onset_slack_s=None, audio_lead_s=0.01)
    play = cfg.playout(fps=24, frames_per_chunk=4, sample_rate=16000, audio_frame_ms=10)
    assert (play.target_depth, play.min_slack_s, play.onset_slack_s, play.audio_lead_s, play.max_catchup_s) == (
        1.5, 0.15, 0.0, 0.01, 0.01)


def test_service_config_composes_the_chunk_path_and_takes_its_former_keys_for_a_release() -> None:
    assert ServiceConfig().chunk_path == ChunkPathConfig()
    said = r"jitter_min_slack_ms is deprecated; set chunk_path.min_slack_s \(seconds\) instead"
    with pytest.warns(DeprecationWarning, match=said):
        svc = ServiceConfig(jitter_min_slack_ms=150.0, onset_slack_ms=None, pipeline_depth=3, pacing="unpaced",
                            chunk_path={"audio_lead_s": 0.03})
    assert svc.chunk_path == ChunkPathConfig(min_slack_s=0.15, onset_slack_s=None, depth=3, pacing="unpaced",
                                             audio_lead_s=0.03)
    assert (svc.jitter_min_slack_ms, svc.onset_slack_ms, svc.audio_lead_ms, svc.pipeline_depth) == (
        150.0, None, 30.0, 3)  # read in the former units
    with pytest.raises(ValueError, match="min_slack_s"):
        ServiceConfig(chunk_path={"min_slack_s": 2.0})
    with pytest.raises(AttributeError):
        ServiceConfig().no_such_field  # noqa: B018


def test_the_playouts_trim_policy_spares_only_a_full_window_of_slack() -> None:
    trims = TrimPolicy(PacingConfig(min_slack_s=0.1, slack_window_s=1.0))
    for k in range(6):  # every chunk queued 0.3 s before it was needed, one every 0.2 s
        trims.committed(k * 0.2, 0.3, onset=False, early_s=0.0)
    assert not trims.spare(0.99, 1 / 24)  # the window is not full yet
    assert trims.spare(1.0, 0.19) and not trims.spare(1.0, 0.21)  # 0.3 - 0.1 of slack to spare
    trims.take(0.15)
    assert trims.slack_min() == pytest.approx(0.15) and not trims.spare(1.0, 0.1)
    trims.committed(1.2, 0.0, onset=True, early_s=0.0)  # an onset's small slack is by design: not counted
    trims.committed(1.2, 0.5, onset=False, early_s=0.45)  # made early: only 0.05 was the pipeline's
    assert trims.slack_min() == pytest.approx(0.05)
    assert TrimPolicy(PacingConfig()).spare(0.0, 10.0)  # no min_slack_s: latency recovery is not held back


def test_the_playouts_trim_policy_sheds_after_a_deep_spell_and_lets_slow_chunks_widen_an_onsets_slack() -> None:
    trims = TrimPolicy(PacingConfig(shrink_after_s=2.0, onset_slack_s=0.02))
    assert not trims.shed_due(0.0, deep=True) and not trims.shed_due(1.9, deep=True)
    assert trims.shed_due(2.0, deep=True)
    trims.shed()
    assert not trims.shed_due(2.1, deep=True)  # a new spell starts
    assert not trims.shed_due(5.0, deep=False) and not trims.shed_due(5.1, deep=True)  # broken: starts again
    assert trims.onset_slack() == pytest.approx(0.02)
    trims.arrived(10.0, submitted_at=9.75)  # took 0.25 s: 0.0833 s beyond a chunk
    trims.arrived(10.1, submitted_at=9.9)  # queued behind it: made from the previous arrival, 0.1 s
    assert trims.onset_slack() == pytest.approx(0.02 + 0.25 - CHUNK_S)
