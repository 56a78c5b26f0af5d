"""Service config and environment, latent handoff, transport choice, failure classes and the capacity
ledger: pure pieces of the runtime, no cluster."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from ray.exceptions import ActorDiedError, GetTimeoutError

from characters.config import TopologyConfig
from deployments.pipeline.graph import ChunkFailure, classify, graph_mode
from deployments.pipeline.handoff import REFERENCE, HandoffError, pack, resolve_transport, unpack
from deployments.settings import QUEUE_MAX, USE_GPUS, ServiceConfig
from deployments.types import NoCapacity
from placement import AdmissionQueue, Admit, Request, bundles_for, decide, free_bundles
from placement.actor import ledger


def test_service_config_composes_and_refuses_bad_values(tmp_path: Path) -> None:
    svc = ServiceConfig(topology="gpu1", model_overrides={"dit": {"num_layers": 1}}, output_dir=str(tmp_path))
    cfg = svc.session_config()
    assert (cfg.model.dit.num_layers, cfg.topology.name, cfg.seed) == (1, "gpu1", 0)
    tp2 = ServiceConfig(topology=TopologyConfig(name="tp2", dit_ranks=2, decoder_gpus=1))
    assert tp2.topology_config.dit_ranks == 2
    with pytest.raises(ValidationError, match="extra"):
        ServiceConfig(warm=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="not divisible by 3 tensor-parallel ranks"):
        ServiceConfig(topology="h100x4")  # tiny has 4 heads: no 3-way split
    with pytest.raises(ValidationError, match="transport"):
        ServiceConfig(transport="nccl")  # type: ignore[arg-type]
    assert svc.output_path("s1", None) == tmp_path / "s1.mp4"
    assert svc.output_path("s1", "x/y.mp4") == tmp_path / "x" / "y.mp4"
    with pytest.raises(ValueError, match="outside output_dir"):
        svc.output_path("s1", "../escape.mp4")


def test_environment_is_parsed_once_with_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARACTERS_QUEUE_MAX", "3")
    monkeypatch.setenv("CHARACTERS_USE_GPUS", "false")
    monkeypatch.setenv("CHARACTERS_WARM_SLOTS", "2")
    svc = ServiceConfig.from_env(queue_timeout_s=5.0)
    assert (svc.queue_max, svc.use_gpus, svc.warm_slots, svc.queue_timeout_s) == (3, False, 2, 5.0)
    monkeypatch.setenv("CHARACTERS_USE_GPUS", "auto")
    assert USE_GPUS.get() is None
    monkeypatch.setenv("CHARACTERS_QUEUE_MAX", "lots")
    with pytest.raises(ValueError, match="CHARACTERS_QUEUE_MAX='lots' is invalid"):
        QUEUE_MAX.get()


def test_handoff_checks_the_header() -> None:
    z = torch.randn(1, 8, 1, 8, 12)  # (1, C, Cf, h, w)
    msg = pack("s", 3, z)
    assert (msg.header.shape, msg.header.dtype, msg.header.chunk) == ((1, 8, 1, 8, 12), "float32", 3)
    assert unpack(msg, session_id="s", chunk=3, shape=(1, 8, 1, 8, 12)) is z
    with pytest.raises(HandoffError, match="expecting session 's' chunk 4"):
        unpack(msg, session_id="s", chunk=4)
    with pytest.raises(HandoffError, match="the receiver expects"):
        unpack(msg, session_id="s", chunk=3, shape=(1, 16, 1, 8, 12))
    ref = pack("s", REFERENCE, torch.zeros(1, 8, 8, 12))
    assert unpack(ref, session_id="s", chunk=REFERENCE).shape == (1, 8, 8, 12)


def test_handoff_sends_contiguous_bytes_whatever_the_sender_layout() -> None:
    """A channels-last reference latent (the GPU encoder's layout) must survive Ray's compiled-graph tensor
    serialiser, which views the tensor as bytes (it failed on the H200: stride(-1) must be 1)."""
    from ray.experimental.channel.serialization_context import _SerializationContext
    from ray.experimental.util.types import Device

    z = torch.randn(1, 16, 8, 12).to(memory_format=torch.channels_last)  # stride(-1) == 16
    with pytest.raises(RuntimeError, match="stride"):
        _SerializationContext().serialize_to_numpy_or_scalar(z)
    msg = pack("s", REFERENCE, z)
    assert msg.tensor.is_contiguous() and torch.equal(msg.tensor, z)
    ctx = _SerializationContext()
    back = ctx.deserialize_tensor(ctx.serialize_to_numpy_or_scalar(msg.tensor), Device.CPU)
    assert torch.equal(back, z)


def test_transport_follows_the_device() -> None:
    assert resolve_transport("auto", "cpu", decoder_shares_gpu=True) == "shm"
    assert resolve_transport("auto", "cpu", decoder_shares_gpu=False) == "shm"
    assert resolve_transport("auto", "cuda", decoder_shares_gpu=False) == "accelerator"
    assert resolve_transport("auto", "cuda", decoder_shares_gpu=True) == "shm"  # NCCL: one rank per GPU
    assert resolve_transport("shm", "cuda", decoder_shares_gpu=False) == "shm"
    with pytest.raises(ValueError, match="separate CUDA GPUs"):
        resolve_transport("accelerator", "cpu", decoder_shares_gpu=False)


def test_the_graph_follows_the_device_unless_configured() -> None:
    """auto: the compiled graph on CUDA, plain actor calls on CPUs (a graph actor spins a core while idle)."""
    assert ServiceConfig().graph == "auto"
    assert (graph_mode("auto", "cuda"), graph_mode("auto", "cpu")) == ("compiled", "actor_calls")
    for mode in ("compiled", "actor_calls"):
        assert graph_mode(mode, "cpu") == graph_mode(mode, "cuda") == mode
    with pytest.raises(ValidationError, match="graph"):
        ServiceConfig(graph="spin")


def test_a_slot_on_cpus_drives_its_chunks_over_actor_calls_by_default() -> None:
    """The session actor's pipeline follows the mode: without a compiled graph on CPU workers."""
    from deployments.pipeline.graph import ActorCallPipeline, Workers
    from deployments.sessions.actor import SessionActor

    actor = object.__new__(SessionActor)  # only the fields _make_pipeline reads
    actor.service = ServiceConfig()
    actor.workers = Workers(dits=[], decoder=None, room=None, transport="shm", device="cpu")
    assert isinstance(actor._make_pipeline(), ActorCallPipeline)


def test_failures_are_classified() -> None:
    assert classify(GetTimeoutError("slow")).reason == "chunk_timeout"
    assert classify(ActorDiedError()).reason == "actor_died"
    assert str(ChunkFailure("x", "y")) == "x: y"


def test_refusal_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(NoCapacity("full", 7.0, code="quota_exceeded")))
    assert isinstance(err, NoCapacity) and (str(err), err.retry_after_s, err.code) == ("full", 7.0, "quota_exceeded")


