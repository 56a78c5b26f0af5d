"""LiveAvatar's audio features through transformers' wav2vec2: the authors' offline layout, and the streaming
window that reproduces it when it sees the same audio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from characters.families.liveavatar.speech import SAMPLE_RATE, SpeechEncoder, StreamingSpeech


@pytest.fixture(scope="module")
def tiny_wav2vec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wav2vec2 with the published model's layout (conv front end at 50 Hz, CTC head) at toy width."""
    cfg = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16,) * 7, num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=4, vocab_size=12, do_stable_layer_norm=True,
                                      feat_extract_norm="layer")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("wav2vec2")
    transformers.Wav2Vec2ForCTC(cfg).save_pretrained(path)
    transformers.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, do_normalize=True,
                                          return_attention_mask=True).save_pretrained(path)
    return path


def test_clip_features_layout(tiny_wav2vec: Path) -> None:
    enc = SpeechEncoder(tiny_wav2vec)
    pcm = np.random.default_rng(0).standard_normal(int(2.5 * SAMPLE_RATE)).astype(np.float32) * 0.1
    feats = enc.clip_features(pcm)
    # 2.5 s at 25 fps = 62.5 frames -> two clips of 48; every hidden state (CNN projection + 2 layers), width 32
    assert feats.shape == (1, 3, 32, 96)
    assert feats[..., :62].abs().sum(dim=(0, 1, 2)).min() > 0
    assert (feats[..., 62:] == 0).all()  # past the audio: frame 62 is 30 Hz index 74, one past the 74 it has


def test_streaming_equals_offline_when_it_sees_the_same_audio(tiny_wav2vec: Path) -> None:
    enc = SpeechEncoder(tiny_wav2vec)
    pcm = np.random.default_rng(1).standard_normal(int(1.92 * SAMPLE_RATE)).astype(np.float32) * 0.1
    offline = enc.clip_features(pcm)
    stream = StreamingSpeech(enc, window_s=10.0)
    for b in range(4):
        stream.push(pcm[b * 7680:(b + 1) * 7680])
        block = stream.block(12)
        assert block.shape == (1, 3, 32, 12)
    torch.testing.assert_close(block, offline[..., 36:48])  # the last block's window is the whole audio
    with pytest.raises(ValueError, match="push the block's audio first"):
        stream.block(12)
