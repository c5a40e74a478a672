"""`python -m replica.tp.worker`: one rank > 0 of a tensor-parallel replica, started by its leader.

It joins the group through the leader's store, loads its shard, and runs each published forward
until the leader stops it or goes away.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from pathlib import Path

import torch

from replica.cluster import WEIGHT_BUFFER, kv_layout_of
from replica.engine.runner import ModelRunner
from replica.model.layout import Shard
from replica.model.weights import TORCH_DTYPES
from replica.params.store import ParamStore
from replica.params.transfer import WeightMover
from replica.tp.fabric import open_worker_cluster
from replica.tp.group import TpGroup, join_store
from replica.tp.kvmove import SHARD_STREAM, ShardEndpoint
from replica.tp.rank import RankModel, RankSpec, build_rank, rank_device, share_cpu_threads
from replica.tp.runner import Endpoint, serve_worker
from replica.tp.weights import ReportingReadiness, WeightEndpoint
from transfer.core import Stream
from transfer.errors import FabricUnavailable
from transfer.ranktable import load_rank_table

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--device", default="cpu", help="the leader's device (rank r takes cuda:index+r)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the leader's store")
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--attention-backend", default="torch")
    parser.add_argument("--timeout", type=float, required=True, help="seconds every collective may take")
    parser.add_argument("--cluster", type=Path, default=None,
                        help="the rank table: this rank's fabric endpoint is entry --transfer-rank")
    parser.add_argument("--transfer-rank", type=int, default=None, help="this rank's global rank")
    parser.add_argument("--fabric", default="tcp", help="the replica's --fabric (this rank's endpoint's)")
    parser.add_argument("--inactive", action="store_true", help="start without weights")
    return parser


def _endpoint(args: argparse.Namespace, rank: RankModel, host: str, port: int) -> Endpoint | None:
    """This rank's fabric endpoint for per-rank KV migration and weights (none without a rank table)."""
    if args.cluster is None or args.transfer_rank is None:
        return None
    cache = rank.cache
    table = load_rank_table(args.cluster)
    cluster = open_worker_cluster(args.fabric, table, args.transfer_rank, cache.tensor, rank.buffer)
    layout = kv_layout_of(cache, args.world)
    cluster.register_kv(cache.tensor, layout)
    for stream in (SHARD_STREAM, SHARD_STREAM + 1):
        cluster.fabric.set_layout(stream, layout.descriptor())
    cluster.register_weights(rank.buffer)
    cluster.fabric.set_layout(Stream.PARAMS, "weights:" + json.dumps(rank.layout.signature()))
    results = join_store(host, port, args.world, args.timeout)
    readiness = ReportingReadiness(rank.model.config.num_layers, results, args.rank)
    params = ParamStore(rank.layout, rank.buffer, readiness, Path(args.model).resolve().parent)
    weights = WeightEndpoint(params, WeightMover(cluster.fabric, params, WEIGHT_BUFFER), results,
                             args.world, args.rank)
    return Endpoint(ShardEndpoint(cluster, results, args.rank), weights)


def main(argv: list[str] | None = None) -> None:
    """Join, load, serve."""
    args = _parser().parse_args(argv)
    # a terminal's Ctrl-C reaches every process of its group: the leader stops its workers itself
    # (STOP, or its store closing), so a worker leaving first would read as a broken group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"tp rank {args.rank}: %(message)s")
    share_cpu_threads(args.world)
    device = rank_device(torch.device(args.device), args.rank)
    host, _, port = args.store.rpartition(":")
    store = join_store(host, int(port), args.world, args.timeout)
    group = TpGroup(Shard(args.rank, args.world), store, device, args.timeout)
    spec = RankSpec(args.model, TORCH_DTYPES[args.dtype], args.num_blocks, args.block_size,
                    args.attention_backend, args.inactive)
    rank = build_rank(spec, group, device)
    runner = ModelRunner(rank.model, rank.cache, spec.attention_backend)  # type: ignore[arg-type]
    try:
        endpoint = _endpoint(args, rank, host, int(port))
    except (FabricUnavailable, ValueError) as exc:  # one line; rank 0 sees this rank end (leader.watch)
        log.error("rank %d cannot open its fabric endpoint (--fabric %s): %s", args.rank, args.fabric, exc)
        raise SystemExit(1) from None
    log.info("joined as rank %d of %d on %s", args.rank, args.world, device)
    try:
        serve_worker(group, runner, endpoint)
    finally:
        if endpoint is not None:
            endpoint.kv.close()
        group.close()


if __name__ == "__main__":
    main()
