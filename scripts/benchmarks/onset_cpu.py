"""Where the CPU goes while speech onsets are made: per-process CPU time in each onset's window, from a scheduler
trace taken during a `scripts/benchmarks/bench_latency.py --generator ray` run.

    python scripts/benchmarks/bench_latency.py --generator ray --utterances 24 --out /tmp/lat.json &
    # once the utterances run: the threads' names and nice values, then 25 s of scheduler events
    ps -eLo pid,tid,ni,comm,args > /tmp/ps.txt
    perf record -e sched:sched_switch -e sched:sched_wakeup -e sched:sched_wakeup_new -k CLOCK_MONOTONIC -a \\
        -o /tmp/sched.data -- sleep 25
    perf sched timehist -i /tmp/sched.data > /tmp/timehist.txt
    python scripts/benchmarks/onset_cpu.py --latency /tmp/lat.json --ps /tmp/ps.txt --timehist /tmp/timehist.txt \\
        --out benchmarks/cpu/onset_perf.json

An onset's window runs from its chunk's submit (first sample + agent -> room + boundary wait) to the chunk's
arrival at the room (+ DiT + decode + in flight), on the same CLOCK_MONOTONIC the bench stamps. A task's run time
counts in the window its switch-out falls in. Also: the DiT worker's share of the window while it makes the onset's
chunk (its main thread's run time over in flight + DiT, the span from submit to the DiT's end).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.benchmarks import results

LINE = re.compile(r"^\s*(\d+\.\d+)\s+\[(\d+)\]\s+(.*?)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$")
TASK = re.compile(r"^(.*)\[(\d+)(?:/(\d+))?\]$")


def process_names(ps: Path) -> dict[str, str]:
    names = {}
    for line in ps.read_text().splitlines()[1:]:
        parts = line.split(None, 4)
        if len(parts) == 5 and parts[0] == parts[1]:
            names[parts[0]] = parts[4].strip()[:48]
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", required=True, help="the bench_latency JSON of the traced run (FILE or FILE#LABEL)")
    ap.add_argument("--ps", type=Path, required=True)
    ap.add_argument("--timehist", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    names = process_names(args.ps)
    events: list[tuple[float, str, str, float]] = []  # (switch-out time, pid, comm, run ms)
    for line in args.timehist.read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        task = TASK.match(m.group(3))
        pid = (task.group(3) or task.group(2)) if task else "?"
        events.append((float(m.group(1)), pid, task.group(1) if task else m.group(3), float(m.group(6))))
    t0, t1 = events[0][0], events[-1][0]
    dit_pid = next((p for p, n in names.items() if n.startswith("ray::DiTWorker")), None)
    file, _, label = args.latency.partition("#")
    rows = [r for r in results.latest(Path(file), label or None)["rows"] if t0 < r["first_sample_at"] < t1 - 1.0]
    total: Counter[str] = Counter()
    per_onset = []
    for r in rows:
        start = r["first_sample_at"] + r["agent_to_room_s"] + r["boundary_s"]
        dit_end = start + r["in_flight_s"] + r["dit_s"]
        end = start + r["dit_s"] + r["decode_s"] + r["in_flight_s"]
        used: Counter[str] = Counter()
        dit_ms = 0.0
        for t, pid, comm, run in events:
            if start <= t <= end:
                used["idle" if comm == "<idle>" else names.get(pid, comm)] += run
            if start <= t <= dit_end and pid == dit_pid and comm.startswith("ray::DiTWorker"):
                dit_ms += run
        total.update(used)
        per_onset.append({"first_sample_at": r["first_sample_at"], "window_ms": (end - start) * 1e3,
                          "dit_share_while_making_it": dit_ms / max(1e-9, (dit_end - start) * 1e3),
                          "cpu_ms": dict(used.most_common(8))})
    n = max(1, len(per_onset))
    result = {"command": " ".join(sys.argv), "onsets": len(per_onset),
              "window_ms_mean": sum(o["window_ms"] for o in per_onset) / n,
              "cpu_ms_per_onset": {k: round(v / n, 1) for k, v in total.most_common(20)},
              "dit_share_while_making_it_mean": sum(o["dit_share_while_making_it"] for o in per_onset) / n,
              "per_onset": per_onset}
    print(f"{len(per_onset)} onsets, window {result['window_ms_mean']:.0f} ms (x2 cores of CPU); CPU ms per onset:")
    for k, v in result["cpu_ms_per_onset"].items():
        print(f"  {v:7.1f}  {k}")
    print(f"the DiT's share of its core while making the onset's chunk: {result['dit_share_while_making_it_mean']:.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.record(args.out, result)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
