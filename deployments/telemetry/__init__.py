"""OpenTelemetry for the service: traces and metrics of requests, admission, slots, sessions and chunks.

Off by default; configured by the standard OTEL_* variables (deployments/settings.py). Every Ray
actor sets its own process up on start (`setup(component)`). Names: `deployments.telemetry.names`.
Operators' guide: docs/operations.md.
"""

from deployments.telemetry import names
from deployments.telemetry.admission import Admission, SchedulerTelemetry, SlotTrace, leaked_placement_groups
from deployments.telemetry.core import (
    Instrument,
    Telemetry,
    context_of,
    current,
    extract,
    fail,
    inject,
    links_to,
    reset_for_tests,
    setup,
    span_context,
    time_ns_of,
)
from deployments.telemetry.session import ChunkSampler, SessionTelemetry

__all__ = ["Admission", "ChunkSampler", "Instrument", "SchedulerTelemetry", "SessionTelemetry", "SlotTrace",
           "Telemetry", "context_of", "current", "extract", "fail", "inject", "leaked_placement_groups", "links_to",
           "names", "reset_for_tests", "setup", "span_context", "time_ns_of"]
