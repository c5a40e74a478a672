"""The rank table: rank → host, node, device and transfer address, loaded from JSON or TOML.

File format (JSON shown; TOML uses `[[ranks]]` tables with the same keys)::

    {"ranks": [
      {"rank": 0, "host": "127.0.0.1", "node": "n0", "device": "cpu", "transfer_address": "127.0.0.1:7100"},
      {"rank": 1, "host": "127.0.0.1", "node": "n0", "device": "cpu", "transfer_address": "127.0.0.1:7101",
       "grpc_port": 50051, "link_gbps": 10.0}
    ]}

`grpc_port` (default 0: none) and `link_gbps` (default 0: unlimited; this rank's emulated NIC for
traffic leaving its node, paced in-process) are optional; everything else is required. So are the
fields a launch fills from device discovery (all informational: a fabric chooses nothing by them
unless it says so):

- `device`: "cpu" or "cuda:N", N the node's own ordinal (the process sees it as its only device
  through `CUDA_VISIBLE_DEVICES=N`);
- `nic`: the network interface closest to the device (or holding the transfer address), "" unknown;
- `rdma_device`: that NIC's RDMA device ("mlx5_0"), "" when it has none;
- `numa_node`: the device's (or CPU worker's cores') NUMA node, null when unknown;
- `nic_gbps`: the NIC's line rate as the cluster file gives it (0: not given; not paced);
- `tp_group`: the global rank of the tensor-parallel group the rank belongs to (its rank 0), for
  the ranks R+1..R+N-1 of a `--tp N` replica at rank R (absent: a group of one).

A top-level `"store": "HOST:PORT"` (optional; tables without it stay valid) names the rendezvous
store every rank reaches (`transfer/store.py`): where the nccl and rdma fabrics exchange set-up data.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transfer.core import Rank

_REQUIRED = ("rank", "host", "node", "device", "transfer_address")
_OPTIONAL = ("grpc_port", "link_gbps", "nic", "rdma_device", "numa_node", "nic_gbps", "tp_group")


class RankTableError(ValueError):
    """The rank table is malformed (missing field, duplicate rank, bad address)."""


@dataclass(frozen=True)
class RankEntry:
    """One process of the cluster."""

    rank: Rank
    host: str
    node: str
    device: str
    transfer_address: str
    grpc_port: int = 0
    link_gbps: float = 0.0
    nic: str = ""
    rdma_device: str = ""
    numa_node: int | None = None
    nic_gbps: float = 0.0
    tp_group: int | None = None
    """The global rank of the tensor-parallel group this rank belongs to (its rank 0, the process
    serving gRPC); None: a group of one, or not said. A `--tp N` replica at rank R gives its ranks
    R+1..R+N-1 fabric endpoints of their own only when their entries say `tp_group` R."""

    @property
    def transfer_host(self) -> str:
        """Host part of the transfer address."""
        return self.transfer_address.rpartition(":")[0]

    @property
    def transfer_port(self) -> int:
        """Port part of the transfer address."""
        return int(self.transfer_address.rpartition(":")[2])


@dataclass(frozen=True)
class RankTable:
    """All ranks, validated: unique ranks, unique transfer addresses."""

    entries: tuple[RankEntry, ...]
    store: str = ""
    """"HOST:PORT" of the rendezvous store (`transfer/store.py`); "" = none named."""

    def __post_init__(self) -> None:
        if self.store:
            _check_address("store", self.store)
        seen: set[int] = set()
        addresses: set[str] = set()
        for entry in self.entries:
            if entry.rank in seen:
                raise RankTableError(f"duplicate rank {entry.rank}")
            if entry.transfer_address in addresses:
                raise RankTableError(f"duplicate transfer address {entry.transfer_address}")
            seen.add(entry.rank)
            addresses.add(entry.transfer_address)

    def __getitem__(self, rank: int) -> RankEntry:
        for entry in self.entries:
            if entry.rank == rank:
                return entry
        raise KeyError(f"rank {rank} is not in the rank table")

    def __contains__(self, rank: object) -> bool:
        return any(entry.rank == rank for entry in self.entries)

    def __iter__(self) -> Iterator[RankEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def ranks(self) -> tuple[Rank, ...]:
        """All ranks in table order."""
        return tuple(entry.rank for entry in self.entries)

    def same_node(self, a: int, b: int) -> bool:
        """Whether ranks `a` and `b` share a node."""
        return self[a].node == self[b].node

    def to_json(self) -> str:
        """The JSON form `load_rank_table` reads back."""
        ranks = [_record(entry) for entry in self.entries]
        return json.dumps({"store": self.store, "ranks": ranks} if self.store else {"ranks": ranks}, indent=1)

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]], store: str = "") -> RankTable:
        """Build from dicts with the file's keys."""
        return cls(tuple(_entry(record) for record in records), store)

    @classmethod
    def local(cls, ports: Iterable[int], host: str = "127.0.0.1", node: str = "n0") -> RankTable:
        """A single-node table, rank i listening on `ports[i]` (tests, local clusters, benchmarks)."""
        return cls(
            tuple(
                RankEntry(Rank(i), host, node, "cpu", f"{host}:{port}") for i, port in enumerate(ports)
            )
        )


