"""Readiness, apart from liveness (`GET /healthz`, in `deployments.api.http`: the process answers at all):

    GET /readyz   200 {"status": "ready", warmSlots, warmSlotsFree, bundlesTotal}   (no key needed)
                  503 {"error": {"code": "not_ready", ...}} + Retry-After while the scheduler does not answer, or
                  the configured warm slots have not all been warm yet

Once the warm pool has been full, readiness holds while the scheduler answers: sessions taking warm slots (or an
upgrade's drain) make a busy service, not an unready one. A cluster with no whole bundle at all (GPU nodes still
coming, the autoscaler asked) has nothing to warm: ready once the scheduler answers.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from deployments.api.errors import ApiError, error_responses
from deployments.types import Capacity

READY_RETRY_AFTER_S = 2.0
NOT_READY = "not_ready"


class CapacitySource(Protocol):
    async def capacity(self) -> Capacity: ...


class ReadyOut(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)

    status: str = "ready"
    warm_slots: int
    warm_slots_free: int
    bundles_total: int


class Readiness:
    """This replica's view: ready once `scheduler` answers and `warm_slots` slots were warm at once (latched)."""

    def __init__(self, scheduler: CapacitySource, warm_slots: int) -> None:
        self.scheduler, self.warm_slots = scheduler, warm_slots
        self._warmed = False

    async def check(self) -> ReadyOut:
        """ReadyOut, or ApiError 503 `not_ready` (or the scheduler's own 503) saying what is missing."""
        try:
            cap = await self.scheduler.capacity()
        except ApiError as e:
            raise ApiError(503, NOT_READY, f"the scheduler does not answer yet ({e.code}: {e.message})",
                           retry_after_s=READY_RETRY_AFTER_S) from e
        want = min(self.warm_slots, cap.bundles_total)
        if not self._warmed and cap.warm_slots_free + cap.sessions_running < want:
            raise ApiError(503, NOT_READY, f"{cap.warm_slots_free} of {want} warm slots are warm; the rest are being "
                           "built (weights, warm-up)", retry_after_s=READY_RETRY_AFTER_S)
        self._warmed = True
        return ReadyOut(warm_slots=self.warm_slots, warm_slots_free=cap.warm_slots_free,
                        bundles_total=cap.bundles_total)


def add_health_routes(app: FastAPI, readiness: Readiness) -> None:
    @app.get("/readyz", response_model=ReadyOut, responses=error_responses(503),
             summary="Readiness: the scheduler answers and the warm slots are warm (no key needed)")
    async def readyz() -> Any:
        return await readiness.check()