def test_ledger_subtracts_the_scheduler_slots() -> None:
    nodes = [
        {"NodeID": "b", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0, "memory": 1e9}, "Labels": {}},
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 4.0}},
        {"NodeID": "dead", "Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0}},
    ]
    spec = bundles_for(TopologyConfig(name="gpu1", dit_ranks=1, decoder_gpus=0))  # 1 GPU + 1 CPU
    held = ledger(nodes, {"a": [spec.demand(), spec.demand(), spec.demand()]})
    assert [(n.node_id, n.free["GPU"], n.free["CPU"]) for n in held] == [("a", 1.0, 5.0), ("b", 2.0, 8.0)]
    assert free_bundles(held, spec) == 3
    d = decide(held, AdmissionQueue(1), Request("r", spec, 0.0, 10.0), 0.0)
    assert d == Admit("r", "a", spec.demand())  # best fit: the node left with fewest GPUs


def test_precision_is_a_deployment_setting_refused_on_cpu_bundles(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ServiceConfig(preset="57b", topology="h100x4", precision="fp8", use_gpus=True).session_config()
    assert (cfg.model.precision, cfg.model.attention_precision) == ("fp8", "bf16")
    assert ServiceConfig().session_config().model.precision == "bf16"  # the default
    with pytest.raises(ValueError, match=r"precision='fp8' needs GPU bundles and use_gpus=False"):
        ServiceConfig(precision="fp8", use_gpus=False)
    with pytest.raises(ValueError, match="attention_precision"):
        ServiceConfig(attention_precision="fp8", use_gpus=False)
    monkeypatch.setenv("CHARACTERS_PRECISION", "fp8")
    monkeypatch.setenv("CHARACTERS_PRESET", "57b")
    monkeypatch.setenv("CHARACTERS_TOPOLOGY", "h100x5")
    assert ServiceConfig.from_env().session_config().model.precision == "fp8"
