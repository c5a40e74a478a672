"""How long the fuzz tests run: a few examples in the suite, many with `make fuzz`.

    PDCLUSTER_FUZZ_EXAMPLES=N   examples per operation / RPC (default: the suite's short run)
    PDCLUSTER_FUZZ_SEED=S       fixed seed (default: random; failures print theirs)
"""

from __future__ import annotations

import os


def fuzz_examples(short: int) -> int:
    """Examples per operation: `short` unless PDCLUSTER_FUZZ_EXAMPLES says otherwise."""
    return int(os.environ.get("PDCLUSTER_FUZZ_EXAMPLES", short))


def fuzz_seed() -> int | None:
    """The fixed seed, if one is set."""
    seed = os.environ.get("PDCLUSTER_FUZZ_SEED")
    return int(seed) if seed else None
