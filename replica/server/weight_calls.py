"""The weight and layer-level prefill calls of a replica (the core's table sends them here).

```
 LoadParams ─────────────► ParamOps.run_blocking ─► ParamStore.load_from_disk / load_from_host
 SendParams / RecvParams ─► ParamOps.start_background ─► WeightMover.send_to / recv_from ─┐
   (host_copy_model: send_host_copy, the sender's host-memory copy instead of its buffer)  │
 Broadcast RDMA ──────────► ParamOps.start_background ─► WeightMover.chain ───────────────┤ WaitRdmaDone
 Broadcast NVL / TANZ ────► ParamOps.run_blocking ─► WeightMover.chain / tanz              joins
 ResetStatus / SetStatusReady ─► readiness (refused while an operation holds the guard)
 ZagPrefill / Relay ─► ZigzagManager;  PipelinedPrefill (NAIVE_PP|IMMIGRATE) ─► naive_pp_prefill
```

Decisions worth knowing: WaitRdmaDone with no background operation started is FAILED_PRECONDITION
(out of order, not malformed); SetStatusReady without `--allow-set-status-ready` is PERMISSION_DENIED
(an admin backdoor that is switched off); background transfers get `--transfer-timeout`, blocking
ones the smaller of that and the call's deadline. A blocking broadcast whose caller gives up aborts
its transfers, so the guard is free again at once (`WeightMover` takes the cancellation).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replica.cluster import WEIGHT_BUFFER, kv_layout_of
from replica.engine.engine import Engine
from replica.engine.types import HealthState, StepResult
from replica.engine.validation import admit_batch
from replica.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from replica.params.operations import ParamOps
from replica.params.store import ParamStore
from replica.params.transfer import WeightMover, chain_of
from replica.server.calls import CallContext
from replica.server.messages import (
    Broadcast,
    BroadcastKind,
    LoadCase,
    LoadParams,
    PipelinedPrefill,
    PipeStart,
    PrefillCase,
    RecvParams,
    Relay,
    SendParams,
    ZagPrefill,
)
from replica.server.shared import ServerState
from replica.tp.weights import GroupWeights, WeightJob, WeightOp, rank_lists, tp_chain
from replica.zigzag.activation import ActivationLink
from replica.zigzag.manager import ZigzagManager
from replica.zigzag.naive_pp import naive_pp_prefill
from replica.zigzag.outcome import Relayed, ZagOutcome
from transfer.core import Deadline, Stream

_LOAD_WAIT_S = 3600.0  # how long a --tp N LoadParams without a call deadline waits for the other ranks


@dataclass
class WeightState:
    """What the weight calls work with, created once the engine and the fabric exist."""

    params: ParamStore
    ops: ParamOps
    zigzag: ZigzagManager
    mover: WeightMover | None  # None without a fabric
    link: ActivationLink | None


class WeightCalls:
    """LoadParams, Send/RecvParams, WaitRdmaDone, broadcasts, Reset/SetStatus*, ZagPrefill, Relay."""

    def __init__(self, shared: ServerState) -> None:
        self.shared = shared
        self.state: WeightState | None = None  # set by `attach` once the engine and fabric exist

    def attach(self, engine: Engine, params: ParamStore) -> None:
        """Wire the parameter store, the guard, the movers and the zigzag queue (after the fabric)."""
        cluster, config = self.shared.cluster, self.shared.config
        mover = link = None
        switch = params.relayout
        if switch is not None:  # on the engine thread (no step runs meanwhile), then the fabric told
            params.relayout = functools.partial(self._switch, switch, engine, params)
        if cluster is not None:
            cluster.fabric.set_layout(Stream.PARAMS, "weights:" + json.dumps(params.layout.signature()))
            mover = WeightMover(cluster.fabric, params, WEIGHT_BUFFER)
            link = ActivationLink(cluster.fabric, config.transfer_timeout)
        zigzag = ZigzagManager(engine, self.shared.worker, link)
        self.state = WeightState(params, ParamOps(), zigzag, mover, link)

    def _switch(self, switch: Callable[[Path], None], engine: Engine, params: ParamStore, path: Path) -> None:
        """Lay the replica out for `path`'s model (`replica/engine/switch.py`) on the engine thread,
        then announce the new KV cache and weight layout on the fabric's handshakes."""
        self.shared.worker.call(functools.partial(switch, path), self.shared.config.transfer_timeout)
        cluster = self.shared.cluster
        if cluster is not None:
            cache = engine.runner.cache
            cluster.register_kv(cache.tensor, kv_layout_of(cache, self.tp))
            cluster.fabric.set_layout(Stream.PARAMS, "weights:" + json.dumps(params.layout.signature()))

    def _state(self) -> WeightState:
        if self.state is None:
            raise FailedPrecondition("the replica is still starting")
        return self.state

    def _mover(self) -> WeightMover:
        mover = self._state().mover
        if mover is None:
            raise FailedPrecondition("no transfer fabric (start the replica with --cluster)")
        cluster = self.shared.cluster
        if cluster is not None:
            cluster.require_movable(WEIGHT_BUFFER)
        return mover

    def _transfer_deadline(self, ctx: CallContext | None = None) -> Deadline:
        seconds = self.shared.config.transfer_timeout
        call = ctx.remaining() if ctx is not None else None
        return Deadline.after(seconds if call is None else min(seconds, call))

    def health(self) -> HealthState:
        """serving (all loaded), inactive (nothing loaded) or loading (in between)."""
        if self.state is None:
            return HealthState.LOADING
        ready = self.state.params.readiness.snapshot()
        if ready.complete:
            return HealthState.SERVING
        return HealthState.INACTIVE if ready.empty else HealthState.LOADING

    @property
    def tp(self) -> int:
        """The replica's tensor-parallel size."""
        return self.shared.config.tp

    def _per_rank(self, op: WeightOp, own: Callable[[], None], deadline: Deadline, fills: bool,
                  sources: Sequence[int] = (), dests: Sequence[int] = (), path: str = "",
                  prepare: Callable[[], None] = lambda: None) -> Callable[[], None]:
        """`prepare` (rank 0's checks), then `own` (rank 0's part) at tp 1; under --tp N the
        operation on every rank (`replica/tp/weights.py`), published once `prepare` passed."""
        if self.tp == 1:
            return _then(prepare, own)
        engine = self.shared.engine
        group: GroupWeights | None = getattr(engine.runner, "group_weights", None) if engine else None
        if group is None:
            raise FailedPrecondition(f"weight operations of a --tp {self.tp} replica need every rank of its "
                                     "group in the rank table (--cluster; its entries' tp_group this rank)")
        job = WeightJob.of(op, deadline, sources, dests, path)
        return _then(prepare, lambda: group.run(job, own, fills))

    # ------------------------------------------------------------------------------ loading
    def load_params(self, call: LoadParams, ctx: CallContext) -> None:
        """LoadParams from disk (under the model root) or from the host-memory copy."""
        state = self._state()
        if call.case == LoadCase.DISK:
            path = state.params.resolve(call.model_name, call.model_path or None)
            remaining = ctx.remaining()  # a load is no transfer: the call's deadline, else a long one
            deadline = Deadline.after(_LOAD_WAIT_S if remaining is None else remaining)
            name = Path(call.model_path).name if call.model_path else call.model_name
            load = functools.partial(state.params.load_from_disk, path, name)
            run = self._per_rank(WeightOp.LOAD_DISK, load, deadline, True, path=str(path))
            state.ops.run_blocking("LoadParams(disk)", run)
        elif call.case == LoadCase.HOST_MEM and self.tp > 1:
            raise FailedPrecondition(f"LOAD_FROM_HOST_MEM: a --tp {self.tp} replica keeps no host-memory "
                                     "copies (load from disk)")
        elif call.case == LoadCase.HOST_MEM:
            state.ops.run_blocking("LoadParams(host)", lambda: state.params.load_from_host(call.model_name))
        else:
            raise InvalidArgument(f"unknown load_case {call.case}")

    # --------------------------------------------------------------------- p2p and multicast
    def send_params(self, call: SendParams, ctx: CallContext) -> None:
        """SendParams: p2p to `dst` in the background (of a host-memory copy: `_send_host_copy`)."""
        if call.host_copy_model:
            self._send_host_copy(call)
            return
        mover, deadline, share = self._mover(), self._transfer_deadline(), self._share(call)
        run = self._per_rank(WeightOp.SEND, lambda: mover.send_to(call.dst, deadline, share=share), deadline,
                             False, dests=[call.dst])
        prepare = functools.partial(mover.prepare_send, call.dst, call.model_name)
        self._state().ops.start_background("SendParams", prepare, run)

    def _send_host_copy(self, call: SendParams) -> None:
        """SendParams of the host copy of `host_copy_model` (another node's cold start reads this
        node's host memory over the network, BlitzScale's pool); NOT_FOUND when none is held."""
        if self.tp > 1:
            raise FailedPrecondition(f"SendParams of a host copy: a --tp {self.tp} replica keeps no "
                                     "host-memory copies")
        mover, deadline, model = self._mover(), self._transfer_deadline(), call.host_copy_model
        share = self._share(call)
        self._state().ops.start_background(
            "SendParams(host copy)", functools.partial(mover.prepare_send_host, call.dst, model),
            lambda: mover.send_host_copy(call.dst, model, deadline, share=share))

    def _share(self, call: SendParams) -> tuple[int, int]:
        """The call's share of the regions, checked now (INVALID_ARGUMENT; FAILED_PRECONDITION under
        --tp N, whose ranks send whole shards)."""
        if not call.shares and not call.share:
            return 0, 0
        if self.tp > 1:
            raise FailedPrecondition(f"a share of the weights: a --tp {self.tp} replica sends whole shards")
        self._mover().share(call.share, call.shares)  # INVALID_ARGUMENT for a share out of range
        return call.share, call.shares

    def recv_params(self, call: RecvParams, ctx: CallContext) -> None:
        """RecvParams: p2p from `src` in the background (from several sources at once: each its share)."""
        mover, deadline = self._mover(), self._transfer_deadline()
        if call.more_srcs:
            if self.tp > 1:
                raise FailedPrecondition(f"RecvParams from several sources: a --tp {self.tp} replica "
                                         "receives whole shards")
            peers = [call.src, *call.more_srcs]
            mover.share(len(peers) - 1, len(peers))  # INVALID_ARGUMENT: more sources than regions

            def prepare() -> None:
                if len(set(peers)) != len(peers):
                    raise InvalidArgument(f"RecvParams sources {peers} name a rank twice")
                for peer in peers:
                    mover.prepare_recv(peer, call.model_name)

            self._state().ops.start_background("RecvParams", prepare,
                                               lambda: mover.recv_from_many(peers, deadline))
            return
        run = self._per_rank(WeightOp.RECV, lambda: mover.recv_from(call.src, deadline), deadline, True,
                             sources=[call.src])
        prepare = functools.partial(mover.prepare_recv, call.src, call.model_name)
        self._state().ops.start_background("RecvParams", prepare, run)

    def broadcast(self, call: Broadcast, ctx: CallContext) -> None:
        """RdmaBroadcast (background chain), NvlBroadcast (blocking chain), TanzBroadcast (blocking)."""
        mover, sources, dests = self._mover(), list(call.src_ranks), list(call.dst_ranks)
        ops, op = self._state().ops, WeightOp.TANZ if call.kind is BroadcastKind.TANZ else WeightOp.CHAIN
        if call.kind is BroadcastKind.RDMA:
            chain, deadline = self._chain(sources, dests), self._transfer_deadline()
            run = self._per_rank(op, lambda: mover.chain(chain, deadline), deadline, mover.rank != chain[0],
                                 sources, dests)
            ops.start_background(call.kind.value, lambda: mover.prepare_chain(chain, call.model_name), run)
            return
        deadline, cancelled = self._transfer_deadline(ctx), ctx.cancellation
        if call.kind is BroadcastKind.NVL:
            chain = self._chain(sources, dests)
            prepare = functools.partial(mover.prepare_chain, chain, call.model_name)
            own = functools.partial(mover.chain, chain, deadline, cancelled)
            fills = mover.rank != chain[0]
        else:
            src, dst = (sources, dests) if self.tp == 1 else rank_lists(sources, dests, self.tp, 0)
            prepare = functools.partial(mover.prepare_tanz, src, dst, call.model_name)
            own, fills = functools.partial(mover.tanz, src, dst, deadline, cancelled), mover.rank not in src
        run = self._per_rank(op, own, deadline, fills, sources, dests, prepare=prepare)
        ops.run_blocking(call.kind.value, run)

    def _chain(self, sources: Sequence[int], dests: Sequence[int]) -> list[int]:
        """This rank's chain: the seeds' `[src[t]] + dst[t::tp]` for tp_rank 0 of a --tp N group."""
        return chain_of(sources, dests) if self.tp == 1 else tp_chain(sources, dests, self.tp, 0)

    def wait_rdma_done(self, ctx: CallContext) -> None:
        """WaitRdmaDone: join the background operation, raise its error."""
        self._state().ops.wait(ctx.remaining())

    # --------------------------------------------------------------------------- status
    def reset_status(self) -> None:
        """ResetStatus: weights unloaded (a complete buffer is kept in host memory)."""
        state = self._state()
        state.ops.run_blocking("ResetStatus", state.params.unload)
        state.zigzag.reset()

    def set_status_ready(self) -> None:
        """SetStatusReady: every region loaded (only with --allow-set-status-ready)."""
        if not self.shared.config.allow_set_status_ready:
            raise PermissionDenied(
                "SetStatusReady is disabled (start the replica with --allow-set-status-ready)"
            )
        state = self._state()
        state.ops.run_blocking("SetStatusReady", state.params.readiness.mark_all)

    # ------------------------------------------------------------------ layer-level prefill
    def zag_prefill(self, call: ZagPrefill, ctx: CallContext) -> ZagOutcome:
        """ZagPrefill: queue in `seq` order, advance layer by layer; returns finished or relayed."""
        if not call.forward_case & PrefillCase.NAIVE_PP:
            raise InvalidArgument(f"ZagPrefill needs forward_case NAIVE_PP, got {call.forward_case}")
        zigzag = self._state().zigzag
        future = zigzag.submit(call.batch, call.seq, ctx.remaining())
        return zigzag.wait(future, ctx.remaining())

    def relay(self, call: Relay, ctx: CallContext) -> Relayed | None:
        """Relay: hand one queued layer-level prefill to replica `rank` (None: nothing to relay)."""
        return self._state().zigzag.relay(call.rank, call.relax_not_head, ctx.remaining())

    def pipelined_prefill(self, call: PipelinedPrefill, ctx: CallContext) -> StepResult:
        """PrefillV2 NAIVE_PP|IMMIGRATE: finish a relayed batch from layer k (`replica.zigzag.naive_pp`)."""
        if call.forward_case != PrefillCase.NAIVE_PP | PrefillCase.IMMIGRATE:
            raise InvalidArgument(
                f"PrefillV2 forward_case {call.forward_case}: NAIVE_PP and IMMIGRATE go together (12)"
            )
        engine = self.shared.engine
        if engine is None:
            raise FailedPrecondition("the model is still loading")
        start, hidden = self._incoming_activation(engine, call, ctx)
        timeout = ctx.remaining()
        return self.shared.worker.call(
            lambda: naive_pp_prefill(engine, call.batch, start, hidden, timeout), timeout
        )

    def _incoming_activation(
        self, engine: Engine, call: PipelinedPrefill, ctx: CallContext
    ) -> tuple[int, Any]:
        """(first layer to run, received activation or None to embed here) from the call's start."""
        num_layers = engine.runner.num_layers
        if call.start is None or call.start is PipeStart.EMBEDDING:
            return 0, None
        start = num_layers if call.start is PipeStart.HEAD else call.start_layer
        if not 0 <= start <= num_layers:
            raise InvalidArgument(f"pp_info.tfm_layer {start} outside 0..{num_layers}")
        if len(call.pipe_peer) != 1:
            raise InvalidArgument(f"pipe_peer must name one rank per TP rank (1), got {list(call.pipe_peer)}")
        link = self._state().link
        if link is None:
            raise FailedPrecondition("no transfer fabric to receive the activation on (use --cluster)")
        tokenize = engine.detok.encode if engine.detok.available else None
        # the activation's rows
        tokens = sum(len(p) for p in admit_batch(call.batch, engine.limits, tokenize))
        remaining = ctx.remaining()
        timeout = math.inf if remaining is None else remaining  # the link caps it at --transfer-timeout
        return start, link.receive(call.pipe_peer[0], engine.runner.empty_activation(tokens), timeout)


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """`first`, then `second`."""

    def both() -> None:
        first()
        second()

    return both
