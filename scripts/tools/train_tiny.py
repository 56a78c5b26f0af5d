"""Train the `tiny` character from scratch on the procedural data set, on the CPU, and ship its weights.

    nice -n 10 python scripts/tools/train_tiny.py                    # -> characters/weights/tiny/
    python scripts/tools/train_tiny.py --vae-steps 20 --dit-steps 20 --train-clips 8 --out /tmp/smoke   # smoke run
    nice -n 10 python scripts/tools/train_tiny.py --decoder-only     # a new decoder for the shipped encoder and DiT
    python scripts/tools/train_tiny.py --decoder-only --device cuda --decoder-recipe frames --decoder-signal-weight 2 \
        --decoder-init characters/weights/tiny --decoder-steps 900     # the shipped light decoder (one H200)

`--decoder-only` keeps the encoder, DiT and audio encoder of `--from` (default: the shipped weights) byte for
byte and fits only a decoder of the preset's VAE config to that frozen encoder's latents: the DiT's latent space
stays as it was. `--decoder-recipe crops` (the CPU recipe, `characters.train.fit_vae.train_decoder`): crops, pixel
L1; `frames` (`characters.train.fit_decoder.fit_decoder`, for a GPU): whole pre-rendered frames, plus a loss on the
mouth signal the lip-sync score reads, optionally on the DiT's own latents as well. train.json keeps the record of
how the rest was made and adds a `decoder` section (recipe, loss curve, reconstruction error of the new and the
previous decoder on held-out clips).

1. Data: `characters.train.data` (espeak-ng speech, cartoon identities), cached in --data.
2. VAE: encoder + causal decoder as an autoencoder (`characters.train.fit_vae`); the latents' per-channel
   std is then folded into the encoder's last conv and the decoder's first (unit-scale latents, no scale
   anywhere else in the engine).
3. DiT + audio encoder: flow matching on the latents, sequences under the cache's block-causal mask
   (`characters.train.fit_dit`).
4. Writes model.json, dit.safetensors, audio.safetensors, vae_encoder.safetensors, vae_decoder.safetensors
   and train.json (the recipe, loss curves and wall times) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from characters.config import ModelConfig, model_preset, session_config  # noqa: E402
from characters.train.data import TEST_CLIPS, TRAIN_CLIPS, Clip, load_or_build, reference_image  # noqa: E402
from characters.train.fit_decoder import (  # noqa: E402
    DecoderFitConfig,
    build_data,
    dit_latents,
    fit_decoder,
    render_frames,
)
from characters.train.fit_dit import DiTTrainConfig, check_windows, prepare_clip, train_dit  # noqa: E402
from characters.train.fit_vae import (  # noqa: E402
    VAETrainConfig,
    encode_clip,
    fold_latent_scale,
    reconstruction_error,
    train_decoder,
    train_vae,
)
from characters.vae import CausalDecoder, VAEEncoder  # noqa: E402
from characters.weights import load_weights, save_model_config, save_weights  # noqa: E402

RECON_CLIPS = 12  # held-out clips the decoders' reconstruction error is measured on


def decoder_only(args: argparse.Namespace, cfg: ModelConfig, train: list[Clip], test: list[Clip]) -> None:
    """Fit a new decoder to the frozen encoder of `args.source`; copy everything else; extend its train.json."""
    source, out = Path(args.source), Path(args.out)
    previous = ModelConfig.model_validate_json((source / "model.json").read_text())
    decoder_fields = ("decoder_output", "decoder_last_channels", "decoder_last_kt")
    if previous.vae.model_copy(update={f: getattr(cfg.vae, f) for f in decoder_fields}) != cfg.vae:
        raise SystemExit(f"--decoder-only: the weights in {source} have vae={previous.vae.model_dump()}; only "
                         f"{', '.join(decoder_fields)} may differ from the preset's (the encoder is kept as it is)")
    encoder = load_weights(VAEEncoder(cfg.vae), source / "vae_encoder.safetensors").eval()
    old = load_weights(CausalDecoder(previous.vae), source / "vae_decoder.safetensors").eval()
    files = {name: (source / name).read_bytes() for name in
             ("dit.safetensors", "audio.safetensors", "vae_encoder.safetensors")}
    record = json.loads((source / "train.json").read_text())
    t = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    tc: VAETrainConfig | DecoderFitConfig
    if args.decoder_recipe == "crops":
        tc = VAETrainConfig(steps=args.decoder_steps, seed=args.seed, device=args.device,
                            batch=args.decoder_batch or VAETrainConfig.batch,
                            mouth_weight=args.decoder_mouth_weight or VAETrainConfig.mouth_weight,
                            lr=args.decoder_lr or VAETrainConfig.lr)
        init = None
        if args.decoder_init:  # train on from a decoder of this config (e.g. the shipped one, --from)
            init = load_weights(CausalDecoder(cfg.vae), Path(args.decoder_init) / "vae_decoder.safetensors")
        decoder, history = train_decoder(cfg, train, tc, encoder, log=log, init=init)
    else:
        decoder, history, tc = decoder_frames(args, cfg, previous, train, encoder)
    wall = time.perf_counter() - t
    held = test[:RECON_CLIPS]
    recon = {"new": reconstruction_error(encoder, decoder, held), "previous": reconstruction_error(encoder, old, held)}
    print(json.dumps(recon, indent=1), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    save_model_config(cfg, out)
    save_weights(decoder, out / "vae_decoder.safetensors")
    record["decoder"] = {
        "command": " ".join(["python", *sys.argv]), "threads": args.threads, "device": args.device,
        "from": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
        "vae": cfg.vae.model_dump(), "previous_vae": previous.vae.model_dump(), "recipe_kind": args.decoder_recipe,
        "recipe": dataclasses.asdict(tc), "teacher": args.decoder_teacher, "dit_seeds": args.decoder_dit_seeds,
        "init": args.decoder_init, "init_record": record.get("decoder") if args.decoder_init else None,
        "train_clips": len(train), "wall_s": wall, "reconstruction_held_out": recon, "history": history,
        "note": "Only vae_decoder.safetensors is new: fitted to the frozen vae_encoder (latent scale folded in), "
                "so dit, audio and vae_encoder are the files of `from`, byte for byte; the top-level record says "
                "how those were made.",
    }
    (out / "train.json").write_text(json.dumps(record, indent=1))


def decoder_frames(args: argparse.Namespace, cfg: ModelConfig, previous: ModelConfig, train: list[Clip],
                   encoder: VAEEncoder) -> tuple[CausalDecoder, list[dict[str, float]], DecoderFitConfig]:
    """`--decoder-recipe frames`: the training split rendered once (and, with --decoder-dit-share, the DiT's latents
    of it generated on the CPU, --decoder-dit-seeds noise seeds per clip), then `fit_decoder` on args.device."""
    d = DecoderFitConfig()
    fc = DecoderFitConfig(steps=args.decoder_steps, batch=args.decoder_batch or d.batch, lr=args.decoder_lr or d.lr,
                          mouth_weight=args.decoder_mouth_weight or d.mouth_weight,
                          signal_weight=args.decoder_signal_weight, dit_share=args.decoder_dit_share,
                          dit_target=args.decoder_dit_target, seed=args.seed, device=args.device)
    frames = render_frames(train, args.workers)
    dit = None
    if fc.dit_share:
        session = session_config("tiny", "cpu", weights=args.source, model={"vae": previous.vae.model_dump()})
        seeds = [100_000 * (s + 1) + i for s in range(args.decoder_dit_seeds) for i in range(len(train))]
        flat = dit_latents(session, train * args.decoder_dit_seeds, seeds, args.workers)
        dit = [flat[s * len(train):(s + 1) * len(train)] for s in range(args.decoder_dit_seeds)]
    data = build_data(cfg, train, encoder, frames, dit, args.device)
    del frames
    init = None
    if args.decoder_init:  # a decoder to start from: its tensors that fit this config (`init_from`)
        init_dir = Path(args.decoder_init)
        init_cfg = ModelConfig.model_validate_json((init_dir / "model.json").read_text())
        init = load_weights(CausalDecoder(init_cfg.vae), init_dir / "vae_decoder.safetensors").state_dict()
    teacher = None
    if fc.dit_share and fc.dit_target == "teacher":
        if not args.decoder_teacher:
            raise SystemExit("--decoder-dit-target teacher needs --decoder-teacher DIR (a decoder of this encoder)")
        teacher_cfg = ModelConfig.model_validate_json((Path(args.decoder_teacher) / "model.json").read_text())
        teacher = load_weights(CausalDecoder(teacher_cfg.vae), Path(args.decoder_teacher) / "vae_decoder.safetensors")
    decoder, history = fit_decoder(cfg, data, fc, init=init, teacher=teacher, log=lambda s: print(s, flush=True))
    encoder.cpu()
    return decoder, history, fc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "characters" / "weights" / "tiny"))
    p.add_argument("--data", default=str(ROOT / ".cache" / "tiny_data"))
    p.add_argument("--train-clips", type=int, default=TRAIN_CLIPS)
    p.add_argument("--test-clips", type=int, default=TEST_CLIPS)
    p.add_argument("--vae-steps", type=int, default=VAETrainConfig.steps)
    p.add_argument("--dit-steps", type=int, default=DiTTrainConfig.steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu (the recipe's target) or cuda")
    p.add_argument("--decoder-only", action="store_true",
                   help="train only a new decoder for the frozen encoder of --from (see the docstring)")
    p.add_argument("--from", dest="source", default=str(ROOT / "characters" / "weights" / "tiny"),
                   help="--decoder-only: the weights whose encoder, DiT and audio encoder are kept")
    p.add_argument("--decoder-steps", type=int, default=VAETrainConfig.steps, help="--decoder-only: training steps")
    p.add_argument("--decoder-batch", type=int, default=None,
                   help=f"--decoder-only: spans per step (default {VAETrainConfig.batch})")
    p.add_argument("--decoder-mouth-weight", type=float, default=None,
                   help=f"--decoder-only: loss weight of the mouth region (default {VAETrainConfig.mouth_weight})")
    p.add_argument("--decoder-lr", type=float, default=None, help=f"--decoder-only: (default {VAETrainConfig.lr})")
    p.add_argument("--decoder-init", default=None,
                   help="--decoder-only: a weights directory whose decoder (of this config) training starts from")
    p.add_argument("--decoder-recipe", choices=["crops", "frames"], default="crops",
                   help="--decoder-only: crops (the CPU recipe, fit_vae) or frames (fit_decoder, for a GPU)")
    p.add_argument("--decoder-signal-weight", type=float, default=DecoderFitConfig.signal_weight,
                   help="--decoder-recipe frames: weight of the mouth-signal loss")
    p.add_argument("--decoder-dit-share", type=float, default=DecoderFitConfig.dit_share,
                   help="--decoder-recipe frames: fraction of each batch from the DiT's own latents")
    p.add_argument("--decoder-dit-target", choices=["truth", "teacher"], default=DecoderFitConfig.dit_target,
                   help="--decoder-recipe frames: what the DiT's latents are decoded towards")
    p.add_argument("--decoder-dit-seeds", type=int, default=2,
                   help="--decoder-recipe frames: DiT generations (noise seeds) per training clip")
    p.add_argument("--decoder-teacher", default=None,
                   help="--decoder-dit-target teacher: a weights directory whose decoder renders the DiT's latents")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="--decoder-recipe frames: CPU processes that render frames and run the DiT")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = model_preset("tiny")
    walls: dict[str, float] = {}
    t0 = time.perf_counter()

    train, test = load_or_build(args.data, args.train_clips, args.test_clips)
    if args.decoder_only:
        decoder_only(args, cfg, train, test)
        return
    assert check_windows(cfg, train[0].pcm, train[0].frames) == 0.0, "training audio windows != the frontend's"
    walls["data_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    vtc = VAETrainConfig(steps=args.vae_steps, seed=args.seed, device=args.device)
    encoder, decoder, vae_hist = train_vae(cfg, train, vtc, log=lambda s: print(s, flush=True))
    walls["vae_s"] = time.perf_counter() - t

    t = time.perf_counter()
    latents = [encode_clip(encoder, c) for c in train]  # each (C, L, h, w)
    flat = torch.cat([z.reshape(z.shape[0], -1) for z in latents], dim=1)  # (C, N)
    mean, std = flat.mean(1), flat.std(1)
    print(f"latent mean {mean.abs().max():.3f} (max abs), std {std.min():.3f}..{std.max():.3f} -> folded", flush=True)
    fold_latent_scale(encoder, decoder, std)
    latents = [z / std.view(-1, 1, 1, 1) for z in latents]
    with torch.no_grad():
        refs = [encoder.encode_image(torch.from_numpy(reference_image(c.identity)).permute(2, 0, 1)[None].float()
                                     / 127.5 - 1)[0] for c in train]
    dtc = DiTTrainConfig(steps=args.dit_steps, seed=args.seed, device=args.device)
    from characters.train.fit_dit import build_dit

    _, audio0 = build_dit(cfg, args.seed)  # only its fixed spectral front end is used here
    data = [prepare_clip(c, z, r, audio0, cfg, dtc.mouth_weight) for c, z, r in zip(train, latents, refs, strict=True)]
    walls["latents_s"] = time.perf_counter() - t

    t = time.perf_counter()
    dit, audio, dit_hist = train_dit(cfg, data, dtc, log=lambda s: print(s, flush=True))
    walls["dit_s"] = time.perf_counter() - t
    walls["total_s"] = time.perf_counter() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_model_config(cfg, out)
    save_weights(dit, out / "dit.safetensors")
    save_weights(audio, out / "audio.safetensors")
    save_weights(encoder, out / "vae_encoder.safetensors")
    save_weights(decoder, out / "vae_decoder.safetensors")
    record = {
        "command": " ".join(["python", *sys.argv]), "threads": args.threads, "device": args.device,
        "train_clips": len(train), "vae": dataclasses.asdict(vtc), "dit": dataclasses.asdict(dtc),
        "latent_std_folded": std.tolist(), "latent_mean": mean.tolist(), "wall": walls,
        "vae_history": vae_hist, "dit_history": dit_hist,
    }
    (out / "train.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(walls, indent=1))


if __name__ == "__main__":
    main()
