"""The VAE: encoder shapes, and the causal decoder's streaming, state handling, causality and size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from characters.config import MODEL_PRESETS, VAEConfig
from characters.vae import (
    CausalConv3d,
    CausalDecoder,
    DecoderState,
    FrameAttention,
    ResBlock,
    Upsample,
    VAEEncoder,
    decoder_flops_per_chunk,
    decoder_param_count,
)

SMALL = VAEConfig(
    latent_channels=4, base_channels=4, channel_mult=(1, 2, 2, 2), num_res_blocks=1, encoder_base_channels=4
)
TINY = MODEL_PRESETS["tiny"]
LATENT_HW = (3, 5)  # (h, w) of the small tests' latents


@pytest.fixture(scope="module")
def decoder() -> CausalDecoder:
    torch.manual_seed(0)
    return CausalDecoder(SMALL).eval()


def _latents(frames: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, SMALL.latent_channels, frames, *LATENT_HW, generator=g)  # (B, C, T, h, w)


def _stream(decoder: CausalDecoder, z: torch.Tensor, chunk: int, state: DecoderState | None = None) -> torch.Tensor:
    state = state or decoder.init_state(1, *LATENT_HW, "cpu", torch.float32)
    parts = [decoder.decode_chunk(z[:, :, i : i + chunk], state) for i in range(0, z.shape[2], chunk)]
    return torch.cat(parts, dim=2)  # (B, 3, 4T, 8h, 8w)


@pytest.mark.parametrize("chunk", [1, 2])
@torch.inference_mode()
def test_streaming_equals_whole_sequence(decoder: CausalDecoder, chunk: int) -> None:
    z = _latents(3 * chunk)  # three chunks
    whole = decoder.decode(z)
    assert whole.shape == (1, 3, 4 * 3 * chunk, 8 * LATENT_HW[0], 8 * LATENT_HW[1])
    assert whole.std() > 0.05 and (whole.abs() < 1).float().mean() > 0.5  # not a constant or saturated output
    torch.testing.assert_close(_stream(decoder, z, chunk), whole, atol=1e-5, rtol=0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, whatever earlier tests set: a conv's sums then run in one order on both paths (with
    two threads the paths split them differently, 1.1e-4 apart at chunk 3)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("chunk", [1, 2, 3])
@torch.inference_mode()
def test_window_state_equals_the_concatenating_path(decoder: CausalDecoder, chunk: int, one_thread: None) -> None:
    """The serving state (convs read windows written in place by the fused norm + SiLU) decodes a stream
    exactly as the generic path does, chunk after chunk, and keeps the same caches."""
    z = _latents(4 * chunk)
    plain = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32)
    windowed = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=chunk)
    assert windowed.windows is not None and plain.windows is None
    ids = [w.data_ptr() for w in windowed.windows]
    for i in range(0, z.shape[2], chunk):
        want = decoder.decode_chunk(z[:, :, i : i + chunk], plain)
        got = decoder.decode_chunk(z[:, :, i : i + chunk], windowed)
        # float32 rounding of two summation orders through ~10 convs: the worst seen is 1.1e-4 (one value of 7680,
        # chunk 3; the decoder's outputs are ~1)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        for a, b in zip(windowed.caches, plain.caches, strict=True):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert [w.data_ptr() for w in windowed.windows] == ids  # written in place, never reallocated
    decoder.pad_output(8)  # conv_out with zero-padded output channels: same frames
    try:
        decoder.reset_state(windowed)
        decoder.reset_state(plain)
        first = z[:, :, :chunk]
        torch.testing.assert_close(decoder.decode_chunk(first, windowed), decoder.decode_chunk(first, plain),
                                   atol=1e-4, rtol=0)
    finally:
        decoder._out_weight = None


@torch.inference_mode()
def test_reset_state_makes_a_second_stream_equal_the_first(decoder: CausalDecoder) -> None:
    z = _latents(3)
    state = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32)
    first = _stream(decoder, z, 1, state)
    assert any(c.abs().sum() > 0 for c in state.caches)
    decoder.reset_state(state)
    assert all(torch.count_nonzero(c) == 0 for c in state.caches)
    assert torch.equal(_stream(decoder, z, 1, state), first)


@torch.inference_mode()
def test_state_tensors_keep_their_identity(decoder: CausalDecoder) -> None:
    state = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32)
    before = [(c.data_ptr(), c.shape, c.stride()) for c in state.caches]
    caches = list(state.caches)
    for i in range(3):
        decoder.decode_chunk(_latents(1, seed=i), state)
    decoder.reset_state(state)
    assert [(c.data_ptr(), c.shape, c.stride()) for c in state.caches] == before
    assert all(a is b for a, b in zip(state.caches, caches, strict=True))


@torch.inference_mode()
def test_caches_hold_the_last_two_input_frames(decoder: CausalDecoder) -> None:
    state = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32)
    z = _latents(3)
    decoder.decode_chunk(z[:, :, :2], state)
    decoder.decode_chunk(z[:, :, 2:], state)
    first = decoder.conv_in  # its input is the latent itself
    torch.testing.assert_close(state.caches[first.slot], z[:, :, 1:3], atol=0, rtol=0)
    assert len(state.caches) == len(decoder.cached_convs)
    assert all(c.shape[2] == 2 for c in state.caches)


@pytest.mark.parametrize("kernel", [(3, 3, 3), (3, 1, 1), (1, 3, 3)])
@torch.inference_mode()
def test_cpu_per_tap_convolution_equals_conv3d(kernel: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    conv = CausalConv3d(5, 6, kernel, scale=1, frames=1)
    x = torch.randn(2, 5, 4 + kernel[0] - 1, 7, 9)  # (B, cin, T + kt - 1, h, w); B = 2 takes the copying path
    expected = F.conv3d(x, conv.weight, conv.bias, padding=conv.padding)  # what runs on GPUs
    torch.testing.assert_close(conv._conv_per_tap(x, conv.weight, conv.bias), expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_decoder_is_causal(decoder: CausalDecoder) -> None:
    z = _latents(5)
    changed = z.clone()
    changed[:, :, 3] += 1.0  # latent frame 3 -> video frames 12..15
    a, b = decoder.decode(z), decoder.decode(changed)
    assert torch.equal(a[:, :, :12], b[:, :, :12])
    assert not torch.allclose(a[:, :, 12:16], b[:, :, 12:16])


@torch.inference_mode()
def test_decode_chunk_rejects_a_state_of_another_size(decoder: CausalDecoder) -> None:
    state = decoder.init_state(1, 4, 5, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"latent \(4, 5\).*call init_state"):
        decoder.decode_chunk(_latents(1), state)


@torch.inference_mode()
def test_tiny_preset_shapes() -> None:
    torch.manual_seed(0)
    cfg = TINY.vae
    h, w = TINY.latent_hw
    assert (h, w) == (22, 34)
    decoder, encoder = CausalDecoder(cfg).eval(), VAEEncoder(cfg).eval()
    state = decoder.init_state(1, h, w, "cpu", torch.float32)
    frames = decoder.decode_chunk(torch.randn(1, cfg.latent_channels, 1, h, w), state)
    assert frames.shape == (1, 3, 4, 176, 272)
    assert frames.abs().max() <= 1.0
    video = torch.rand(1, 3, 8, 176, 272) * 2 - 1  # (B, 3, F, H, W)
    assert encoder(video).shape == (1, cfg.latent_channels, 2, h, w)
    image = video[:, :, 0]  # (B, 3, H, W)
    latent = encoder.encode_image(image)
    assert latent.shape == (1, cfg.latent_channels, h, w)
    torch.testing.assert_close(latent, encoder(image.unsqueeze(2).expand(-1, -1, 4, -1, -1))[:, :, 0])


def test_encoder_rejects_a_clip_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        VAEEncoder(SMALL)(torch.zeros(1, 3, 3, 16, 16))


def test_init_is_seeded() -> None:
    def build() -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        return {**CausalDecoder(SMALL).state_dict(), **VAEEncoder(SMALL).state_dict()}

    a, b = build(), build()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("preset", ["57b", "wan-1.3b"])
def test_large_decoder_is_of_wan21_size(preset: str) -> None:
    cfg = MODEL_PRESETS[preset].vae
    with torch.device("meta"):
        decoder = CausalDecoder(cfg)
    count = sum(p.numel() for p in decoder.parameters())
    assert 60e6 < count < 80e6  # Wan2.1's VAE decoder has ~70M
    assert decoder_param_count(cfg) == count
    # conv_in, 2 mid blocks of 2 convs, 4 stages of 3 blocks of 2 convs, 2 time convs, conv_out
    assert len(decoder.cached_convs) == 1 + 2 * 2 + 4 * 3 * 2 + 2 + 1


@torch.inference_mode()
def test_flops_match_the_layers_actually_run(decoder: CausalDecoder) -> None:
    macs = 0

    def count_conv(m: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal macs
        assert isinstance(m, CausalConv3d)
        kt, kh, kw = m.kernel_size
        macs += out.numel() * m.in_channels * kt * kh * kw  # out: (1, cout, T, h', w')

    def count_attention(m: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal macs
        _, c, t, h, w = out.shape
        macs += t * (4 * h * w * c * c + 2 * (h * w) ** 2 * c)

    hooks = [
        m.register_forward_hook(count_conv if isinstance(m, CausalConv3d) else count_attention)
        for m in decoder.modules()
        if isinstance(m, CausalConv3d | FrameAttention)
    ]
    try:
        decoder.decode(_latents(1))
    finally:
        for hook in hooks:
            hook.remove()
    assert decoder_flops_per_chunk(SMALL, *LATENT_HW) == 2.0 * macs
    # The 57b decoder: ~26 TFLOP per latent frame at 704x1088, why it gets a GPU of its own.
    assert 20e12 < decoder_flops_per_chunk(MODEL_PRESETS["57b"].vae, 88, 136) < 30e12


@torch.inference_mode()
def test_window_path_folds_each_add_into_the_next_pass(decoder: CausalDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """A residual block leaves its last add to the next step: the spatial up-sampling reads y, bias and residual
    itself, a time conv's window gets the sum written into its tail, and the time conv's own bias is added by
    the up-sampling that folds its two halves into frames; the decoded chunk is unchanged."""
    import characters.vae as vae

    ups: list[tuple[bool, bool, bool]] = []  # (fold_time, bias given, residual given) per up-sampling
    adds = 0
    upsample, bias_add = vae.upsample_nearest, vae.bias_add

    def record_upsample(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                        *, fold_time: bool = False) -> torch.Tensor:
        ups.append((fold_time, bias is not None, residual is not None))
        return upsample(x, bias, residual, fold_time=fold_time)

    def count_add(*args: torch.Tensor | None, **kwargs: torch.Tensor | None) -> torch.Tensor:
        nonlocal adds
        adds += 1
        return bias_add(*args, **kwargs)  # type: ignore[arg-type]

    z = _latents(2)
    plain = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32)
    windowed = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=1)
    want = decoder.decode_chunk(z[:, :, :1], plain)
    monkeypatch.setattr(vae, "upsample_nearest", record_upsample)
    monkeypatch.setattr(vae, "bias_add", count_add)
    torch.testing.assert_close(decoder.decode_chunk(z[:, :, :1], windowed), want, atol=1e-4, rtol=0)
    # SMALL: two temporal up-samplings (after stages 0, 1), then a spatial one (after stage 2)
    assert ups == [(True, True, False), (True, True, False), (False, True, True)]
    # 9 of the 10 residual blocks' adds (the one before the spatial up-sampling is folded into it); the time
    # convs add no bias of their own; on CPU conv_in, the three kt = 1 convs after the up-samplings and conv_out
    # take their bias inside the (oneDNN) convolution, so they add none either
    assert adds == 9


# ------------------------------------------------------------------------ the light decoder (pixel_shuffle)

SMALL_PS = SMALL.model_copy(update={"decoder_output": "pixel_shuffle"})


@pytest.fixture(scope="module")
def ps_decoder() -> CausalDecoder:
    torch.manual_seed(0)
    return CausalDecoder(SMALL_PS).eval()


def test_pixel_shuffle_decoder_has_no_full_resolution_convolution(ps_decoder: CausalDecoder) -> None:
    convs = [m for m in ps_decoder.modules() if isinstance(m, CausalConv3d)]
    assert max(m.scale for m in convs) == 4  # half of the 8x latent factor: nothing runs at full resolution
    out = ps_decoder.conv_out
    # (1, 2, 2, 2) x 4 channels: stages of 8, 8, 8 (the full-resolution 4 is dropped); 2x2 RGB pixels per position
    assert (out.in_channels, out.out_channels, out.kernel_size) == (8, 12, (1, 3, 3))
    last = [m for m in ps_decoder.modules() if isinstance(m, CausalConv3d) and m.scale == 4]
    assert all(m.kernel_size[0] == 1 for m in last)  # the half-resolution stage runs per frame
    assert [m.kernel_size for m in ps_decoder.cached_convs if m.scale < 4]  # time is mixed below it
    assert decoder_param_count(SMALL_PS) == sum(p.numel() for p in ps_decoder.parameters())


def test_unshuffle_puts_each_channel_at_its_pixel() -> None:
    d = CausalDecoder(SMALL_PS)
    y = torch.arange(12.0).view(1, 12, 1, 1, 1).expand(1, 12, 1, 2, 3).clone()  # channel i holds the value i
    video = d.unshuffle(y)  # (1, 3, 1, 4, 6)
    for dy in range(2):
        for dx in range(2):
            for c in range(3):
                assert (video[0, c, 0, dy::2, dx::2] == (dy * 2 + dx) * 3 + c).all()


@pytest.mark.parametrize("chunk", [1, 2])
@torch.inference_mode()
def test_pixel_shuffle_decoder_streams_and_its_window_path_matches(ps_decoder: CausalDecoder, chunk: int) -> None:
    z = _latents(3 * chunk)
    whole = ps_decoder.decode(z)
    assert whole.shape == (1, 3, 4 * 3 * chunk, 8 * LATENT_HW[0], 8 * LATENT_HW[1])
    assert whole.std() > 0.05
    torch.testing.assert_close(_stream(ps_decoder, z, chunk), whole, atol=1e-5, rtol=0)
    windowed = ps_decoder.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=chunk)
    torch.testing.assert_close(_stream(ps_decoder, z, chunk, windowed), whole, atol=1e-5, rtol=0)


def _prepared(cfg: VAEConfig) -> CausalDecoder:
    torch.manual_seed(3)
    d = CausalDecoder(cfg).eval()
    with torch.no_grad():
        for p in d.parameters():  # weights large enough that the frames use the whole 0..255 range
            p.normal_(0.0, 0.3)
    return d.to(memory_format=torch.channels_last_3d)  # type: ignore[call-overload]


@pytest.mark.parametrize("cfg", [SMALL, SMALL_PS], ids=["conv", "pixel_shuffle"])
@torch.inference_mode()
def test_cpu_serving_forms_equal_the_generic_decoder(cfg: VAEConfig) -> None:
    """Sub-pixel up-sampling convs (`prepare_cpu`) decode the same stream; `frames_uint8` gives the same bytes
    as rounding the float frames, but where a value sits within float error of a .5 tie."""
    d = _prepared(cfg)
    z = _latents(3)
    want = d.decode(z)  # (1, 3, 12, H, W)
    d.prepare_cpu()
    assert all(m._subpixel is not None for m in d.modules() if hasattr(m, "_subpixel"))
    windowed = d.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=1)
    torch.testing.assert_close(_stream(d, z, 1, windowed), want, atol=2e-5, rtol=0)
    d.reset_state(windowed)
    got = torch.cat([d.frames_uint8(z[:, :, i : i + 1], windowed) for i in range(3)], dim=1)  # (1, 12, H, W, 3)
    ref = ((want + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
    assert got.shape == ref.shape and got.dtype == torch.uint8
    diff = (got.int() - ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
    assert int(ref.min()) == 0 and int(ref.max()) == 255  # the clamp is exercised at both ends


def test_frames_uint8_needs_its_preparation_and_a_serving_state() -> None:
    d = CausalDecoder(SMALL_PS).eval()
    state = d.init_state(1, *LATENT_HW, "cpu", torch.float32)
    with pytest.raises(ValueError, match="prepare_uint8"):
        d.frames_uint8(_latents(1), state)
    d.prepare_uint8()
    with pytest.raises(ValueError, match="serving state"):
        d.frames_uint8(_latents(1), state)


@torch.inference_mode()
def test_flops_of_the_pixel_shuffle_decoder_match_its_layers(ps_decoder: CausalDecoder) -> None:
    macs = 0

    def count(m: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal macs
        if isinstance(m, CausalConv3d):
            macs += out.numel() * m.in_channels * m.kernel_size[0] * m.kernel_size[1] * m.kernel_size[2]
        else:
            _, c, t, h, w = out.shape
            macs += t * (4 * h * w * c * c + 2 * (h * w) ** 2 * c)

    layers = [m for m in ps_decoder.modules() if isinstance(m, CausalConv3d | FrameAttention)]
    hooks = [m.register_forward_hook(count) for m in layers]
    try:
        ps_decoder.decode(_latents(1))
    finally:
        for hook in hooks:
            hook.remove()
    assert decoder_flops_per_chunk(SMALL_PS, *LATENT_HW) == 2.0 * macs
    assert decoder_flops_per_chunk(SMALL_PS, *LATENT_HW) < 0.5 * decoder_flops_per_chunk(SMALL, *LATENT_HW)


SMALL_PS_WIDE = SMALL_PS.model_copy(update={"decoder_last_channels": 6, "decoder_last_kt": 3})


def test_the_light_decoders_last_stage_takes_its_width_and_temporal_kernel() -> None:
    d = CausalDecoder(SMALL_PS_WIDE)
    last = [m for m in d.modules() if isinstance(m, CausalConv3d) and m.scale == 4]
    # the third up-sampling's conv makes 6 channels; the stage's convs and conv_out see 2 past frames
    assert [(m.in_channels, m.out_channels, m.kernel_size) for m in last] == [
        (8, 6, (1, 3, 3)), (6, 6, (3, 3, 3)), (6, 6, (3, 3, 3)), (6, 6, (3, 3, 3)), (6, 6, (3, 3, 3)),
        (6, 12, (3, 3, 3))]
    assert decoder_param_count(SMALL_PS_WIDE) == sum(p.numel() for p in d.parameters())


@pytest.mark.parametrize("chunk", [1, 2])
@torch.inference_mode()
def test_a_wider_temporal_last_stage_streams_and_serves_as_the_generic_decoder(chunk: int) -> None:
    d = _prepared(SMALL_PS_WIDE)
    z = _latents(3 * chunk)
    whole = d.decode(z)
    torch.testing.assert_close(_stream(d, z, chunk), whole, atol=2e-5, rtol=0)
    d.prepare_cpu()
    windowed = d.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=chunk)
    torch.testing.assert_close(_stream(d, z, chunk, windowed), whole, atol=2e-5, rtol=0)


def _temporal(block: torch.nn.Module) -> bool:
    return isinstance(block, Upsample) and block.time_conv is not None


@pytest.mark.parametrize("cfg", [SMALL, SMALL_PS, SMALL_PS_WIDE], ids=["conv", "pixel_shuffle", "wide_temporal_last"])
def test_the_decoder_splits_into_stages_at_its_temporal_upsamplings(cfg: VAEConfig) -> None:
    """Blocks before `split` end at the first temporal up-sampling; each stage after it at the next, the last at
    none: what `decode_first` runs a frame at a time."""
    d = CausalDecoder(cfg)
    assert _temporal(d.blocks[d.split - 1]) and not any(_temporal(b) for b in d.blocks[: d.split - 1])
    starts, ends = [lo for lo, _ in d.stages], [hi for _, hi in d.stages]
    assert starts == [d.split, *ends[:-1]] and ends[-1] == len(d.blocks)
    for lo, hi in d.stages[:-1]:
        assert _temporal(d.blocks[hi - 1]) and not any(_temporal(b) for b in d.blocks[lo : hi - 1])
    assert not any(_temporal(b) for b in d.blocks[starts[-1] :])
    assert len(d.stages) == sum(map(_temporal, d.blocks)) == 2  # 4x in time: two 2x stages


@torch.inference_mode()
def test_a_chunks_first_frame_runs_each_stage_on_the_frames_it_needs(one_thread: None) -> None:
    """An onset's first frame: the stage between the two temporal up-samplings convolves its first frame only
    (of two), the last stage its first of four; `decode_rest` the others."""
    d = _prepared(SMALL)
    state = d.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=1)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for j, (lo, _) in enumerate(d.stages):
        block = d.blocks[lo]
        assert isinstance(block, ResBlock)
        run = block.conv1._conv

        def record(x: torch.Tensor, *args: Any, _run: Any = run, _j: int = j) -> torch.Tensor:
            seen[_j].append(x.shape[2] - 2)  # frames convolved (the window holds 2 past ones)
            return _run(x, *args)

        setattr(block.conv1, "_conv", record)  # noqa: B010 (this instance's convolution, recorded)
    d.decode_chunk(_latents(1), state)
    assert seen == {0: [2], 1: [4]}
    d.decode_first(_latents(1), state, 1)
    assert seen == {0: [2, 1], 1: [4, 1]}
    d.decode_rest(state, 1)
    assert seen == {0: [2, 1, 1], 1: [4, 1, 3]}


@pytest.mark.parametrize("cfg", [SMALL, SMALL_PS, SMALL_PS_WIDE], ids=["conv", "pixel_shuffle", "wide_temporal_last"])
@pytest.mark.parametrize("uint8", [False, True], ids=["float", "uint8"])
@pytest.mark.parametrize("chunk", [1, 2])
@torch.inference_mode()
def test_a_chunks_first_frame_then_its_rest_are_the_whole_chunk(cfg: VAEConfig, uint8: bool, chunk: int,
                                                                 one_thread: None) -> None:
    """`decode_first` + `decode_rest` (a speech onset's chunk) give the whole chunk's frames and leave the state where
    decoding it whole would: a stream with every other chunk in two parts (1 + 3 frames, then 2 + 2, 3 + 1, 1 + 3;
    with two latent frames a chunk 1 + 7, 4 + 4, 7 + 1) is the stream decoded whole, to float rounding (uint8: within 1,
    as `frames_uint8` is of the float frames). The first part runs each stage on only the frames it needs."""
    d = _prepared(cfg)
    if uint8:
        d.prepare_cpu()
    z = _latents(9 * chunk)
    total = 4 * chunk
    splits = {1: 1, 3: total // 2, 5: total - 1, 7: 1}  # chunk k in two parts: its first n frames, then the rest
    whole_state, parts_state = (d.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=chunk)
                                for _ in range(2))
    for k in range(9):
        zk = z[:, :, k * chunk : (k + 1) * chunk]
        whole = d.frames_uint8(zk, whole_state) if uint8 else d.decode_chunk(zk, whole_state)
        if k in splits:
            n = splits[k]
            first = d.decode_first(zk, parts_state, n, uint8=uint8)
            assert first.shape[1 if uint8 else 2] == n
            got = torch.cat([first, d.decode_rest(parts_state, n, uint8=uint8)], dim=1 if uint8 else 2)
        else:
            got = d.frames_uint8(zk, parts_state) if uint8 else d.decode_chunk(zk, parts_state)
        assert got.shape == whole.shape
        if uint8:
            assert int((got.int() - whole.int()).abs().max()) <= 1, k
        else:
            torch.testing.assert_close(got, whole, atol=2e-5, rtol=0)
    assert whole.float().std() > 0.05  # not a constant output


def test_decode_first_and_rest_are_refused_out_of_turn(decoder: CausalDecoder) -> None:
    state = decoder.init_state(1, *LATENT_HW, "cpu", torch.float32, chunk_frames=1)
    with pytest.raises(ValueError, match="without decode_first"):
        decoder.decode_rest(state)
    for frames in (0, 4):
        with pytest.raises(ValueError, match=r"takes 1 \.\. 3 frames of a chunk of 4"):
            decoder.decode_first(_latents(1), state, frames)
    with pytest.raises(ValueError, match="serving state"):
        decoder.decode_first(_latents(1), decoder.init_state(1, *LATENT_HW, "cpu", torch.float32))
