"""Training the `tiny` character on a procedural data set, and the lip-sync score that guards it.

- `face`: a 2-D cartoon face (identities drawn with PIL; mouth, jaw and head move per frame).
- `speech`: espeak-ng speech with varied voices, speeds, pitches and sentences; motion tracks from it.
- `data`: clips (identity + utterance + motion), seeded train/test splits of unseen faces and sentences.
- `fit_vae`, `fit_dit`: the VAE, then the DiT and audio encoder (flow matching, exactly as inference runs).
- `lipsync`: the score (mouth signal vs audio envelope; identity drift) on plain frames + PCM.
- `evaluate`: generate held-out clips with the engine's runners and score them.

`scripts/tools/train_tiny.py` trains and writes `characters/weights/tiny/`;
`scripts/benchmarks/eval_lipsync.py` scores it.
Nothing here is imported by the serving path.
"""

from characters.train.lipsync import LipSync, identity_drift, lipsync_score, mouth_signal

__all__ = ["LipSync", "identity_drift", "lipsync_score", "mouth_signal"]
