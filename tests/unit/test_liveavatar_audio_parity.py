"""LiveAvatar's audio features (characters/families/liveavatar/speech.py) against the authors' own code: our
SpeechEncoder.clip_features on a tiny wav2vec2 (saved as the hub folder is) and a synthetic waveform equals what
their AudioEncoder produced through the causal pipeline's encode_audio (extract_audio_feat with every hidden
state, get_audio_embed_bucket_fps(fps=25, batch_frames=48, m=0), permuted to (1, La, Da, frames));
tests/fixtures/liveavatar/golden_audio.json says how (commit, command, adaptations). Float32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from characters.families.liveavatar.speech import SpeechEncoder

FIXTURES = Path(__file__).parents[1] / "fixtures" / "liveavatar"


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((FIXTURES / "golden_audio.json").read_text()), load_file(FIXTURES / "golden_audio.safetensors")


@pytest.fixture(scope="module")
def encoder(golden: tuple[dict, dict[str, torch.Tensor]]) -> SpeechEncoder:
    return SpeechEncoder(FIXTURES / golden[0]["model"])


def test_hidden_states_at_30hz_equal_theirs(golden: tuple[dict, dict[str, torch.Tensor]],
                                            encoder: SpeechEncoder) -> None:
    _, t = golden
    ours = encoder.hidden30(t["pcm"].numpy())
    assert ours.shape == t["hidden30"].shape == (3, 98, 32)  # (La, T30, Da): 3.3 s -> 165 at 50 Hz -> 98 at 30 Hz
    torch.testing.assert_close(ours, t["hidden30"], rtol=1e-5, atol=1e-5)


def test_clip_features_equal_their_encode_audio(golden: tuple[dict, dict[str, torch.Tensor]],
                                                encoder: SpeechEncoder) -> None:
    manifest, t = golden
    ours = encoder.clip_features(t["pcm"].numpy(), frames_per_clip=manifest["batch_frames"])
    theirs = t["audio_emb"]
    assert ours.shape == theirs.shape == (1, 3, 32, manifest["num_repeat"] * manifest["batch_frames"])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the bucket runs past the audio: their zero frames are ours (frame 82 is at 3.28 s, 30 Hz index 98)
    tail = theirs[..., 82:]
    assert torch.count_nonzero(tail) == 0 and torch.count_nonzero(theirs[..., :82].abs().sum((0, 1, 2))) == 82


def test_bfloat16_features_equal_theirs(golden: tuple[dict, dict[str, torch.Tensor]]) -> None:
    """The pipeline runs wav2vec2 in bfloat16 (param_dtype): ours in bfloat16 against theirs moved to bfloat16
    (bit-equal on the box the goldens were made on; bfloat16's tolerance for other CPUs' kernels)."""
    manifest, t = golden
    encoder = SpeechEncoder(FIXTURES / manifest["model"], dtype=torch.bfloat16)
    torch.testing.assert_close(encoder.hidden30(t["pcm"].numpy()), t["hidden30_bf16"], rtol=2e-2, atol=2e-2)
    ours = encoder.clip_features(t["pcm"].numpy(), frames_per_clip=manifest["batch_frames"])
    torch.testing.assert_close(ours, t["audio_emb_bf16"], rtol=2e-2, atol=2e-2)
    assert not torch.equal(t["audio_emb_bf16"], t["audio_emb"])  # the bfloat16 golden is a bfloat16 run
