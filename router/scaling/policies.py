"""Scaling policies, registered by name (`--scaling NAME`, admin `SetScalingPolicy`).

| policy           | planner | how new replicas get weights                         | serve before complete |
|------------------|---------|------------------------------------------------------|-----------------------|
| `static`         | off     | never (operators may still call ActivateReplica)     | —                     |
| `multicast`      | on      | Tanz, chain, p2p from replicas that hold weights;   | no                    |
|                  |         | a model at zero: its host copy, else a peer's host    |                       |
|                  |         | copy over the network; LoadParams from the model root |                       |
|                  |         | when none does                                        |                       |
| `live`           | on      | as `multicast`                                       | yes (zigzag prefill)  |
| `stop-the-world` | on      | LoadParams from the model root (disk)                | no                    |
| `host-cache`     | on      | LoadParams from the node's host-memory copy          | no                    |

`stop-the-world` is what most serving systems do; `host-cache` is ServerlessLLM's approach (each node
keeps the checkpoint in host memory: replicas started with `--host-cache`). Every policy that plans
also drains, keeps idle replicas for the keep-alive and resets them after it, revives draining
replicas and re-activates idle ones; `multicast` and `live` also mutate prefill replicas into decode
replicas when the plan is prefill down and decode up.

A new policy is one `register(Policy(...))` call; its capabilities are what `actions.choose` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.scaling.actions import Capabilities
from router.weights import Method


@dataclass(frozen=True)
class Policy:
    """A named scaling policy: whether the planner runs, and what its executor may do."""

    name: str
    plans: bool
    caps: Capabilities
    summary: str


_REGISTRY: dict[str, Policy] = {}
# HOST_PEER: a model woken from zero by another node's host copy over the network (`models.wake_action`)
MULTICAST_METHODS = (Method.TANZ, Method.CHAIN, Method.P2P, Method.HOST_PEER, Method.LOAD_DISK)


def register(policy: Policy) -> Policy:
    """Add a policy (a name registered twice is a programming error)."""
    if policy.name in _REGISTRY:
        raise ValueError(f"scaling policy {policy.name!r} is already registered")
    _REGISTRY[policy.name] = policy
    return policy


def get(name: str) -> Policy:
    """The policy called `name` (ValueError naming the known ones otherwise)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown scaling policy {name!r}; choose from {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    """Registered policy names, in registration order."""
    return tuple(_REGISTRY)


STATIC = register(Policy("static", False, Capabilities(()), "no autoscaling (operators scale by hand)"))
MULTICAST = register(Policy("multicast", True, Capabilities(MULTICAST_METHODS),
                            "weights multicast from loaded replicas; new replicas serve when complete"))
LIVE = register(Policy("live", True, Capabilities(MULTICAST_METHODS, live=True),
                       "multicast, and new prefill replicas serve layer by layer while loading"))
STOP_THE_WORLD = register(Policy("stop-the-world", True, Capabilities((Method.LOAD_DISK,), mutate=False),
                                 "new replicas load from the model root and serve when complete"))
HOST_CACHE = register(Policy("host-cache", True, Capabilities((Method.LOAD_HOST,), mutate=False),
                             "new replicas load from their node's host-memory copy (ServerlessLLM)"))
