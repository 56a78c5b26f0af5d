"""The tensor-parallel process group dies at `leave()`, not at interpreter exit (characters.process_group).

Each case runs in a fresh interpreter: which modules were imported before the group existed is the point.
The two-rank sessions of test_tensor_parallel and test_lipsync assert the same release on every rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import gc, json, os, socket, weakref
import torch
import torch.distributed as dist
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

def free_port():  # not characters.process_group's: the last case must not import that module
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(name.startswith("pt_gloo") for name in names)

def settled_gloo_threads(up):
    # threads name themselves once running, and leave /proc just after they are joined: poll (10 s at most)
    # for the state expected, rather than race them; a count that never settles is returned as it is
    import time
    deadline = time.monotonic() + 10
    while (gloo_threads() > 0) != up and time.monotonic() < deadline:
        time.sleep(0.01)
    return gloo_threads()
"""


def _run(body: str) -> dict[str, object]:
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_group_that_a_sharded_model_used_is_gone_after_leave() -> None:
    # the meta-device build imports torch._dynamo, which imports torch.distributed.nn.functional: after join
    result = _run("""
        from characters.config import session_config
        from characters.dit import CausalDiT
        from characters.process_group import join, leave
        from characters.tp import apply_tensor_parallel

        group = join("gloo", free_port(), 0, 1)
        threads_up = settled_gloo_threads(up=True)
        with torch.device("meta"):
            model = CausalDiT(session_config("tiny", "cpu").model)
        apply_tensor_parallel(model, group, rank=0, size=2, communicate=False)
        dynamo = "torch._dynamo" in __import__("sys").modules
        del model, group
        released = leave()
        print(json.dumps({"threads_up": threads_up, "dynamo": dynamo, "released": released,
                          "threads_left": settled_gloo_threads(up=False)}))
    """)
    assert result["dynamo"] is True  # the import that used to capture the group happened after join
    assert result["threads_up"] and result["threads_up"] > 0  # type: ignore[operator]
    assert result == {**result, "released": True, "threads_left": 0}


def test_leave_says_when_something_still_holds_the_group() -> None:
    result = _run("""
        from characters.process_group import join, leave

        holder = [join("gloo", free_port(), 0, 1)]
        released = leave()
        print(json.dumps({"released": released, "threads_left": settled_gloo_threads(up=True)}))
    """)
    assert result["released"] is False
    assert result["threads_left"] and result["threads_left"] > 0  # type: ignore[operator]


def test_torch_distributed_nn_imported_after_the_group_keeps_it_alive() -> None:
    # Why join() imports it first. If a torch upgrade makes this fail, the import in
    # characters/process_group.py is no longer needed.
    result = _run("""
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        import torch.distributed.nn.functional
        alive = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        gc.collect()
        print(json.dumps({"alive": alive() is not None, "threads_left": settled_gloo_threads(up=True)}))
    """)
    assert result["alive"] is True
    assert result["threads_left"] and result["threads_left"] > 0  # type: ignore[operator]
