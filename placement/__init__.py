"""GPU bundle math and the pure admission policy; a thin Ray actor (elsewhere) applies its decisions.

Nothing in this package's pure modules imports Ray: they are tested exhaustively on plain values.
"""

from placement.bundles import (
    ACCELERATOR_SHARE,
    PlacementSpec,
    Role,
    RoleKind,
    accelerator_resource,
    bundles_for,
)
from placement.policy import (
    DEFAULT_RETRY_AFTER_S,
    AdmissionQueue,
    Admit,
    Decision,
    Enqueue,
    Expire,
    NodeCapacity,
    Reject,
    Request,
    apply,
    best_fit,
    commit,
    decide,
    drain,
    explain_fit,
    fits,
    free_bundles,
    release,
    retry_after,
)
from placement.pool import Lease, ReleaseOutcome, SlotState, WarmPool

__all__ = [
    "ACCELERATOR_SHARE",
    "DEFAULT_RETRY_AFTER_S",
    "AdmissionQueue",
    "Admit",
    "Decision",
    "Enqueue",
    "Expire",
    "Lease",
    "NodeCapacity",
    "PlacementSpec",
    "Reject",
    "ReleaseOutcome",
    "Request",
    "Role",
    "RoleKind",
    "SlotState",
    "WarmPool",
    "accelerator_resource",
    "apply",
    "best_fit",
    "bundles_for",
    "commit",
    "decide",
    "drain",
    "explain_fit",
    "fits",
    "free_bundles",
    "release",
    "retry_after",
]
