"""Rank table parsing and validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transfer.ranktable import RankTable, RankTableError, load_rank_table, parse_rank_table

GOOD = """{"ranks": [
 {"rank": 0, "host": "h0", "node": "n0", "device": "cuda:0", "transfer_address": "10.0.0.1:7000"},
 {"rank": 1, "host": "h1", "node": "n1", "device": "cuda:0", "transfer_address": "10.0.0.2:7000",
  "grpc_port": 50051, "link_gbps": 100}
]}"""


def test_json_round_trip() -> None:
    table = parse_rank_table(GOOD)
    assert table.ranks == (0, 1)
    assert table[1].link_gbps == 100.0 and table[1].grpc_port == 50051
    assert table[0].transfer_host == "10.0.0.1" and table[0].transfer_port == 7000
    assert not table.same_node(0, 1)
    assert parse_rank_table(table.to_json()) == table


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "ranks.toml"
    path.write_text(
        '[[ranks]]\nrank = 3\nhost = "a"\nnode = "n"\ndevice = "cpu"\ntransfer_address = "127.0.0.1:9000"\n'
    )
    table = load_rank_table(path)
    assert table[3].device == "cpu" and 3 in table and 4 not in table


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"ranks": [{"rank": 0, "host": "h", "node": "n", "device": "d"}]}', "missing transfer_address"),
        ('{"ranks": [{"rank": 0, "host": "h", "node": "n", "device": "d", "transfer_address": "x"}]}',
         "not host:port"),
        ('{"ranks": []}', "no ranks"),
        ("{}", "ranks"),
        ("[", "not valid json"),
        ('{"ranks": [{"rank": -1, "host": "h", "node": "n", "device": "d", "transfer_address": "a:1"}]}',
         "non-negative"),
        ('{"ranks": [{"rank": 0, "host": "h", "node": "n", "device": "d", "transfer_address": "a:1",'
         ' "x": 1}]}', "unknown fields"),
    ],
)
def test_malformed_tables_are_rejected(text: str, message: str) -> None:
    with pytest.raises(RankTableError, match=message):
        parse_rank_table(text)


def test_duplicates_are_rejected() -> None:
    record = {"rank": 0, "host": "h", "node": "n", "device": "d", "transfer_address": "a:1"}
    with pytest.raises(RankTableError, match="duplicate rank 0"):
        RankTable.from_records([record, {**record, "transfer_address": "a:2"}])
    with pytest.raises(RankTableError, match="duplicate transfer address"):
        RankTable.from_records([record, {**record, "rank": 1}])
    with pytest.raises(KeyError):
        RankTable.from_records([record])[5]


def test_launch_fields_device_nic_numa_and_rate_round_trip() -> None:
    record = {"rank": 0, "host": "10.0.0.1", "node": "dgx", "device": "cuda:3",
              "transfer_address": "10.0.0.1:7000", "nic": "ibp25s0", "rdma_device": "mlx5_3", "numa_node": 1,
              "nic_gbps": 400}
    table = RankTable.from_records([record, {**record, "rank": 1, "transfer_address": "10.0.0.1:7001",
                                             "numa_node": None}])
    first = table[0]
    assert (first.nic, first.rdma_device, first.numa_node, first.nic_gbps) == ("ibp25s0", "mlx5_3", 1, 400.0)
    assert table[1].numa_node is None and parse_rank_table(table.to_json()) == table
    assert table[0].link_gbps == 0.0  # the NIC's rate is recorded, never paced
    with pytest.raises(RankTableError, match="numa_node"):
        RankTable.from_records([{**record, "numa_node": -1}])


def test_the_rendezvous_store_address_is_an_optional_top_level_field() -> None:
    table = RankTable.local([7100, 7101])
    assert table.store == "" and "store" not in json.loads(table.to_json())  # old tables unchanged
    named = RankTable(table.entries, store="10.0.0.1:29500")
    again = parse_rank_table(named.to_json())
    assert again.store == "10.0.0.1:29500" and again == named
    with pytest.raises(RankTableError, match="store"):
        parse_rank_table('{"store": "nowhere", "ranks": [' + json.dumps(
            {"rank": 0, "host": "h", "node": "n", "device": "cpu", "transfer_address": "h:1"}) + "]}")
