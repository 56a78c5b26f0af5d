"""Train the `tiny` character from scratch on the procedural data set, on the CPU, and ship its weights.

    nice -n 10 python scripts/train_tiny.py                    # -> characters/weights/tiny/
    python scripts/train_tiny.py --vae-steps 20 --dit-steps 20 --train-clips 8 --out /tmp/smoke   # smoke run

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
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from characters.config import model_preset  # noqa: E402
from characters.train.data import TEST_CLIPS, TRAIN_CLIPS, load_or_build, reference_image  # noqa: E402
from characters.train.fit_dit import DiTTrainConfig, check_windows, prepare_clip, train_dit  # noqa: E402
from characters.train.fit_vae import VAETrainConfig, encode_clip, fold_latent_scale, train_vae  # noqa: E402
from characters.weights import save_model_config, save_weights  # noqa: E402


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
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = model_preset("tiny")
    walls: dict[str, float] = {}
    t0 = time.perf_counter()

    train, _ = load_or_build(args.data, args.train_clips, args.test_clips)
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
