"""The tensor-parallel process group's life: join it on loopback, and leave it so that nothing outlives it.

Why this module imports `torch.distributed.nn.functional` before any group exists: that module binds
`group=group.WORLD` as the default argument of ten functions, evaluated once, when it is first imported.
torch._dynamo imports it lazily (the first op on the ``meta`` device does, which is how every `DiTRunner` is
built). Imported after `init_process_group`, those defaults hold the live group for the rest of the process:
`destroy_process_group()` then cannot free it, gloo's worker threads stay up, and they are torn down during
interpreter exit instead, which aborts the process at random ("terminate called without an active exception",
SIGABRT; seen in CI). Imported first, the defaults hold ``None`` and the group dies when its last user drops it.
"""

from __future__ import annotations

import gc
import os
import socket
import weakref
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before any group exists: see the module docstring

Backend = Literal["gloo", "nccl"]


def free_port() -> int:
    """A free TCP port on loopback, for rank 0 to host the group's rendezvous on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join(backend: Backend, port: int, rank: int, size: int, *, timeout_s: float | None = None,
         gloo_ifname: str = "lo", device: torch.device | None = None) -> dist.ProcessGroup:
    """Join the default group of `size` ranks whose rendezvous is rank 0's TCP `port` on 127.0.0.1.

    `timeout_s` bounds the rendezvous and each collective (None: torch's default for the backend). gloo binds
    `gloo_ifname` (loopback by default; also a gloo group made beside an NCCL one later, as a DiT rank's host-side
    `signals`); NCCL binds the group to `device` when given (eager init)."""
    os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=None if timeout_s is None else timedelta(seconds=timeout_s), device_id=device)
    group = dist.group.WORLD
    if group is None:  # init_process_group sets it or raises; this keeps the type honest
        raise RuntimeError("init_process_group returned without a default group")
    return group


def leave(wait: bool = True) -> bool:
    """Destroy the default group, after every rank got here when `wait` (pass False on an error path, where a
    peer may be gone). Returns whether the group is gone now, its threads joined here rather than at interpreter
    exit: False means something still holds it, so release every model that was sharded over it first."""
    group = dist.group.WORLD
    if group is None:
        return True
    alive = weakref.ref(group)
    del group
    if wait:
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()
    gc.collect()
    return alive() is None
