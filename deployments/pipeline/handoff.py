"""The latent handoff between the DiT and the decoder: the only module that sends or receives latents.

A message is a small header (session id, chunk index, shape, dtype) and the tensor. Two kinds travel:

- chunk latents, DiT rank 0 -> decoder, once per chunk: an edge of the compiled graph, whose tensor
  transport `bind` chooses (NCCL "accelerator" on real GPUs, shared memory on CPUs);
- the reference latent, decoder (VAE encoder) -> every DiT rank, once per session (`chunk=REFERENCE`),
  through the object store.

`pack` builds a message on the sending side; `unpack` checks it on the receiving side against what
that side expects (session, chunk, shape) and returns the tensor, so a stale or crossed message fails
loudly instead of being decoded into another session's video.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from deployments.settings import Transport

REFERENCE = -1  # chunk index of the reference latent

ResolvedTransport = Literal["accelerator", "shm"]
N = TypeVar("N")


class HandoffError(RuntimeError):
    """A latent message that does not match what the receiver expects."""


@dataclass(frozen=True)
class LatentHeader:
    session_id: str
    chunk: int  # REFERENCE (-1) for the reference latent
    shape: tuple[int, ...]  # chunk: (1, C, Cf, h, w); reference: (1, C, h, w)
    dtype: str  # torch dtype name, e.g. "float32"
    given_up: bool = False  # the DiT gave this chunk up for a speech onset (`DiTWorker.preempt`): no latents in it


@dataclass(frozen=True)
class Latents:
    """One message: header, then the tensor (kept on the sender's device; the transport moves it)."""

    header: LatentHeader
    tensor: torch.Tensor


def pack(session_id: str, chunk: int, tensor: torch.Tensor, given_up: bool = False) -> Latents:
    """The message for `tensor`: chunk latents (1, C, Cf, h, w) or the reference latent (1, C, h, w); `given_up`: a
    chunk the DiT gave up (the tensor, of the latents' shape for the graph's static channel, holds none).

    The tensor is made contiguous: the NCCL channel sends its bytes, and once a process is part of a
    compiled graph Ray serialises every tensor it returns through a byte view, which a strided tensor
    (the GPU encoder's channels-last output) refuses."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return Latents(LatentHeader(session_id, chunk, tuple(tensor.shape), dtype, given_up), tensor.contiguous())


def unpack(message: Latents, *, session_id: str, chunk: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor of `message` after checking its header against the receiver's expectations."""
    h = message.header
    if h.session_id != session_id or h.chunk != chunk:
        raise HandoffError(
            f"latents for session {h.session_id!r} chunk {h.chunk} reached a receiver expecting session "
            f"{session_id!r} chunk {chunk}; the pipeline is out of step: end the session"
        )
    got = (tuple(message.tensor.shape), str(message.tensor.dtype).removeprefix("torch."))
    if got != (h.shape, h.dtype):
        raise HandoffError(f"latents of chunk {h.chunk}: header says {h.shape} {h.dtype}, tensor is {got[0]} {got[1]}")
    if shape is not None and h.shape != shape:
        raise HandoffError(
            f"latents of chunk {h.chunk} have shape {h.shape}, the receiver expects {shape}; "
            "DiT and decoder were built from different configs"
        )
    return message.tensor


def resolve_transport(configured: Transport, device_type: str, decoder_shares_gpu: bool) -> ResolvedTransport:
    """The transport of the latent edge, from the workers' device (one code path for GPUs and CPUs).

    NCCL cannot connect two ranks on one GPU, so a decoder sharing DiT rank 0's GPU uses shared memory.
    """
    if configured == "shm":
        return "shm"
    on_cuda = device_type == "cuda"
    if configured == "accelerator":
        if not on_cuda or decoder_shares_gpu:
            raise ValueError(
                f"transport='accelerator' (NCCL) needs the DiT and the decoder on separate CUDA GPUs; the workers "
                f"run on {device_type!r} and decoder_shares_gpu={decoder_shares_gpu}: use transport='auto' or 'shm'"
            )
        return "accelerator"
    return "accelerator" if on_cuda and not decoder_shares_gpu else "shm"


def bind(node: N, transport: ResolvedTransport) -> N:
    """Mark a compiled-graph node that returns `Latents` to carry its tensor over `transport`."""
    return node.with_tensor_transport(transport=transport)  # type: ignore[attr-defined]
