"""Choosing the next token: logit bias, penalties, warpers, greedy or seeded sampling, log-probabilities.

Semantics follow Hugging Face transformers' logits processors so results can be compared with
`generate`: a structured-output request's grammar mask first (`grammar.masked`: refused tokens at
-inf, so no later stage can bring them back), then OpenAI's logit_bias (added to the raw logits, as
vLLM does), then repetition penalty (CTRL: divide positive / multiply negative logits of every token
seen in prompt + output), then, only when sampling, temperature → top-k → top-p → typical-p, each
filtering with -inf and keeping at least one token. Frequency / presence penalties are OpenAI's:
`logit -= count_in_output * frequency + (count_in_output > 0) * presence`, applied with the other
penalties (so in greedy mode too). Greedy is the argmax of the penalised logits; log-probabilities
are the log-softmax of the final processed logits.

Reproducibility: on the CPU a sampling step draws from a generator seeded by (request seed, tokens
generated so far), so a request samples the same tokens whatever batch it shares and whichever replica
runs it. On any other device `choose_next` hands the batch to `device_sampling.choose_batched` (the
same processing, batched; seeded draws by an exponential race over a counter hash of the same step
seed): reproducible there too, but not the CPU's tokens for the same seed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from replica.engine.banned import without_banned
from replica.engine.batched_processors import typical_rows
from replica.engine.device_sampling import choose_batched
from replica.engine.finite import saturate
from replica.engine.grammar import masked
from replica.engine.seeding import step_seed
from replica.engine.types import Choice, RowInput, SamplingParams


def repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL repetition penalty on `scores` (..., vocab) for the token ids in `seen` (..., n)."""
    picked = scores.gather(-1, seen)
    penalised = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores.scatter(-1, seen, saturate(penalised, picked))  # overflow saturates (finite.py)


def frequency_presence_penalty(
    scores: torch.Tensor, output: torch.Tensor, frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI penalties on a (vocab,) row from the generated token ids `output` (n,)."""
    counts = torch.bincount(output, minlength=scores.shape[-1]).to(scores.dtype)
    penalised = scores - counts * frequency - (counts > 0).to(scores.dtype) * presence
    return saturate(penalised, scores)  # overflow saturates (finite.py)


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest scores of the last dimension; -inf elsewhere."""
    k = min(max(k, 1), scores.shape[-1])
    threshold = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < threshold, float("-inf"))


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: drop the least likely tokens whose total mass is at most 1 - top_p."""
    ascending, order = torch.sort(scores, dim=-1)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = mass_below <= (1.0 - top_p)
    drop_sorted[..., -1:] = False  # the most likely token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def typical_filter(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical filter: keep the tokens closest to the entropy until `mass` is covered."""
    return typical_rows(scores, mass)


def warp(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling warpers in transformers' order: temperature, top-k, top-p, typical-p."""
    if params.temperature != 1.0:
        scores = saturate(scores / params.temperature, scores)
    if params.top_k > 0:
        scores = top_k_filter(scores, params.top_k)
    if params.top_p < 1.0:
        scores = top_p_filter(scores, params.top_p)
    if params.typical_p < 1.0:
        scores = typical_filter(scores, params.typical_p)
    return scores


@functools.lru_cache(maxsize=256)
def _bias_tensors(logit_bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, biases) of a request's logit_bias: the same pairs at every step of the request."""
    biased, bias = zip(*logit_bias, strict=True)
    return torch.tensor(biased), torch.tensor(bias, dtype=torch.float32)


def _penalise(row: torch.Tensor, inp: RowInput) -> torch.Tensor:
    params = inp.params
    if params.logit_bias:
        biased, bias = _bias_tensors(params.logit_bias)
        row = row.index_add(0, biased, bias.to(row.dtype))
    if params.repetition_penalty != 1.0 and inp.tokens:
        seen = torch.tensor(list(inp.tokens), dtype=torch.long)
        row = repetition_penalty(row, seen, params.repetition_penalty)
    output = inp.tokens[inp.prompt_len :]
    if (params.frequency_penalty or params.presence_penalty) and output:
        ids = torch.tensor(list(output), dtype=torch.long)
        row = frequency_presence_penalty(row, ids, params.frequency_penalty, params.presence_penalty)
    return row


def _choose_row(row: torch.Tensor, inp: RowInput) -> tuple[int, torch.Tensor]:
    """(token, final log-probabilities) for one request that is not plain greedy."""
    row = row.float()  # as the batched path: a bfloat16 penalty of 3e38 would be inf, inf - inf NaN
    row = _penalise(row, inp)
    if not inp.params.do_sample:
        return int(torch.argmax(row)), torch.log_softmax(row, dim=-1)
    row = warp(row, inp.params)
    logprobs = torch.log_softmax(row, dim=-1)
    generator = torch.Generator().manual_seed(step_seed(inp.params.seed, inp.num_generated))
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, logprobs


def choose_next(logits: torch.Tensor, rows: Sequence[RowInput]) -> list[Choice]:
    """One next token per row of `logits` (batch, vocab): float32 on the CPU row by row (the reference),
    on any other device batched (`choose_batched`: one copy each way per step)."""
    if logits.device.type != "cpu":
        return choose_batched(logits, rows)
    logits = without_banned(masked(logits, rows), rows)
    logprobs = torch.log_softmax(logits, dim=-1)
    # = torch.argmax (the first maximum; NaN counts as the maximum), in half the time on the CPU
    tokens = logits.max(dim=-1).indices
    special = [i for i, inp in enumerate(rows) if not inp.params.is_plain_greedy]
    if special:
        logprobs = logprobs.clone()
        tokens = tokens.clone()
        for i in special:
            token, row_logprobs = _choose_row(logits[i], rows[i])
            tokens[i] = token
            logprobs[i] = row_logprobs
    chosen_lp = logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
    ids = tokens.tolist()
    if not any(inp.top_n > 0 for inp in rows):
        return list(map(Choice, ids, chosen_lp))
    choices = []
    for i, inp in enumerate(rows):
        top_ids: tuple[int, ...] = ()
        top_lp: tuple[float, ...] = ()
        if inp.top_n > 0:
            top = torch.topk(logprobs[i], min(inp.top_n, logprobs.shape[-1]))
            top_ids, top_lp = tuple(top.indices.tolist()), tuple(top.values.tolist())
        choices.append(Choice(ids[i], chosen_lp[i], top_ids, top_lp))
    return choices
