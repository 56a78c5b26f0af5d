"""LiveAvatar's DiT per block on one GPU: the whole model and one tensor-parallel rank's share (2, 4 ranks), bf16
and FP8, in its streaming loop's steady state (the rolling cache full), with the FLOP floor beside each time.

    python scripts/liveavatar/bench_dit.py --shards 1,2,4 --precisions bf16,fp8 --out result.json

Random weights (speed does not depend on them). A rank's share is its heads and MLP columns without the
collectives; those are modelled from measured NCCL figures elsewhere (docs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from characters.families.liveavatar import LiveAvatarDiT, LiveAvatarDiTConfig, LiveAvatarLoopConfig, LiveAvatarStream
from characters.families.liveavatar.flops import block_cost
from characters.families.liveavatar.layers import shard_liveavatar, to_fp8_
from characters.flops import H200_BF16_RATE, H200_FP8_RATE


def build(cfg: LiveAvatarDiTConfig, shard: int, precision: str) -> LiveAvatarDiT:
    with torch.device("meta"):
        model = shard_liveavatar(LiveAvatarDiT(cfg), rank=0, size=shard, communicate=False)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.02, generator=gen)
            else:
                p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    model.casual_audio_encoder.float()  # theirs runs under float32 autocast
    if precision == "fp8":
        to_fp8_(model)
    return model.eval()


def run(shard: int, precision: str, blocks: int) -> dict:
    cfg, loop = LiveAvatarDiTConfig(), LiveAvatarLoopConfig()
    h, w = loop.latent_hw
    torch.cuda.reset_peak_memory_stats()
    model = build(cfg, shard, precision)
    stream = LiveAvatarStream(model, loop, random.Random(0))
    dev = "cuda"
    ref, motion = torch.randn(16, 1, h, w, device=dev), torch.randn(16, 19, h, w, device=dev)
    text = torch.randn(40, cfg.text_dim, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stream.start(ref, motion, text)
    first = stream.block(torch.randn(16, 3, h, w, device=dev), torch.randn(1, 25, 1024, 12, device=dev))
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    del first
    times = []
    for b in range(blocks):
        noise, audio = torch.randn(16, 3, h, w, device=dev), torch.randn(1, 25, 1024, 12, device=dev)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = stream.block(noise, audio)
        e.record()
        torch.cuda.synchronize()
        if b >= loop.blocks_per_clip:  # steady state: the rolling cache is full
            times.append(s.elapsed_time(e))
    assert torch.isfinite(out).all(), "non-finite latents"
    cost = block_cost(cfg, loop, shard)
    flops = cost.flops_per_rank
    linear_rate = H200_FP8_RATE if precision == "fp8" else H200_BF16_RATE
    floor_s = cost.linear_flops_per_rank / linear_rate + (flops - cost.linear_flops_per_rank) / H200_BF16_RATE
    ms = statistics.median(times)
    return {"shard": shard, "precision": precision, "block_ms_p50": round(ms, 2), "block_ms_min": round(min(times), 2),
            "blocks_timed": len(times), "block_playback_ms": loop.block_seconds * 1000,
            "tflop_per_block": round(flops / 1e12, 1), "achieved_tflops": round(flops / ms / 1e9, 1),
            "floor_ms": round(floor_s * 1000, 1), "start_plus_first_block_s": round(first_s, 3),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1), "tokens_per_block": loop.block_tokens,
            "cache_slots": loop.cache_slots, "size": f"{loop.height}x{loop.width}"}


def run_decoder(blocks: int) -> dict:
    """The Wan2.1 decoder (the shared CausalDecoder) per block of 3 latent frames at 704x384, and a stream's first
    frame after its motion prime (random weights, bf16, channels-last)."""
    from characters.families.liveavatar.vae import LIVEAVATAR_VAE
    from characters.vae import CausalDecoder

    loop = LiveAvatarLoopConfig()
    h, w = loop.latent_hw
    dec = CausalDecoder(LIVEAVATAR_VAE).to("cuda", torch.bfloat16).eval()
    state = dec.init_state(1, h, w, "cuda", torch.bfloat16)
    times = []
    with torch.no_grad():
        dec.decode_chunk(torch.randn(1, 16, 7, h, w, device="cuda", dtype=torch.bfloat16), state)  # the prime
        for b in range(blocks):
            z = torch.randn(1, 16, loop.frames_per_block, h, w, device="cuda", dtype=torch.bfloat16)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dec.decode_chunk(z, state)
            e.record()
            torch.cuda.synchronize()
            if b >= 2:
                times.append(s.elapsed_time(e))
    return {"part": "decoder", "block_ms_p50": round(statistics.median(times), 2), "blocks_timed": len(times),
            "frames_per_block": loop.video_frames_per_block, "size": f"{loop.height}x{loop.width}"}


def run_speech(blocks: int) -> dict:
    """wav2vec2-large (the published model's shape, random weights) over a 4 s window per block."""
    import numpy as np
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    from characters.families.liveavatar.speech import SpeechEncoder, StreamingSpeech

    cfg = Wav2Vec2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                         do_stable_layer_norm=True, feat_extract_norm="layer")
    parts = (Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, do_normalize=True),
             Wav2Vec2Model(cfg).to("cuda", torch.bfloat16).eval())
    enc = SpeechEncoder(None, "cuda", torch.bfloat16, parts=parts)
    stream = StreamingSpeech(enc, window_s=4.0)
    rng = np.random.default_rng(0)
    times = []
    for b in range(blocks):
        stream.push(rng.standard_normal(7680).astype(np.float32) * 0.1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stream.block(12)
        torch.cuda.synchronize()
        if b >= 2:
            times.append((time.perf_counter() - t0) * 1000)
    return {"part": "speech", "block_ms_p50": round(statistics.median(times), 2), "window_s": 4.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--parts", default="dit,decoder,speech")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    parts = args.parts.split(",")
    for part, fn in (("decoder", run_decoder), ("speech", run_speech)):
        if part in parts:
            try:
                row = fn(args.blocks)
            except Exception as err:  # noqa: BLE001 (a part that cannot run is a row with its error)
                row = {"part": part, "error": f"{type(err).__name__}: {str(err)[:200]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if "dit" not in parts:
        args.shards = ""
    for shard in [int(x) for x in args.shards.split(",") if x]:
        for precision in args.precisions.split(","):
            try:
                row = run(shard, precision, args.blocks)
            except torch.OutOfMemoryError as err:
                row = {"shard": shard, "precision": precision, "error": f"out of memory: {str(err)[:160]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "command": "python scripts/liveavatar/bench_dit.py " + " ".join(
                  f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'ranks':>5} {'prec':>5} {'block ms':>9} {'floor ms':>9} {'TFLOP/s':>8} {'peak GB':>8}")
    for r in rows:
        if "part" in r:
            print(f"{r['part']:>11} {r.get('block_ms_p50', r.get('error', ''))}")
            continue
        if "error" in r:
            print(f"{r['shard']:>5} {r['precision']:>5} {r['error'][:60]}")
        else:
            print(f"{r['shard']:>5} {r['precision']:>5} {r['block_ms_p50']:>9} {r['floor_ms']:>9} "
                  f"{r['achieved_tflops']:>8} {r['peak_gb']:>8}")


if __name__ == "__main__":
    main()
