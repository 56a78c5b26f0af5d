"""The `57b` speech latency budget: agent speech -> heard at the viewer, built from measured stage times.

    python scripts/latency_budget.py                       # writes benchmarks/latency_budget_57b.json
    python scripts/latency_budget.py --cpu-run benchmarks/latency_cpu_ray.json   # one CPU run's host-side parts

The same definition as `scripts/bench_latency.py` (the agent's first speech sample -> the first audio of it at
a plain LiveKit subscriber), with the same chunk path (`deployments.pipeline.graph.run_chunk_loop`: a chunk whose
audio is queued goes at once; the first speech after idle plays as soon as it reaches the room,
`characters.pacing` speech onsets). No `57b` session has run end to end on 4 or 3 DiT GPUs (no machine of that
size was lent), so each row adds up parts measured apart, p50 each:

- agent -> the room and the wait for a full window of speech: the CPU runs' (`--cpu-run`, the embedded default
  through the real pipeline on 2 cores, default configuration; a GPU host's free cores only make these shorter):
  the median over the runs of each run's p50, as the machine's speed moves by the hour (the default: every
  `latency_cpu_ray_run*.json` and `latency_cpu_ray_dec04*_run*.json` run);
- the wait for the DiT: the onset chunk queues behind the chunk the DiT is making. The DiT is busy rho = dit /
  chunk of the time, so for speech arriving at a random time the wait is 0 with probability 1 - rho, else
  uniform over (0, dit): its median is dit * (rho - 1/2) / rho (0 when rho <= 1/2);
- the DiT rank step (one rank's compute; the collectives of 3 and 4 ranks were never measured: a floor),
  the NCCL latent handoff (`benchmarks/h200*/`);
- the decoder up to the onset chunk's first frame on the host (`DecoderWorker.decode_first`: the room plays that
  frame while the decoder makes the other three; `scripts/bench_decoder.py --first-frame`). The rest must reach
  the room before the first frame has played (its audio lead aside): `rest_fits` checks rest + publish against a
  frame plus the onset's slack;
- the room's publish call into a real LiveKit room at 704x1088, for an onset chunk (`scripts/bench_publish.py`,
  on the 2-core CPU: a GPU host's cores are faster);
- the onset's slack (`ServiceConfig.onset_slack_ms`): an onset's audio is due that long after the chunk reached
  the room, to the sample (the cut takes part of a frame too, so there is no wait for the frame grid);
- the audio lead (`ServiceConfig.audio_lead_ms`): the audio goes to the LiveKit audio source that long before
  its frame is shown, and its queue plays it then;
- shown -> heard: the CPU runs' (the LiveKit server, the subscriber's jitter buffer; `network_s`), the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.settings import ServiceConfig

ROOT = Path(__file__).resolve().parents[1]
CHUNK_MS = 4 / 24 * 1e3
TARGET_MS = 350.0


def dit_wait_ms(dit_ms: float) -> float:
    """Median wait of speech arriving at a random time for a DiT that is busy dit / chunk of the time."""
    rho = min(1.0, dit_ms / CHUNK_MS)
    return 0.0 if rho <= 0.5 else dit_ms * (rho - 0.5) / rho


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def fp8_row(path: Path, variant: str) -> float:
    return float(next(r["ms_p50"] for r in load(path)["rows"] if r["variant"] == variant))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-run", type=Path, nargs="+", default=None,
                    help="scripts/bench_latency.py --generator ray JSONs (the host-side parts: the median of their "
                         "p50s; default: the default-configuration runs in benchmarks/)")
    ap.add_argument("--publish", type=Path, default=ROOT / "benchmarks" / "publish_57b_cpu.json",
                    help="a scripts/bench_publish.py --preset 57b JSON")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "latency_budget_57b.json")
    args = ap.parse_args()
    b = ROOT / "benchmarks"
    runs = args.cpu_run or sorted([*b.glob("latency_cpu_ray_run*.json"), *b.glob("latency_cpu_ray_dec04*_run*.json")])
    cpu_runs = [load(p) for p in runs]
    host_ins = [(r["split"]["agent_to_room_s"]["p50"] + r["split"]["boundary_s"]["p50"]) * 1e3 for r in cpu_runs]
    networks = [r["split"]["network_s"]["p50"] * 1e3 for r in cpu_runs]
    pipeline = load(b / "h200x2" / "pipeline_57b_L15_1p1.json")["variants"][0]["sessions"][0]["stage_ms"]
    split = load(b / "h200" / "decoder_57b_first_frame.json")["first_frame"]
    decode, rest = float(split["first_to_host_ms"]), float(split["rest_to_host_ms"])
    publish = load(args.publish)
    service = ServiceConfig()
    onset_slack = float(service.onset_slack_ms or 0.0)
    for path, run in zip(runs, cpu_runs, strict=True):  # host parts measured with the budget's own settings only
        if (run.get("onset_slack_ms"), run.get("audio_lead_ms")) != (onset_slack, float(service.audio_lead_ms)):
            raise ValueError(f"{path}: ran with onset_slack_ms={run.get('onset_slack_ms')}, audio_lead_ms="
                             f"{run.get('audio_lead_ms')}; the budget takes ServiceConfig's ({onset_slack:g}, "
                             f"{service.audio_lead_ms:g}): give runs made with those (--cpu-run)")
    sources = {
        "host_parts": {"runs": [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in runs],
                       "agent_to_room_and_window_ms": {"median": statistics.median(host_ins), "min": min(host_ins),
                                                       "max": max(host_ins)},
                       "shown_to_heard_ms": {"median": statistics.median(networks), "min": min(networks),
                                             "max": max(networks)}},
        "decode": "benchmarks/h200/decoder_57b_first_frame.json (first_to_host_ms: the onset's first frame, "
                  f"{decode:.1f} ms; the whole chunk to the host: {float(split['whole_to_host_ms']):.1f} ms)",
        "handoff": "benchmarks/h200x2/pipeline_57b_L15_1p1.json (depth 2)",
        "publish": f"{args.publish.relative_to(ROOT) if args.publish.is_relative_to(ROOT) else args.publish} "
                   "(onset chunks)",
        "onset_slack, audio_lead": f"ServiceConfig defaults ({onset_slack:g} ms, {service.audio_lead_ms:g} ms), "
                                   "as every CPU run's",
    }
    topologies = [
        ("4 + 1, bf16", float(load(b / "h200" / "step_57b_h100x5_rank.json")["modes"]["write_time"]["ms_p50"]),
         "benchmarks/h200/step_57b_h100x5_rank.json (write_time)"),
        ("4 + 1, FP8 linear", fp8_row(b / "h200" / "step_57b_tp4_fp8.json", "sp:fp8:bf16"),
         "benchmarks/h200/step_57b_tp4_fp8.json (sp:fp8:bf16)"),
        ("3 + 1, FP8 linear", fp8_row(b / "h200" / "step_57b_tp3_fp8.json", "sp:fp8:bf16"),
         "benchmarks/h200/step_57b_tp3_fp8.json (sp:fp8:bf16)"),
        ("4 + 1, FP8 + cuDNN FP8 attn", fp8_row(b / "h200" / "step_57b_tp4_fp8_cudnn.json", "sp:fp8:fp8-cudnn"),
         "benchmarks/h200/step_57b_tp4_fp8_cudnn.json (sp:fp8:fp8-cudnn)"),
        ("3 + 1, FP8 + cuDNN FP8 attn", fp8_row(b / "h200" / "step_57b_tp3_fp8_cudnn.json", "sp:fp8:fp8-cudnn"),
         "benchmarks/h200/step_57b_tp3_fp8_cudnn.json (sp:fp8:fp8-cudnn; the same code's runs and the code "
         "before: step_57b_tp3_ab.json)"),
    ]
    host_in, network = statistics.median(host_ins), statistics.median(networks)
    rows = []
    for name, dit, source in topologies:
        parts = {
            "agent_to_room_and_window_ms": host_in,
            "wait_for_dit_ms": dit_wait_ms(dit),
            "dit_ms": dit,
            "handoff_ms": float(pipeline["handoff"]),
            "decode_first_frame_ms": decode,
            "publish_ms": float(publish["publish_ms"]["onset"]["p50"]),
            "onset_slack_ms": onset_slack,
            "audio_lead_ms": float(service.audio_lead_ms),
            "shown_to_heard_ms": network,
        }
        total = sum(parts.values())
        rest_needs = rest + parts["publish_ms"]  # the other three frames, to the room
        rest_has = 1e3 / 24 + onset_slack  # before the first frame's audio has played out of the slack
        rows.append({"topology": name, "dit_source": source, **{k: round(v, 1) for k, v in parts.items()},
                     "total_ms": round(total, 1), "target_ms": TARGET_MS, "met": total <= TARGET_MS,
                     "rest_ms": round(rest_needs, 1), "rest_due_ms": round(rest_has, 1),
                     "rest_fits": rest_needs <= rest_has})
    result = {"command": " ".join(["python", *sys.argv]), "definition": __doc__, "sources": sources, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    keys = [k for k in rows[0] if k.endswith("_ms") and k not in ("total_ms", "target_ms", "rest_ms", "rest_due_ms")]
    print(f"{'57b, ms (p50)':<29}" + "".join(f"{k.removesuffix('_ms')[:12]:>13}" for k in keys) + f"{'total':>8}")
    for r in rows:
        print(f"{r['topology']:<29}" + "".join(f"{r[k]:>13.1f}" for k in keys)
              + f"{r['total_ms']:>8.1f}" + ("" if r["met"] else "  > 350")
              + f"   rest {r['rest_ms']:.1f} ms, due within {r['rest_due_ms']:.1f}"
              + ("" if r["rest_fits"] else " (LATE)"))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
