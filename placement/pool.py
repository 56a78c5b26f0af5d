"""Warm slots: placement groups whose workers have loaded weights, kept across sessions.

`WarmPool` is bookkeeping only (no Ray, no I/O): the scheduler actor creates and tears down the
actual placement groups and actors and tells the pool what happened. A slot moves through

    adopt() ------------------> free / leased   (a restarted scheduler taking over slots it finds)
    add() -> warming --ready()--> free --acquire()--> leased --release(healthy=True)--> free
                 |                  |                    '---release(healthy=False)--> draining --forget()--> gone
                 '-- fail() --------+-- fail()/retire() -----------------------------> draining

`acquire` hands out a `Lease` or None ("no free warm slot" is a value, not an exception). Release
is idempotent: the first call decides, later calls with the same lease change nothing and report
the same outcome (once the slot has been forgotten they report "remove": it is gone). A slot that
failed, or whose session reports it unhealthy, is always removed, never handed out again.

``target`` is the number of slots (warming + free + leased) to keep. A healthy release always
returns the slot, so the scheduler may hand it straight to a waiting request; `surplus` then names
the free slots to retire when the pool is above target, and `deficit` how many to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SlotState = Literal["warming", "free", "leased", "draining"]
ReleaseOutcome = Literal["returned", "remove"]


@dataclass(frozen=True)
class Lease:
    """The right to use one warm slot for one session; ``lease_id`` is unique within the pool."""

    slot_id: str
    lease_id: int


@dataclass
class _Slot:
    state: SlotState
    lease_id: int = 0  # the current lease, or the last one once released
    failed: bool = False  # reported failed while leased: its release will say "remove"
    outcome: ReleaseOutcome | None = None  # outcome of releasing lease_id; None while it is held


class WarmPool:
    """Slots keyed by id with states warming / free / leased / draining (see the module docstring)."""

    def __init__(self, target: int = 0) -> None:
        self._slots: dict[str, _Slot] = {}
        self._free: dict[str, None] = {}  # free slot ids, longest free first
        self._next_lease = 1
        self._target = 0
        self.set_target(target)

    # ------------------------------------------------------------------------------------------- queries

    @property
    def target(self) -> int:
        return self._target

    def set_target(self, target: int) -> None:
        if target < 0:
            raise ValueError(f"WarmPool target={target} must be >= 0 (0: keep no idle slots)")
        self._target = target

    def state(self, slot_id: str) -> SlotState | None:
        """The slot's state, or None when the pool does not (or no longer) know it."""
        slot = self._slots.get(slot_id)
        return None if slot is None else slot.state

    def counts(self) -> dict[SlotState, int]:
        out: dict[SlotState, int] = {"warming": 0, "free": 0, "leased": 0, "draining": 0}
        for slot in self._slots.values():
            out[slot.state] += 1
        return out

    def __len__(self) -> int:
        """Live slots: warming, free and leased (draining ones are on their way out)."""
        return sum(slot.state != "draining" for slot in self._slots.values())

    def surplus(self) -> tuple[str, ...]:
        """Free slots to retire so the live count comes down to target (the most recently freed ones)."""
        extra = max(0, len(self) - self._target)
        return tuple(list(self._free)[len(self._free) - min(extra, len(self._free)) :])

    def deficit(self) -> int:
        """How many new slots to start to reach target."""
        return max(0, self._target - len(self))

    # ------------------------------------------------------------------------------------------- changes

    def add(self, slot_id: str) -> None:
        """A new slot whose placement group and workers are being created (state warming)."""
        if slot_id in self._slots:
            state = self._slots[slot_id].state
            raise ValueError(f"slot_id={slot_id!r} is already in the pool ({state}); slot ids must be unique")
        self._slots[slot_id] = _Slot("warming")

    def adopt(self, slot_id: str, *, leased: bool) -> Lease | None:
        """A ready slot that outlived the scheduler which made it (found on the cluster by a restarted
        scheduler): free, or leased to the session running on it, whose new lease is returned."""
        if slot_id in self._slots:
            state = self._slots[slot_id].state
            raise ValueError(f"slot_id={slot_id!r} is already in the pool ({state}); adopt each slot once")
        if not leased:
            self._slots[slot_id] = _Slot("free")
            self._free[slot_id] = None
            return None
        self._slots[slot_id] = _Slot("leased", self._next_lease)
        self._next_lease += 1
        return Lease(slot_id, self._slots[slot_id].lease_id)

    def ready(self, slot_id: str) -> bool:
        """Warming finished: the slot becomes free. False (no change) if it failed or was retired meanwhile."""
        slot = self._get(slot_id)
        if slot.state == "draining":
            return False
        if slot.state != "warming":
            raise ValueError(f"slot {slot_id!r} is {slot.state}, not warming; ready() is for newly warmed slots")
        slot.state = "free"
        self._free[slot_id] = None
        return True

    def acquire(self) -> Lease | None:
        """Lease the slot that has been free longest, or None when no warm slot is free."""
        if not self._free:
            return None
        slot_id = next(iter(self._free))
        del self._free[slot_id]
        slot = self._slots[slot_id]
        slot.state, slot.lease_id, slot.outcome, slot.failed = "leased", self._next_lease, None, False
        self._next_lease += 1
        return Lease(slot_id, slot.lease_id)

    def release(self, lease: Lease, *, healthy: bool) -> ReleaseOutcome:
        """End a lease: "returned" (free again, state reset by the caller) or "remove" (tear it down)."""
        slot = self._slots.get(lease.slot_id)
        if slot is None:
            return "remove"  # already forgotten: it was removed
        if lease.lease_id > slot.lease_id or lease.lease_id < 1:
            raise ValueError(f"{lease} was not issued by this pool (slot's last lease is {slot.lease_id})")
        if lease.lease_id < slot.lease_id:
            return "returned"  # an older lease: the slot was returned, or it could not have been leased again
        if slot.outcome is not None:
            return slot.outcome  # repeated release: no-op
        if healthy and not slot.failed:
            slot.state, slot.outcome = "free", "returned"
            self._free[lease.slot_id] = None
        else:
            slot.state, slot.outcome = "draining", "remove"
        return slot.outcome

    def fail(self, slot_id: str) -> None:
        """A slot's worker failed: it will be removed (now, or when its lease is released). Idempotent."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.state == "draining":
            return
        if slot.state == "leased":
            slot.failed = True
            return
        self._free.pop(slot_id, None)
        slot.state = "draining"

    def retire(self, slot_id: str) -> None:
        """Take a free slot out of service (e.g. one named by `surplus`): it becomes draining."""
        slot = self._get(slot_id)
        if slot.state != "free":
            raise ValueError(f"slot {slot_id!r} is {slot.state}; only a free slot can be retired")
        del self._free[slot_id]
        slot.state = "draining"

    def forget(self, slot_id: str) -> None:
        """The draining slot's placement group and actors are gone: drop it. Idempotent."""
        slot = self._slots.get(slot_id)
        if slot is None:
            return
        if slot.state != "draining":
            raise ValueError(f"slot {slot_id!r} is {slot.state}; fail(), retire() or release it before forget()")
        del self._slots[slot_id]

    def _get(self, slot_id: str) -> _Slot:
        slot = self._slots.get(slot_id)
        if slot is None:
            raise KeyError(f"slot_id={slot_id!r} is not in the pool; known slots: {sorted(self._slots)}")
        return slot
