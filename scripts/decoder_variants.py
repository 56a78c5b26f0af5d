"""Train several light-decoder variants for the frozen tiny encoder and DiT on one GPU, and score each one's lip sync.

    python scripts/decoder_variants.py --out DIR --variants enc_sig,teach_sig,kt3_teach_sig --workers 16

One GPU session (the GPU machine's CPU cores do the CPU parts):
1. the DiT's latents of the 51 held-out clips, generated once on the CPU exactly as `scripts/eval_lipsync.py` does
   (clip i with noise seed i); the shipped light decoder and the previous full-resolution one ("conv", from git) are
   scored on them first, per clip: they gave the records of the time, 0.646 and 0.736, to 4 digits;
2. the training split rendered once and its DiT latents (`--dit-seeds` generations per clip) on the CPU, the
   encoder's latents on the GPU (`characters.train.fit_decoder.build_data`), saved for the trainers;
3. up to `--parallel` variants trained at once, each in its own process on the one GPU
   (`characters.train.fit_decoder.fit_decoder`), all stopped at `--train-seconds` at the latest;
4. each variant's lip sync on the held-out clips through the CPU serving decoder (`score_decoder`): mean, median
   and min of the per-clip r at the best offset, and every clip's r.

Variants marked so start from the shipped light decoder (in the recorded run, the first light decoder: commit dcb4d8a).
Writes DIR/variants.json (updated as each result comes in) and DIR/weights.tar (each variant's decoder, model.json
and loss history). `--teacher` is a directory with the conv decoder's `vae_decoder.safetensors` (default: the one
tiny shipped before the light decoder, taken from git:
`for f in vae_decoder.safetensors model.json; do git show 8738687^:characters/weights/tiny/$f > .cache/conv_decoder/$f;
done`). The recorded run (benchmarks/lipsync_tiny_decoder_variants.json):
`python scripts/decoder_variants.py --out DIR --workers 16 --parallel 10 --steps 1500 --train-seconds 400`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from characters.config import ModelConfig, SessionConfig, session_config  # noqa: E402
from characters.train.data import TEST_CLIPS, TRAIN_CLIPS, load_or_build  # noqa: E402
from characters.train.fit_decoder import (  # noqa: E402
    DecoderData,
    DecoderFitConfig,
    build_data,
    dit_latents,
    fit_decoder,
    render_frames,
    score_decoder,
)
from characters.vae import CausalDecoder, VAEEncoder  # noqa: E402
from characters.weights import SHIPPED, load_weights, save_model_config, save_weights  # noqa: E402

# name -> (vae overrides of the tiny preset, start from the shipped light decoder?, DecoderFitConfig fields)
SIG = {"signal_weight": 2.0}
TEACH = {"dit_share": 0.5, "dit_target": "teacher"}
VARIANTS: dict[str, tuple[dict[str, Any], bool, dict[str, Any]]] = {
    "enc": ({}, True, {}),
    "enc_sig": ({}, True, SIG),
    "teach": ({}, True, TEACH),
    "teach_sig": ({}, True, {**TEACH, **SIG}),
    "truth_sig": ({}, True, {"dit_share": 0.5, "dit_target": "truth", **SIG}),
    "teach_sig8": ({}, True, {**TEACH, "signal_weight": 8.0}),
    "teach_all_sig": ({}, True, {**TEACH, **SIG, "dit_share": 1.0}),
    "teach_sig_scratch": ({}, False, {**TEACH, **SIG, "lr": 2e-3}),
    "kt3_teach_sig": ({"decoder_last_kt": 3}, True, {**TEACH, **SIG}),
    "w12_teach_sig": ({"decoder_last_channels": 12}, True, {**TEACH, **SIG}),
}
SHIPPED_FILES = ("dit.safetensors", "audio.safetensors", "vae_encoder.safetensors")


def weights_dir(path: Path, model: ModelConfig, decoder: Path | CausalDecoder) -> Path:
    """A weights directory: the shipped tiny DiT, audio and encoder files, `model`, and this decoder."""
    path.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        shutil.copyfile(SHIPPED / "tiny" / name, path / name)
    save_model_config(model, path)
    if isinstance(decoder, Path):
        shutil.copyfile(decoder, path / "vae_decoder.safetensors")
    else:
        save_weights(decoder, path / "vae_decoder.safetensors")
    return path


def session(vae: dict[str, Any], weights: Path) -> SessionConfig:
    return session_config("tiny", "cpu", weights=str(weights), model={"vae": vae} if vae else {})


def train_one(args: argparse.Namespace) -> None:
    """One variant in this process (launched by `main`)."""
    vae, from_shipped, fields = VARIANTS[args.train_one]
    cfg = session_config("tiny", "cpu", model={"vae": vae} if vae else {}, weights="random").model
    bank = torch.load(args.bank, mmap=True)
    on_device: dict[str, Any] = {k: v.numpy() if k in ("first", "count") else v.to(args.device) if v is not None
                                 else v for k, v in bank.items()}
    data = DecoderData(**on_device)
    fc = DecoderFitConfig(steps=args.steps, batch=args.batch, seed=args.seed, device=args.device, **fields)
    init = None
    if from_shipped:
        init = load_weights(CausalDecoder(session_config("tiny", "cpu").model.vae),
                            SHIPPED / "tiny" / "vae_decoder.safetensors").state_dict()
    teacher = None
    if fc.dit_share and fc.dit_target == "teacher":
        teacher = load_weights(CausalDecoder(cfg.vae.model_copy(update={"decoder_output": "conv",
                                                                         "decoder_last_channels": None,
                                                                         "decoder_last_kt": 1})),
                               Path(args.teacher) / "vae_decoder.safetensors")
    out = Path(args.work) / args.train_one
    decoder, history = fit_decoder(cfg, data, fc, init=init, teacher=teacher, deadline=args.deadline,
                                   log=lambda s: print(f"[{args.train_one}] {s}", flush=True))
    weights_dir(out, cfg, decoder)
    (out / "fit.json").write_text(json.dumps({"variant": args.train_one, "vae": vae, "init_shipped": from_shipped,
                                              "recipe": dataclasses.asdict(fc), "history": history}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results directory (required)")
    p.add_argument("--work", default="/tmp/decoder_variants")
    p.add_argument("--data", default=str(ROOT / ".cache" / "tiny_data"))
    p.add_argument("--teacher", default=str(ROOT / ".cache" / "conv_decoder"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workers", type=int, default=16, help="CPU processes for generation and scoring")
    p.add_argument("--parallel", type=int, default=8, help="variants trained at once on the GPU")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=DecoderFitConfig.batch, help="spans per step")
    p.add_argument("--dit-seeds", type=int, default=2, help="DiT generations (noise seeds) per training clip")
    p.add_argument("--train-seconds", type=float, default=400, help="stop training this long after the start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="the trainers' device")
    p.add_argument("--clips", type=int, default=None, help="a smoke run: only this many clips of each split")
    p.add_argument("--train-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bank", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train_one:
        train_one(args)
        return
    if not args.out:
        p.error("--out is required")
    t0 = time.time()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "variants": {}, "baselines": {}}

    def save() -> None:
        (out / "variants.json").write_text(json.dumps(result, indent=1))

    def log(s: str) -> None:
        print(f"[{time.time() - t0:5.0f}s] {s}", flush=True)

    train, test = load_or_build(args.data, TRAIN_CLIPS, TEST_CLIPS)
    train, test = train[: args.clips], test[: args.clips]
    shipped = session_config("tiny", "cpu")
    test_latents = dit_latents(shipped, test, range(len(test)), args.workers)
    log(f"held-out DiT latents: {len(test)} clips")

    def score(name: str, cfg: SessionConfig) -> dict[str, Any]:
        ls = score_decoder(cfg, test, test_latents, args.workers)
        row = {**ls.as_dict(), "r_clips": [round(r, 4) for r in ls.r_clips]}
        log(f"{name:<22} r {ls.r:.4f} at {ls.offset:+d}  median {row['r_median']:.3f}  min {row['r_min']:.3f}")
        return row

    result["baselines"]["light_shipped"] = score("light (shipped)", shipped)
    conv_cfg = session_config("tiny", "cpu", weights="random", model={"vae": {"decoder_output": "conv"}}).model
    conv_dir = weights_dir(work / "conv", conv_cfg, Path(args.teacher) / "vae_decoder.safetensors")
    result["baselines"]["conv_previous"] = score("conv (previous)", session({"decoder_output": "conv"}, conv_dir))
    save()

    frames = render_frames(train, args.workers)
    log(f"rendered {sum(f.shape[0] for f in frames)} training frames")
    seeds = [100_000 * (s + 1) + i for s in range(args.dit_seeds) for i in range(len(train))]
    flat = dit_latents(shipped, train * args.dit_seeds, seeds, args.workers)
    train_latents = [flat[s * len(train):(s + 1) * len(train)] for s in range(args.dit_seeds)]
    log(f"training DiT latents: {args.dit_seeds} x {len(train)} clips")
    encoder = load_weights(VAEEncoder(shipped.model.vae), SHIPPED / "tiny" / "vae_encoder.safetensors")
    data = build_data(shipped.model, train, encoder, frames, train_latents, args.device)
    bank = work / "bank.pt"
    fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    torch.save({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v.cpu() if v is not None else v
                for k, v in fields.items()}, bank)
    del data, frames
    log(f"training data saved ({bank.stat().st_size / 1e9:.1f} GB)")

    names = [n for n in args.variants.split(",") if n]
    deadline = t0 + args.train_seconds
    procs: dict[str, subprocess.Popen[bytes]] = {}
    pending = list(names)
    while pending or procs:
        while pending and len(procs) < args.parallel:
            name = pending.pop(0)
            flags = {"--train-one": name, "--bank": bank, "--work": work, "--teacher": args.teacher,
                     "--steps": args.steps, "--batch": args.batch, "--seed": args.seed, "--deadline": deadline,
                     "--device": args.device}
            procs[name] = subprocess.Popen([sys.executable, __file__, *(str(x) for kv in flags.items() for x in kv)])
        for name, proc in list(procs.items()):
            if proc.poll() is not None:
                del procs[name]
                log(f"{name} trained (rc {proc.returncode})")
                if proc.returncode == 0:
                    vae = VARIANTS[name][0]
                    fit = json.loads((work / name / "fit.json").read_text())
                    result["variants"][name] = {**fit, "history": fit["history"][-1:],
                                                "lipsync": score(name, session(vae, work / name))}
                    save()
        time.sleep(1)
    with tarfile.open(out / "weights.tar", "w") as tar:
        for name in result["variants"]:
            for f in ("vae_decoder.safetensors", "model.json", "fit.json"):
                tar.add(work / name / f, arcname=f"{name}/{f}")
    rows = [(n, r["lipsync"]) for n, r in result["variants"].items()] + list(result["baselines"].items())
    print(f"\n{'variant':<22} {'r':>6} {'offset':>6} {'median':>7} {'min':>6}  steps")
    for name, ls in sorted(rows, key=lambda x: -x[1]["r"]):
        steps = result["variants"].get(name, {}).get("history", [{"step": -1}])[-1]["step"] + 1
        print(f"{name:<22} {ls['r']:>6.3f} {ls['offset']:>+6d} {ls['r_median']:>7.3f} {ls['r_min']:>6.3f}  {steps}")
    result["seconds"] = time.time() - t0
    save()


if __name__ == "__main__":
    main()
