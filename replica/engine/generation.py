"""Turning chosen tokens into request progress and `Generation` messages.

Every token a request receives (sampled here, or appended by DecodeV2 from the replica that ran
its prefill) goes through `accept`: appended to `tokens`, detokenized incrementally, checked
against the stopping criteria.
"""

from __future__ import annotations

from collections.abc import Sequence

from replica.engine.batch import RequestState
from replica.engine.detokenizer import Detokenizer
from replica.engine.types import Choice, FinishReason, GeneratedText, Generation, TokenList
from replica.errors import FailedPrecondition


def accept(request: RequestState, token_id: int, detok: Detokenizer) -> str:
    """Append one generated token to the request; returns its text and sets `finish` if it stops."""
    request.tokens.append(token_id)
    text = detok.next_text(request.tokens, request.detok)
    request.finish = request.stop.step(token_id, text)
    grammar = request.grammar
    if grammar is not None:
        if not grammar.accept(token_id):  # the mask allows only what it accepts: a bug, said loudly
            raise FailedPrecondition(f"request {request.id}: token {token_id} does not match its grammar")
        if grammar.terminated and request.finish is None:  # EOS accepted under ignore_eos
            request.finish = FinishReason.EOS_TOKEN
    return text


def final_text(request: RequestState, detok: Detokenizer) -> GeneratedText | None:
    """The GeneratedText of a finished request (None while it runs)."""
    if request.finish is None:
        return None
    generated = request.tokens[request.prompt_len :]
    sampling = request.spec.sampling
    return GeneratedText(
        text=detok.decode(generated, skip_special_tokens=True),
        generated_tokens=len(generated),
        finish_reason=request.finish,
        seed=sampling.seed if sampling.do_sample else None,
    )


def _tokens(
    ids: tuple[int, ...], logprobs: tuple[float, ...], texts: tuple[str, ...], detok: Detokenizer
) -> TokenList:
    special = tuple([detok.is_special(i) for i in ids])
    return TokenList(ids=ids, logprobs=logprobs, texts=texts, is_special=special)


def step_generation(
    request: RequestState, choice: Choice, detok: Detokenizer, prefill: TokenList | None = None
) -> Generation:
    """Accept the chosen token and describe it."""
    text = accept(request, choice.token_id, detok)
    top: tuple[TokenList, ...] = ()
    if choice.top_ids:
        texts = tuple(detok.texts_of(choice.top_ids))
        top = (_tokens(choice.top_ids, choice.top_logprobs, texts, detok),)
    token = choice.token_id
    return Generation(
        request_id=request.spec.id,
        tokens=TokenList((token,), (choice.logprob,), (text,), (detok.is_special(token),)),
        prefill_tokens=prefill,
        generated_text=None if request.finish is None else final_text(request, detok),
        top_tokens=top,
    )


def appended_generation(request: RequestState, token_id: int, detok: Detokenizer) -> Generation | None:
    """Accept a token generated elsewhere; a Generation (no tokens) only if it finished the request."""
    accept(request, token_id, detok)
    if request.finish is None:
        return None
    return Generation(request_id=request.id, tokens=TokenList(), generated_text=final_text(request, detok))


def prefill_tokens(prompt: list[int], logprobs: Sequence[float], detok: Detokenizer) -> TokenList:
    """Prompt tokens with the log-probability of each (NaN for the first: nothing comes before it)."""
    return _tokens(tuple(prompt), tuple(logprobs), tuple(detok.texts_of(prompt)), detok)
