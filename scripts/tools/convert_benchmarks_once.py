"""One-off (issue 43): turn benchmarks/'s file-per-run JSON into one file per measurement, runs as entries.

    python scripts/tools/convert_benchmarks_once.py

Each old file becomes one run entry (`scripts/benchmarks/results.py`'s shape) whose figures are the file's content
unchanged; its date and commit are those of the commit that last wrote the file, its machine the one the file names
(else its folder's), its command the one it recorded, its label the old file name. Runs grouped by measurement:
the name without its `_runN`, `_vN` and date tags. Superseded runs that no page cited are dropped (git keeps them).
Kept in git history only; run once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.results import entry, write  # noqa: E402

B = ROOT / "benchmarks"
# superseded by a later run of the same measurement and cited nowhere (README, docs, code, tests) before the change
DROPPED = {"h200/attention_fp8_v1", "h200/step_57b_tp4_fp8_v1", "h200/step_57b_tp4_fp8_v2",
           "h200/step_wan-1.3b_fp8_v1", "h200x2/tp_57b_2_cuda", "h200x2/tp_57b_2_symm"}
# the loose CPU files: old stem -> measurement (benchmarks/cpu/<measurement>.json)
CPU = {
    "admission_cpu": "admission", "agree_cpu": "agree", "cpu_tiny": "compute_tiny", "cpu_tiny_2steps": "compute_tiny",
    "decoder_tiny_cpu_first_frame_xeon": "decoder_tiny_first_frame", "dit_build_57b_L4_tp3_cpu": "dit_build_57b_tp3",
    "dit_build_57b_L8_tp3_cpu": "dit_build_57b_tp3", "loadtest_cpu": "loadtest", "onset_cpu_perf": "onset_perf",
    "publish_57b_cpu": "publish_57b", "soak_cpu": "soak", "soak_multinode_cpu_57min": "soak_multinode",
    "soak_multinode_cpu": "soak_multinode", "step_tiny_cpu_cpu": "step_tiny", "telemetry_cpu": "telemetry",
    "train_tiny_cpu": "train_tiny", "voice_agent_flow_cpu": "voice_agent_flow",
    "stress_process_group_plain_cpu": "stress_process_group",
    "stress_process_group_process_group_cpu": "stress_process_group",
    "latency_cpu_synthetic": "latency_synthetic", "latency_cpu_tiny": "latency_tiny",
}
ESTIMATES = {"latency_budget_57b": "latency_budget_57b", "fleet_sim": "fleet_sim"}
DEFAULT_LATENCY = re.compile(r"latency_cpu_ray(_run\d+|_dec\d\d[a-z]?_run\d+)?$")


def destination(rel: str) -> tuple[str, str]:
    """(machine kind, measurement) of an old file (path relative to benchmarks/, no suffix)."""
    kind, _, stem = rel.rpartition("/")
    if not kind:
        if stem in ESTIMATES:
            return "estimates", ESTIMATES[stem]
        if DEFAULT_LATENCY.match(stem):
            return "cpu", "latency_ray"
        if stem.startswith("latency_cpu_ray_"):
            return "cpu", "latency_ray_variants"
        if stem.startswith("pipeline_tiny_small_2+1"):
            return "cpu", "pipeline_tiny_small_2+1"
        if stem.startswith("lipsync_tiny"):
            return "cpu", "lipsync_tiny"
        return "cpu", CPU[stem]
    return kind, re.sub(r"(_v\d+|_run\d+)$", "", stem)


def added(path: Path) -> tuple[str, str]:
    """(commit, date) of the last commit that wrote `path`: when its content was measured and committed."""
    out = subprocess.run(["git", "log", "-1", "--format=%h %cI", "--", str(path.relative_to(ROOT))],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return (out[-2], out[-1]) if out else ("unknown", "unknown")


def machine_of(kind: str, data: dict[str, Any]) -> str:
    m, device = data.get("machine"), data.get("device")
    if kind in ("h100", "h200", "h200x2"):
        name = device if isinstance(device, str) and device.startswith("NVIDIA") else \
            {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200", "h200x2": "NVIDIA H200"}[kind]
        return ("2 x " if kind == "h200x2" else "1 x ") + name
    if kind == "estimates":
        return "none: computed from other measurements"
    cpu = None
    if isinstance(m, dict):
        cpu = m.get("cpu")
    cpu = cpu or data.get("cpu") or (device if isinstance(device, str) and device not in ("cpu", "cuda") else None)
    return f"2-core {cpu} VM" if cpu and cpu != "unknown" else "2-core x86-64 VM"


def order(label: str) -> tuple[int, str]:
    m = re.search(r"_v(\d+)$", label)
    return (int(m.group(1)) if m else 1000, label)


def main() -> None:
    groups: dict[tuple[str, str], list[tuple[str, str, dict[str, Any], Path]]] = {}
    for path in sorted(B.rglob("*.json")):
        rel = str(path.relative_to(B).with_suffix(""))
        if rel.split("/")[0] in ("cpu", "estimates") and rel.count("/"):
            continue
        data = json.loads(path.read_text())
        if "runs" in data and "measurement" in data:
            continue  # already converted
        kind, measurement = destination(rel)
        sha, date = added(path)
        groups.setdefault((kind, measurement), []).append((date, sha, data, path))
    for (kind, measurement), found in sorted(groups.items()):
        found.sort(key=lambda t: (t[0], order(t[3].stem)))
        runs = []
        for date, sha, data, path in found:
            rel = str(path.relative_to(B).with_suffix(""))
            path.unlink()
            if rel in DROPPED:
                continue
            runs.append(entry(data, label=path.stem, command_line=str(data.get("command") or "not recorded"),
                              machine_name=machine_of(kind, data), date=date, commit_id=sha))
        write(B / kind / f"{measurement}.json", {"measurement": measurement, "runs": runs})
        print(f"benchmarks/{kind}/{measurement}.json: {len(runs)} runs")


if __name__ == "__main__":
    main()
