"""WarmPool: leases, idempotent release, removal of failed slots, surplus (pure CPU, no marker)."""

from __future__ import annotations

import pytest

from placement import Lease, WarmPool


def test_pool_acquire_release_idempotent() -> None:
    pool = WarmPool(target=2)
    assert pool.acquire() is None
    pool.add("s1")
    assert pool.acquire() is None  # warming slots are not handed out
    assert pool.ready("s1") is True
    lease = pool.acquire()
    assert lease == Lease("s1", 1) and pool.state("s1") == "leased"
    assert pool.acquire() is None
    assert pool.release(lease, healthy=True) == "returned"
    assert pool.release(lease, healthy=False) == "returned"  # second release: no-op, same answer
    assert pool.state("s1") == "free"
    lease2 = pool.acquire()
    assert lease2 == Lease("s1", 2)
    assert pool.release(lease, healthy=False) == "returned"  # stale lease cannot touch the new one
    assert pool.state("s1") == "leased"
    with pytest.raises(ValueError, match="not issued by this pool"):
        pool.release(Lease("s1", 9), healthy=True)


def test_pool_unhealthy_slot_is_always_removed() -> None:
    pool = WarmPool(target=5)
    pool.add("s1")
    pool.ready("s1")
    lease = pool.acquire()
    assert lease is not None
    assert pool.release(lease, healthy=False) == "remove"
    assert pool.release(lease, healthy=True) == "remove"
    assert pool.state("s1") == "draining" and pool.acquire() is None
    pool.forget("s1")
    pool.forget("s1")
    assert pool.state("s1") is None
    assert pool.release(lease, healthy=True) == "remove"
    # Failure reported while leased: a healthy-looking release still removes it.
    pool.add("s2")
    pool.ready("s2")
    lease = pool.acquire()
    assert lease is not None
    pool.fail("s2")
    assert pool.state("s2") == "leased"
    assert pool.release(lease, healthy=True) == "remove"
    # Failure while free or warming: out of service at once.
    pool.add("s3")
    pool.ready("s3")
    pool.fail("s3")
    pool.add("s4")
    pool.fail("s4")
    assert pool.ready("s4") is False
    assert (pool.state("s3"), pool.state("s4"), pool.acquire()) == ("draining", "draining", None)
    assert pool.counts() == {"warming": 0, "free": 0, "leased": 0, "draining": 3}


def test_pool_fifo_surplus_and_deficit() -> None:
    pool = WarmPool(target=1)
    for s in ("s1", "s2", "s3"):
        pool.add(s)
    assert pool.deficit() == 0 and pool.surplus() == ()  # warming slots are never surplus
    for s in ("s1", "s2", "s3"):
        pool.ready(s)
    assert pool.surplus() == ("s2", "s3")
    a = pool.acquire()
    assert a == Lease("s1", 1)
    assert pool.surplus() == ("s2", "s3")
    b = pool.acquire()
    assert b == Lease("s2", 2)
    assert pool.release(a, healthy=True) == "returned"
    assert pool.surplus() == ("s3", "s1")  # free order: s3 (longest free), then s1
    pool.retire("s1")
    pool.retire("s3")
    assert pool.surplus() == () and len(pool) == 1
    assert pool.counts() == {"warming": 0, "free": 0, "leased": 1, "draining": 2}
    pool.set_target(4)
    assert pool.deficit() == 3
    with pytest.raises(ValueError, match="only a free slot"):
        pool.retire("s2")
    with pytest.raises(ValueError, match="before forget"):
        pool.forget("s2")
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add("s2")
    with pytest.raises(KeyError, match="not in the pool"):
        pool.ready("nope")
    with pytest.raises(ValueError, match="target=-1"):
        WarmPool(target=-1)