def _record(entry: RankEntry) -> dict[str, Any]:
    """The entry's file form (`tp_group` only when set: tables without groups read as before)."""
    record = asdict(entry)
    if record["tp_group"] is None:
        del record["tp_group"]
    return record


def _entry(record: Mapping[str, Any]) -> RankEntry:
    missing = [key for key in _REQUIRED if key not in record]
    if missing:
        raise RankTableError(f"rank table entry {dict(record)} is missing {', '.join(missing)}")
    unknown = set(record) - {*_REQUIRED, *_OPTIONAL}
    if unknown:
        raise RankTableError(f"rank table entry has unknown fields {sorted(unknown)}")
    address = str(record["transfer_address"])
    _check_address("transfer_address", address)
    rank = record["rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise RankTableError(f"rank {rank!r} is not a non-negative integer")
    return RankEntry(
        rank=Rank(rank),
        host=str(record["host"]),
        node=str(record["node"]),
        device=str(record["device"]),
        transfer_address=address,
        grpc_port=int(record.get("grpc_port", 0)),
        link_gbps=float(record.get("link_gbps", 0.0)),
        nic=str(record.get("nic", "")),
        rdma_device=str(record.get("rdma_device", "")),
        numa_node=_numa_node(record.get("numa_node")),
        nic_gbps=float(record.get("nic_gbps", 0.0)),
        tp_group=_optional_rank("tp_group", record.get("tp_group")),
    )


def _check_address(what: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RankTableError(f"{what} {address!r} is not host:port")


def _numa_node(value: Any) -> int | None:
    return _optional_rank("numa_node", value)


def _optional_rank(what: str, value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RankTableError(f"{what} {value!r} is not a non-negative integer or null")
    return value


def parse_rank_table(text: str, fmt: str = "json") -> RankTable:
    """Parse rank-table text in `fmt` ("json" or "toml")."""
    try:
        data = tomllib.loads(text) if fmt == "toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RankTableError(f"rank table is not valid {fmt}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise RankTableError('rank table needs a top-level "ranks" list')
    if not data["ranks"]:
        raise RankTableError("rank table has no ranks")
    store = data.get("store", "")
    if not isinstance(store, str):
        raise RankTableError(f"store {store!r} is not a HOST:PORT string")
    return RankTable.from_records(data["ranks"], store)


def load_rank_table(path: str | Path) -> RankTable:
    """Load a rank table file; the format follows the suffix (.toml, else JSON)."""
    path = Path(path)
    return parse_rank_table(path.read_text(), "toml" if path.suffix == ".toml" else "json")
