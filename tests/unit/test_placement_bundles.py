"""bundles_for: exact bundle lists for every topology (pure CPU, no Ray, no marker)."""

from __future__ import annotations

import pytest

from characters.config import TOPOLOGIES, session_config
from placement import PlacementSpec, Role, bundles_for

H100 = "accelerator_type:H100"
G = {"GPU": 1.0}
G_H100 = {"GPU": 1.0, H100: 0.001}
G_B200 = {"GPU": 1.0, "accelerator_type:B200": 0.001}
C1 = {"CPU": 1.0}
DIT0, DIT1, DIT2, DIT3 = (Role("dit", r) for r in range(4))
DEC, ROOM = Role("decoder"), Role("room")


EXPECTED_BUNDLES = {
    "cpu": ((G, C1), ((DIT0, DEC), (ROOM,))),
    "gpu1": ((G, C1), ((DIT0, DEC), (ROOM,))),
    "b200x3": ((G_B200, G_B200, G_B200, C1), ((DIT0,), (DIT1,), (DEC,), (ROOM,))),
    "h100x4": ((G_H100,) * 4 + (C1,), ((DIT0,), (DIT1,), (DIT2,), (DEC,), (ROOM,))),
    "h100x5": ((G_H100,) * 5 + (C1,), ((DIT0,), (DIT1,), (DIT2,), (DIT3,), (DEC,), (ROOM,))),
}


def test_every_topology_has_expected_bundles() -> None:
    assert set(EXPECTED_BUNDLES) == set(TOPOLOGIES)


@pytest.mark.parametrize("name", sorted(EXPECTED_BUNDLES))
def test_bundles_for_topology(name: str) -> None:
    bundles, roles = EXPECTED_BUNDLES[name]
    spec = bundles_for(session_config("57b", name))
    assert spec.bundles == bundles
    assert spec.strategy == "STRICT_PACK"
    assert spec.topology == name
    assert tuple(spec.role_of(i) for i in range(len(bundles))) == roles
    assert spec.bundle_of("room") == len(bundles) - 1
    assert spec.dit_ranks == TOPOLOGIES[name].dit_ranks
    assert spec.gpus == TOPOLOGIES[name].gpus
    assert spec.cpus == 1.0
    assert spec.ray_bundles() == list(bundles)
    assert spec.ray_bundles()[0] is not spec.bundles[0]
    assert bundles_for(TOPOLOGIES[name]) == spec  # a bare TopologyConfig gives the same spec


def test_bundle_demand_and_roles_h100x5() -> None:
    spec = bundles_for(session_config("57b", "h100x5"))
    assert spec.demand() == {"CPU": 1.0, "GPU": 5.0, H100: 0.005}
    assert (spec.gpus, spec.cpus) == (5.0, 1.0)
    assert [spec.bundle_of("dit", r) for r in range(4)] == [0, 1, 2, 3]
    assert spec.bundle_of("decoder") == 4
    assert not spec.decoder_shares_gpu
    with pytest.raises(IndexError, match="bundle_index=6"):
        spec.role_of(6)
    with pytest.raises(KeyError, match="dit:4"):
        spec.bundle_of("dit", 4)


def test_gpu1_decoder_shares_rank0() -> None:
    spec = bundles_for(session_config("tiny", "gpu1"))
    assert spec.demand() == {"CPU": 1.0, "GPU": 1.0}
    assert spec.bundle_of("decoder") == spec.bundle_of("dit", 0) == 0
    assert spec.decoder_shares_gpu


def test_cpu_only_bundles_have_same_shape() -> None:
    spec = bundles_for(session_config("57b", "h100x5"), use_gpus=False)
    assert spec.bundles == (C1,) * 6
    assert spec.roles == EXPECTED_BUNDLES["h100x5"][1]
    assert spec.demand() == {"CPU": 6.0}
    assert spec.gpus == 0.0
    assert bundles_for(session_config("tiny", "cpu"), use_gpus=False).bundles == (C1, C1)


def test_room_cpus_from_topology() -> None:
    cfg = session_config("57b", {"name": "big-room", "dit_ranks": 2, "decoder_gpus": 1, "room_cpus": 2.5})
    spec = bundles_for(cfg)
    assert spec.bundles == (G, G, G, {"CPU": 2.5})
    assert spec.demand() == {"CPU": 2.5, "GPU": 3.0}


def test_placement_spec_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="2 bundles but 1 role"):
        PlacementSpec("x", (G, C1), ((ROOM,),))
    with pytest.raises(ValueError, match="name a role twice"):
        PlacementSpec("x", (G, C1), ((ROOM,), (ROOM,)))
    with pytest.raises(ValueError, match="negative"):
        PlacementSpec("x", ({"GPU": -1.0},), ((ROOM,),))
