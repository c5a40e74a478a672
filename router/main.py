"""`pdcluster router`: the scheduling core, the HTTP front end (uvicorn) and the admin gRPC server.

```
 uvicorn ── create_app(scheduler, tokenizer, info, metrics.render) ──┐
 admin gRPC (router.v1.RouterAdmin + reflection + health) ───────────┼── ClusterScheduler ── replicas
 SIGTERM / Ctrl-C ──► stop HTTP, stop admin, stop loops, close clients┘
```
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import socket
import sys
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import Any

import uvicorn
import uvloop

from router.admin import start_admin_server
from router.client import ReplicaClient, channel_credentials
from router.config import RouterConfig
from router.errors import ReplicaCallError
from router.http import ServingInfo, create_app
from router.http.keys import KeyFileError, KeyTable, load_key_file
from router.metrics import RouterMetrics
from router.replica_api import Connect
from router.replicas import SERVING, State
from router.scheduler import ClusterScheduler
from router.security import warn_if_exposed
from router.serve_models import build_pools, model_config
from router.tokenizer import Tokenizer
from router.types import Scheduler

log = logging.getLogger("pdcluster.router")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV bytes one token occupies over all layers (K and V), from the checkpoint's config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of one replica's weights in `dtype`: the checkpoint's parameter count (from its
    safetensors headers) times the dtype's size (what a scale-up moves per new replica). A folder
    without weight files (simulated replicas serve a model card's config.json) counts the parameters
    its config.json describes."""
    numel = 0
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                numel += math.prod(entry["shape"])
    if not files and (model_dir / "config.json").is_file():
        numel = config_numel(json.loads((model_dir / "config.json").read_text()))
    return numel * _DTYPE_BYTES.get(dtype, 4)


def config_numel(cfg: dict[str, Any]) -> int:
    """Parameters of the Llama-style decoder a config.json describes: embeddings, per layer the
    attention and gated-MLP matrices and two norms, the final norm and the LM head unless tied
    (biases are left out: a fraction of a percent where a model has them)."""
    h, layers, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or h // heads)
    q, kv = heads * head_dim, int(cfg.get("num_key_value_heads") or heads) * head_dim
    layer = 2 * q * h + 2 * kv * h + 3 * h * int(cfg["intermediate_size"]) + 2 * h
    return vocab * h * (1 if cfg.get("tie_word_embeddings") else 2) + layers * layer + h


def serving_info(config: RouterConfig, sched: ClusterScheduler) -> ServingInfo:
    """The front end's limits: the tightest of the serving replicas (the checkpoint's when none)."""
    infos = [h.state.info for h in sched.replicas.values() if h.state.role in SERVING]
    if infos:
        max_total = min(i.max_total_tokens for i in infos)
        max_input = min(min(i.max_input_tokens for i in infos), max_total - 1)
        dtype, device = infos[0].dtype, infos[0].device_type
    else:
        cfg = json.loads((config.model / "config.json").read_text())
        max_total = int(cfg.get("max_position_embeddings", 2048))
        max_input, dtype, device = max_total - 1, "float32", "cpu"
    return ServingInfo(
        model_id=config.served_model_id, max_input_tokens=max(1, max_input), max_total_tokens=max_total,
        default_max_new_tokens=config.max_new_tokens, model_dtype=dtype, model_device_type=device,
        max_batch_total_tokens=config.max_batch_total_tokens,
        ignore_unknown_fields=config.ignore_unknown_fields,
        model_root=str(config.model),
    )


def connector(config: RouterConfig) -> Connect:
    """The gRPC client of a replica address, with the config's deadlines, TLS and cluster token."""
    credentials, token = channel_credentials(config.tls()), config.token()
    return lambda address: ReplicaClient(
        address, config.rpc_timeout, config.transfer_timeout, credentials, token
    )


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` to completion on a uvloop event loop.

    The router is CPU-bound on its event loop (per streamed token: a task wake-up and a socket
    write; per decode step: a gRPC call): uvloop's C loop and transports cut that CPU.
    """
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the router stops everything in order itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def _connect(sched: ClusterScheduler, address: str, role: State, deadline: float) -> None:
    """Add a replica, retrying while it is still starting (until `deadline`, loop time)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            await sched.add_replica(address, role)
            return
        except ReplicaCallError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


async def run_router(config: RouterConfig, stop: asyncio.Event, api_keys: KeyTable | None = None) -> None:
    """Run until `stop` is set; prints one ready line. `api_keys`: read from `config.api_keys` if None."""
    if api_keys is None and config.api_keys is not None:
        api_keys = load_key_file(config.api_keys)
    metrics = RouterMetrics()
    deadline = asyncio.get_running_loop().time() + 30
    if config.models:
        pools, tokenizers = await build_pools(config, metrics, connector(config), deadline,
                                              kv_bytes_per_token, weight_bytes)
        first, *rest = config.model_specs()
        sched, tokenizer = pools.schedulers[first.name], tokenizers[first.name]
        more = [(pools.front(m.name), tokenizers[m.name],
                 serving_info(model_config(config, m, False), pools.schedulers[m.name])) for m in rest]
        front: Scheduler = pools.front(first.name)
        await pools.start()
    else:
        tokenizer = Tokenizer.from_model_dir(config.model)
        sched = ClusterScheduler(config, tokenizer, connector(config), metrics)
        for address, role in zip(config.replica, config.roles(), strict=True):
            await _connect(sched, address, State(role), deadline)
        dtype = next((h.state.info.dtype for h in sched.replicas.values()), "float32")
        sched.kv_bytes_per_token = kv_bytes_per_token(config.model, dtype)
        sched.weight_bytes = weight_bytes(config.model, dtype)
        pools, more, front = None, [], sched
        await sched.start()
    tls = config.tls()
    warn_if_exposed(log, config.host, tls.serves)
    admin, admin_port = await start_admin_server(sched, config.host, config.admin_port, config.admin_token,
                                                 tls, pools)
    sock = _bind(config.host, config.http_port)
    app = create_app(front, tokenizer, serving_info(config, sched), metrics.render, api_keys, more)
    http = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                  **tls.uvicorn_options()))
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    http_port = sock.getsockname()[1]
    scheme = "https" if tls.serves else "http"
    # one write of the whole line (print() writes it and its newline apart under PYTHONUNBUFFERED)
    sys.stdout.write(f"pdcluster router ready: http={scheme}://{config.host}:{http_port} "
                     f"admin={config.host}:{admin_port} "
                     f"strategy={sched.strategy.name} scaling={sched.scaling.policy.name} "
                     f"replicas={len(sched.replicas)}\n")
    sys.stdout.flush()
    try:
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopped, http_task], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
    finally:
        http.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(http_task, 5)
        await admin.stop(1)
        await (pools.stop() if pools is not None else sched.stop())
        sock.close()
        log.info("router stopped")


def serve(config: RouterConfig) -> int:
    """Entry point of `pdcluster router`: run until SIGTERM / Ctrl-C; exit code 0 on a clean stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)

    try:  # a bad key file, TLS file or token file stops the router before it touches any replica
        api_keys = load_key_file(config.api_keys) if config.api_keys is not None else None
        config.tls()
        config.token()
    except (KeyFileError, ValueError, OSError) as exc:
        print(f"pdcluster router: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_router(config, stop, api_keys)

    try:
        run_loop(main())
    except ReplicaCallError as exc:
        print(f"pdcluster router: cannot reach a replica: {exc}", file=sys.stderr)
        return 1
    return 0
