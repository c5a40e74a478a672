"""The virtual network's links: FIFO paced transfers, and layer-by-layer (progressive) KV, whose
bytes cannot leave before the forward has made them, against hand-computed ends."""

from __future__ import annotations

import pytest

from pdcluster.sim.network import Network, RankPlace


def network(gbps: float = 8.0) -> Network:  # 8 Gbit/s = 1e9 bytes/s
    return Network([RankPlace("a", nic_gbps=gbps), RankPlace("b", nic_gbps=gbps)])


def test_transfers_queue_behind_each_other_on_the_sender_link() -> None:
    net = network()
    assert net.send(0, 1, 1e9, now=0.0) == pytest.approx(1.0)
    assert net.send(0, 1, 5e8, now=0.2) == pytest.approx(1.5)  # waited for the first
    assert net.send(1, 0, 1e9, now=0.2) == pytest.approx(1.2)  # the other rank's link is free


def test_a_slow_link_sets_the_end_of_a_layer_by_layer_transfer() -> None:
    # 4 layers of 0.25 s each on the link, made every 0.1 s from t=1: the link never waits after the first
    net = network()
    assert net.send_as_made(0, 1, 1e9, made_from=1.0, made_by=1.4, pieces=4) == pytest.approx(1.1 + 1.0)


def test_a_fast_link_waits_for_each_layer_so_the_last_one_leaves_after_the_forward() -> None:
    # 4 layers of 0.01 s each, made every 0.25 s from t=0: the last leaves 0.01 s after the forward ends
    net = network()
    assert net.send_as_made(0, 1, 4e7, made_from=0.0, made_by=1.0, pieces=4) == pytest.approx(1.01)
    # the link was held until then: the next transfer starts after it
    assert net.send(0, 1, 1e7, now=0.5) == pytest.approx(1.02)


def test_a_busy_link_delays_the_first_layer() -> None:
    net = network()
    net.send(0, 1, 2e9, now=0.0)  # busy until t=2
    assert net.send_as_made(0, 1, 4e8, made_from=0.0, made_by=1.0, pieces=4) == pytest.approx(2.4)
