"""When the autoscaler plans at once, between its rounds (pure: a snapshot in, a reason out).

```
 an arrival (Scheduler.submit) ─► Autoscaler.poke ─► urgency(snapshot, bounds)
     None                       ─► nothing; the next round comes at its interval
     "predicted TTFT …" / "…"   ─► a round now, the reason in its timeline record
```
A round every `--plan-interval` plus averaged arrivals reacts to a step in load seconds late. The
prefill side is urgent as soon as the snapshot says the prefill replicas (counting those already
loading) are too few for what is queued or arriving:
- *predicted TTFT*: a prompt arriving now waits for the queued prompt work spread over the prefill
  replicas, `waiting prefill tokens / (n · measured prefill tokens/s)`; urgent above the TTFT SLO
  (`ttft_slo`), or above the planner's upper bound `prefill_upper` when no SLO is given;
- *arrival surge*: prompts wait and the prompt tokens arriving over the short surge window outrun
  the prefill replicas' whole measured speed (a queue grows; the 5 s average's `prefill_busy_upper` is for
  steady loads, where a short window's Poisson clumps would pass it too often).
Both are exactly the terms that make `planner.plan` scale prefill up, so an urgent round is never a
no-op, and a scale-up in flight (its replicas count as prefill) quiets the trigger.
"""

from __future__ import annotations

import math

from router.scaling.planner import Bounds, Snapshot
from router.states import PREFILL_LIKE


def predicted_ttft(s: Snapshot) -> float:
    """Seconds a prompt arriving now waits for the queued prompt work (0 when nothing is measured)."""
    n = s.count(PREFILL_LIKE)
    if s.prefill_tokens_per_s <= 0:
        return 0.0
    if n == 0:
        return math.inf if s.waiting_prefill_tokens else 0.0
    return s.waiting_prefill_tokens / (n * s.prefill_tokens_per_s)


def urgency(s: Snapshot, b: Bounds) -> str | None:
    """Why prefill must be planned now, or None when the next round may wait."""
    n = s.count(PREFILL_LIKE)
    if s.prefill_tokens_per_s <= 0 or n >= b.max_prefill:
        return None
    limit = b.ttft_slo if b.ttft_slo > 0 else b.prefill_upper
    ttft = predicted_ttft(s)
    if ttft > limit:
        name = "TTFT SLO" if b.ttft_slo > 0 else "prefill upper bound"
        return f"predicted TTFT {ttft:.3f} s > {name} {limit:g} s ({n} prefill)"
    if s.waiting_prefill_tokens and s.surge_tokens_per_s > n * s.prefill_tokens_per_s:
        speed = s.prefill_tokens_per_s
        return f"arrival surge {s.surge_tokens_per_s:.0f} tokens/s > {n} prefill x {speed:.0f}"
    return None
