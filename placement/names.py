"""Names of a slot's placement group and actors: the convention a restarted scheduler rebuilds its
ledger from (no Ray here; `deployments.sessions.adoption` reads the cluster).

    placement group   <slot_id>@<scheduler>         e.g. slot-1a2b3c4d5e@characters-scheduler
    workers           <slot_id>.dit<rank>, <slot_id>.decoder, <slot_id>.room
    session actor     <slot_id>.session.<hex>       (one per slot, its driver: serves its sessions)

Slot ids are `slot-<10 hex>`, unique across schedulers; the owner in the group's name keeps schedulers
of one cluster (tests run several) from adopting each other's slots.
"""

from __future__ import annotations

import re
from typing import Literal

SLOT_PREFIX = "slot-"
_PG = re.compile(r"^(slot-[0-9a-f]+)@(.+)$")


def pg_name(slot_id: str, owner: str) -> str:
    """The placement group name of `slot_id`, made by scheduler `owner`."""
    if not slot_id.startswith(SLOT_PREFIX) or "@" in slot_id or "@" in owner or not owner:
        raise ValueError(f"slot_id={slot_id!r} must start with {SLOT_PREFIX!r} and neither it nor owner={owner!r} "
                         "may contain '@' (owner must be non-empty)")
    return f"{slot_id}@{owner}"


def parse_pg_name(name: str) -> tuple[str, str] | None:
    """(slot_id, owner) of a slot's placement group name; None for any other group."""
    m = _PG.match(name)
    return (m.group(1), m.group(2)) if m else None


def worker_name(slot_id: str, role: Literal["dit", "decoder", "room"], rank: int = 0) -> str:
    return f"{slot_id}.dit{rank}" if role == "dit" else f"{slot_id}.{role}"


def session_actor_name(slot_id: str, tag: str) -> str:
    return f"{slot_id}.session.{tag}"


def session_actors_of(slot_id: str, names: list[str]) -> list[str]:
    """The session actor names of `slot_id` among `names`, sorted."""
    prefix = f"{slot_id}.session."
    return sorted(n for n in names if n.startswith(prefix))
