"""Topology validation: each bad topology is one line naming the level and the field."""

from __future__ import annotations

import math

import pytest

from atp_pipeline.errors import ConfigError
from atp_pipeline.topology.builders import nodes, torus2d
from atp_pipeline.topology.model import Topology


def topo(*levels, **extra):
    return {"name": "t", "levels": list(levels), **extra}


def lv(name="gpu", count=4, p2p=10.0, group=10.0, routing="direct"):
    return {"name": name, "count": count, "p2p_GBps": p2p, "group_GBps": group, "routing": routing}


@pytest.mark.parametrize("cfg, expected", [
    (topo(lv(p2p=[[0, 1, 1], [1, 0, 1], [1, 1, 0]], group=2)),
     "topology 't': level 'gpu' (levels[0]): p2p_GBps is a 3x3 matrix but count is 4 (need 4x4)"),
    (topo(lv(count=2, p2p=[[0, 1], [1]], group=1)),
     "topology 't': level 'gpu' (levels[0]): p2p_GBps is a 2x2 matrix but count is 2"),
    (topo(lv(p2p=-5.0)), "p2p_GBps must be a positive finite number or a 4x4 matrix, got -5.0"),
    (topo(lv(p2p=math.inf)), "p2p_GBps must be a positive finite number"),
    (topo(lv(group=0.0)), "level 'gpu' (levels[0]): group_GBps must be a positive finite number, got 0.0"),
    (topo(lv(group=math.nan)), "group_GBps must be a positive finite number, got nan"),
    (topo(lv(count=0)), "level 'gpu' (levels[0]): count must be >= 1, got 0"),
    (topo(lv(count=2, p2p=[[0, 5], [5, 1]], group=5)), "p2p_GBps[1][1] must be 0"),
    (topo(lv(count=2, p2p=[[0, 0], [5, 0]], group=5)), "p2p_GBps[0][1] is 0 on a 'direct' level"),
    (topo(lv(count=4, p2p=[[0, 5, 0, 0], [5, 0, 0, 0], [0, 0, 0, 5], [0, 0, 5, 0]], group=5,
             routing="routed")), "the P2P links do not connect all 4 units"),
    (topo(lv(count=2, p2p=10.0, group=30.0)), "group_GBps 30 exceeds the 10 GB/s of unit 0's P2P links"),
    (topo(lv(name="node", count=2), lv(count=4), world_size=6),
     "topology 't': world_size is 6 but the level counts give 2 x 4 = 8"),
    (topo(), "topology 't': 'levels' is empty"),
    (topo(lv(), calibrated=[{"mesh": [3, 1], "B1_GBps": 1.0}]), "calibrated[0]: mesh 3x1 has 3 devices"),
    (topo(lv(), calibrated=[{"mesh": [2, 2], "B1_GBps": 1.0}]), "calibrated[0]: B2_GBps must be a positive"),
    (topo(lv(), calibrated=[{"mesh": [4, 1], "B1_GBps": 1.0, "B2_GBps": 1.0}]),
     "B2_GBps given for a mesh dimension of size 1"),
    (topo(lv(name="gpu", count=4, p2p=10.0, group=10.0, routing="direct") | {"bandwith": 3}),
     "topology 't': unknown key 'bandwith' (LevelConfig keys: name, count, p2p_GBps, group_GBps, "
     "routing, aggregates)"),
    (topo(lv(count="four")), "Value 'four' of type 'str' could not be converted to Integer"),
])
def test_bad_topology_is_one_line_naming_the_problem(cfg, expected):
    with pytest.raises(ConfigError) as exc:
        Topology.from_config(cfg)
    msg = str(exc.value)
    assert expected in msg
    assert "\n" not in msg


def test_world_size_and_unit_sizes():
    t = Topology.from_config(nodes(4, 4, 25, 200, 600))
    assert t.world_size == 16
    assert t.unit_sizes == (16, 4, 1)
    assert Topology.from_config(topo(lv(count=8), world_size=8)).world_size == 8


def test_restrict_to_occupied_sub_topology():
    ic4 = Topology.from_config(nodes(4, 4, 25, 200, 600, name="ic4"))
    one_node = ic4.restrict(4)
    assert [(lvl.name, lvl.count) for lvl in one_node.levels] == [("gpu", 4)]
    assert "first 4 of 16 devices (one 'node')" in one_node.note
    two_nodes = ic4.restrict(8)
    assert [(lvl.name, lvl.count) for lvl in two_nodes.levels] == [("node", 2), ("gpu", 4)]
    single = ic4.restrict(1)
    assert single.world_size == 1 and [(lvl.name, lvl.count) for lvl in single.levels] == [("gpu", 1)]
    pair = ic4.restrict(2)
    assert [(lvl.name, lvl.count) for lvl in pair.levels] == [("gpu", 2)]
    torus = Topology.from_config(torus2d(4, 4, 25)).restrict(8)
    assert torus.levels[0].p2p.tolist() == [[0, 100], [100, 0]]  # sliced matrix
    with pytest.raises(ConfigError, match="6 devices do not fill whole 'node' units"):
        ic4.restrict(6)
    with pytest.raises(ConfigError, match="32 devices requested but topology 'ic4' has 16"):
        ic4.restrict(32)


def test_to_dict_round_trips():
    ic4 = Topology.from_config(nodes(4, 4, 25, 200, 600, name="ic4"))
    for t in (ic4, ic4.restrict(8), Topology.from_config(torus2d(4, 4, 25))):
        again = Topology.from_config(t.to_dict())
        assert again.to_dict() == t.to_dict()
