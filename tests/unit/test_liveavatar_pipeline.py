"""LiveAvatar end to end on the CPU: a snapshot folder in the hub's layout (synthetic weights at toy width,
every file the real one has, the LoRA merged) -> an avatar -> uint8 video blocks from speech, streamed through
the shared decoder. Random weights: this proves the parts load and fit together, not what the video shows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from characters.families.liveavatar import LiveAvatarDiT, LiveAvatarDiTConfig, LiveAvatarLoopConfig
from characters.families.liveavatar.checkpoint import INDEX
from characters.families.liveavatar.pipeline import LiveAvatarPipeline, dit_config
from characters.families.liveavatar.synthetic import synthetic_state_dict
from characters.families.liveavatar.text import LiveAvatarTextConfig
from characters.families.liveavatar.vae import wan21_vae_config, wan_vae_spec

FIXTURES = Path(__file__).parents[1] / "fixtures" / "liveavatar"
CONFIG = {"_class_name": "WanModel_S2V", "num_layers": 2, "dim": 64, "num_heads": 2, "ffn_dim": 96, "text_dim": 32,
          "audio_dim": 32, "audio_inject_layers": [0, 4, 8], "enable_adain": True}


def _snapshot(root: Path) -> None:
    base = root / "Wan2.2-S2V-14B"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps(CONFIG))
    shutil.copytree(FIXTURES / "tiny_wav2vec2", base / "wav2vec2-large-xlsr-53-english")
    cfg = dit_config(base)
    with torch.device("meta"):
        model = LiveAvatarDiT(cfg)
    spec = {k: (tuple(v.shape), torch.float32) for k, v in model.state_dict().items()}
    state = synthetic_state_dict(spec, seed=0)
    names = sorted(state)
    weight_map = {}
    for i in range(2):
        fname = f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n].to(torch.bfloat16) for n in names[i::2]}, str(base / fname))
        weight_map.update(dict.fromkeys(names[i::2], fname))
    (base / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    vae = {k: (s, torch.float32) for k, s in wan_vae_spec(wan21_vae_config(16)).items()}
    torch.save(synthetic_state_dict(vae, seed=1), base / "Wan2.1_VAE.pth")
    shutil.copytree(FIXTURES / "tiny_umt5", base, dirs_exist_ok=True)
    (root / "LiveAvatar").mkdir()
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    save_file({"base_model.model.blocks.0.self_attn.q.lora_A.default.weight": a,
               "base_model.model.blocks.0.self_attn.q.lora_B.default.weight": b}, str(root / "LiveAvatar" /
                                                                                       "liveavatar.safetensors"))


def test_snapshot_to_video_blocks(tmp_path: Path) -> None:
    _snapshot(tmp_path)
    text = LiveAvatarTextConfig(vocab_size=256, dim=32, dim_attn=48, dim_ffn=80, num_heads=4, num_layers=2,
                                num_buckets=32, text_len=512)
    loop = LiveAvatarLoopConfig(height=64, width=128, blocks_per_clip=2)
    pipe = LiveAvatarPipeline.from_snapshot(tmp_path, device="cpu", dtype=torch.float32, text_config=text,
                                            vae_config=wan21_vae_config(16), loop=loop)
    # the tiny wav2vec2 (2 layers: 3 hidden states) sets audio_layers; config.json the rest
    assert pipe.dit.cfg == LiveAvatarDiTConfig(num_layers=2, dim=64, num_heads=2, ffn_dim=96, text_dim=32,
                                               audio_dim=32, audio_layers=3, audio_inject_layers=(0,))
    image = (np.random.default_rng(0).random((300, 200, 3)) * 255).astype(np.uint8)
    avatar = pipe.avatar(image, "A person talks to the camera.")
    assert avatar.reference.shape == (16, 1, 8, 16) and avatar.motion.shape == (16, 19, 8, 16)
    pcm = np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 0.1  # 1 s -> 2 clips of 2 blocks
    blocks = list(pipe.frames(avatar, pcm))
    assert len(blocks) == 4 and all(b.shape == (12, 64, 128, 3) and b.dtype == np.uint8 for b in blocks)
    assert len({b.tobytes() for b in blocks}) == 4  # every block is made anew


def test_clip_lipsync_score_follows_the_mouth() -> None:
    """scripts/liveavatar/eval_clips.py's score: a real face whose mouth box darkens with the speech envelope
    scores r ~ 1 at offset 0, the same face held still ~ 0, and a picture with no face says so."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from characters.audio import load_audio
    from characters.media import detect_face, load_image
    from characters.train.speech import frame_envelope
    from scripts.liveavatar.eval_clips import mouth_box, score

    root = Path(__file__).resolve().parents[2] / "characters" / "assets"
    face = load_image(root / "sample_face.png", 352, 544)
    pcm = load_audio(root / "sample_speech.wav")[: 16000 * 4]
    env = frame_envelope(pcm, 100, fps=25)
    level = (env - env.min()) / (env.max() - env.min())  # (100,) in [0, 1]
    top, bot, left, right = mouth_box(detect_face(face), *face.shape[:2])
    frames = np.repeat(face[None], 100, axis=0).astype(np.float32)
    frames[:, top:bot, left:right] *= (1 - 0.6 * level)[:, None, None, None]
    moving = score(frames.round().astype(np.uint8), pcm, 25)
    assert moving["offset"] == 0 and moving["r"] > 0.9
    still = score(np.repeat(face[None], 100, axis=0), pcm, 25)
    assert abs(still["r"]) < 0.1
    assert score(np.zeros((10, 64, 64, 3), np.uint8), pcm, 25) == {"error": "no face found in the first frame"}
