"""`TpRunner` (rank 0) and `serve_worker` (ranks > 0): one step on every rank of the group.

```
 engine ─► TpRunner.forward(seqs) ─ publish Command(FORWARD, seqs) ─► workers: receive, forward
                 │ its own forward                                          │ their forwards
                 └──────────── all-reduces / all-gather (deadline: the group's timeout) ──┘
```
Only whole forwards are broadcast: the layer-by-layer entry points (zig-zag scaling) are refused
under tensor parallelism (a migrating prefill runs whole forwards instead), as is resizing the cache
(the page count is fixed when the group starts, the same on every rank). A migration's or weight
operation's job (MOVE_KV, WEIGHTS) goes to the worker's `Endpoint`, which runs it on a thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from replica.engine.backend import SeqInput
from replica.engine.runner import ForwardOutput, ModelRunner
from replica.errors import FailedPrecondition, ReplicaError
from replica.model.attention import PagedKVCache
from replica.tp.group import Command, Op, TpGroup, TpGroupFailed
from replica.tp.kvmove import ShardEndpoint, ShardMover
from replica.tp.sharded import TpCausalLM
from replica.tp.weights import GroupWeights, WeightEndpoint

log = logging.getLogger(__name__)


class TpRunner(ModelRunner):
    """The leader's runner: each forward is published to the workers, then run here too."""

    def __init__(self, model: TpCausalLM, cache: PagedKVCache, attention_backend: str,
                 group: TpGroup) -> None:
        super().__init__(model, cache, attention_backend)  # type: ignore[arg-type]
        self.group = group
        self.tp_size = group.shard.world
        # set by the leader when every rank has a fabric endpoint (per-rank KV migration, kvmove.py)
        self.shard_mover: ShardMover | None = None
        self.group_weights: GroupWeights | None = None  # likewise: per-rank weight operations

    def forward(self, seqs: Sequence[SeqInput]) -> ForwardOutput:
        """Every rank runs the same forward; a dead or late rank fails it with `TpGroupFailed`."""
        check_group(self)
        plain = [SeqInput(list(s.tokens), list(s.pages), s.start, s.all_logits) for s in seqs]
        try:
            self.group.commands.publish(Command(Op.FORWARD, plain))
            return super().forward(seqs)
        except ReplicaError:  # refused inputs: every rank refuses them before its first collective
            raise
        except RuntimeError as error:  # a collective's error or timeout (DistError), a lost store
            cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            self.group.fail(cause)
            raise TpGroupFailed(f"a rank of the tensor-parallel group failed during a step ({cause})") \
                from error

    def embed(self, seqs: Sequence[SeqInput]) -> Any:
        """Layer-by-layer forwards are not broadcast to the workers."""
        raise FailedPrecondition("layer-by-layer forwards (zig-zag scaling) are not supported with --tp > 1")

    def capture_graphs(self, max_batch: int) -> int:
        """None: a replayed graph would run rank 0's forward without telling the workers."""
        return 0

    def resized(self, fraction: float) -> ModelRunner | None:
        """The page count stays: every rank's cache was sized when the group started."""
        return None


def check_group(runner: object) -> None:
    """Raise `TpGroupFailed` if `runner` is a `TpRunner` whose group has failed (Health asks)."""
    if isinstance(runner, TpRunner) and runner.group.failed:
        raise TpGroupFailed(f"tensor-parallel group is broken: {runner.group.failed}")


@dataclass(frozen=True)
class Endpoint:
    """A worker's fabric endpoint: its KV shard's and its weights' side of rank 0's jobs."""

    kv: ShardEndpoint
    weights: WeightEndpoint


def _dispatch(command: Command, endpoint: Endpoint | None) -> None:
    """A job of rank 0 to this rank's endpoint (it runs on a thread of its own)."""
    if endpoint is None:  # the leader publishes jobs only when every rank has an endpoint
        log.error("a %s job came to a rank without a fabric endpoint", command.op.value)
    elif command.op is Op.MOVE_KV:
        endpoint.kv.run(command.arg)
    else:
        endpoint.weights.run(command.arg)


def serve_worker(group: TpGroup, runner: ModelRunner, endpoint: Endpoint | None = None) -> None:
    """A worker's loop: run each forward the leader publishes until STOP or the leader is gone; a
    migration's shard job goes to `endpoint` (on a thread of its own: steps go on meanwhile)."""
    while True:
        try:
            command = group.commands.receive()
        except RuntimeError:  # the store (hosted by the leader) is gone: the replica has stopped
            return
        if command.op is Op.STOP:
            return
        if command.op in (Op.MOVE_KV, Op.WEIGHTS):
            _dispatch(command, endpoint)
            continue
        try:
            runner.forward(command.arg)
        except ReplicaError as error:  # the leader refused the same inputs before any collective
            log.info("step refused on every rank: %s", error)
