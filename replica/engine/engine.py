"""`Engine`: prefill, decode, filter, clear, warmup over the model, the KV cache and the cached batches.

Not thread-safe by design: only the engine thread (`replica.engine.worker`) calls it. Every method
validates before it changes anything, and a failure after pages were allocated gives them back
before the error leaves, so a refused call never changes `blocks.num_free`. The computing is the
runner's (`backend.Runner`: the torch model, or the simulated GPU); everything else here is shared.

```
 prefill(BatchSpec) ─► admit (validate, allocate pages) ─► forward(prompts) ─► sample ─► cache batch
 decode([DecodeInput]) ─► append last_iter_tokens ─► merge (id = first) ─► forward(new tokens) ─► sample
```
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from replica.engine.backend import Runner, SeqInput
from replica.engine.batch import Batch, BatchStore, RequestState, merge
from replica.engine.chunks import PromptFeeder
from replica.engine.detokenizer import Detokenizer
from replica.engine.generation import appended_generation, prefill_tokens, step_generation
from replica.engine.grammar import Grammars, GrammarState
from replica.engine.stopping import StopChecker
from replica.engine.types import (
    BatchId,
    BatchSpec,
    CachedBatchInfo,
    DecodeInput,
    EngineInfo,
    Generation,
    RequestId,
    RequestSpec,
    Reuse,
    RowInput,
    StepResult,
)
from replica.engine.validation import Limits, admit_batch, check_appended
from replica.errors import FailedPrecondition, InvalidArgument
from replica.kv.block_manager import BlockManager, PageId
from replica.kv.page_hash import page_hash, page_hashes
from replica.params.readiness import ParamReadiness


@dataclass(frozen=True)
class EngineMeta:
    """Static facts reported by Info."""

    model_id: str
    dtype: str
    device_type: str
    device: str = "cpu"  # "cpu", "cuda:0", "simulated:a100-80g", ...
    gpu_name: str = ""  # the CUDA device's name ("" elsewhere)
    attention_backend: str = "torch"  # "torch" (gather + SDPA) or "triton" (the paged kernel)
    cuda_graphs: bool = False  # decode steps replay CUDA graphs once Warmup captured them
    prefix_cache: bool = False  # full pages kept by PageHash and shared by later prompts (kv.block_manager)


@dataclass(frozen=True)
class _StepTimes:
    forward_ns: int
    decode_ns: int


class Engine:
    """The replica's model state machine (see module docstring)."""

    def __init__(
        self,
        runner: Runner,
        detok: Detokenizer,
        limits: Limits,
        meta: EngineMeta,
        readiness: ParamReadiness | None = None,
    ) -> None:
        self.runner = runner
        # which weight regions are in place; a full forward needs all of them (issue 4: live scaling)
        self.readiness = readiness or ParamReadiness(runner.num_layers, loaded=True)
        self.detok = detok
        self.limits = limits
        self.meta = meta
        self.blocks = BlockManager(runner.cache.num_blocks, runner.cache.block_size, meta.prefix_cache)
        self._weights_resets = self.readiness.resets  # the prefix cache holds K/V of these weights
        self.store = BatchStore()
        self.eos_token_ids = frozenset(runner.config.eos_token_ids)
        self.grammars = Grammars(detok.tokenizer, limits.vocab_size, self.eos_token_ids)
        self.feeder = PromptFeeder(lambda inputs: self.runner.forward(inputs), self.register_pages)

    @property
    def block_size(self) -> int:
        """Tokens per KV page."""
        return self.blocks.block_size

    # ----------------------------------------------------------------------------------- prefill
    def admit(self, spec: BatchSpec, reuse: Reuse = Reuse.NONE) -> Batch:
        """Validate a new batch and reserve its pages (prompt + max_new_tokens).

        With `Reuse.PREFILL` (a local prefill), each prompt's longest cached run of full pages is
        shared instead of allocated and counts as already computed (`num_cached`); the last prompt
        token is always computed (its logits choose the first token), and a request asking for
        prompt logprobs shares nothing (every prompt token's logprob needs its forward). A request
        whose full prompt pages match an earlier request's of the same batch further than the cache
        does (n samples of one prompt, a shared system prompt) shares that request's pages too: the
        earlier one (its `shared_upto`) must then be computed that far before the batch's forward,
        which `prefill` does. With `Reuse.WHOLE_PROMPT` (a migration's destination) every cached
        full prompt page is shared (the sender skips them) and nothing within the batch. With
        `Reuse.NONE` (a layer-level prefill writes every page itself) nothing is shared.
        """
        self.store.check_new(spec.id, [r.id for r in spec.requests])
        tokenize = self.detok.encode if self.detok.available else None
        prompts = admit_batch(spec, self.limits, tokenize)
        self._check_weights()
        pairs = list(zip(spec.requests, prompts, strict=True))
        grammars = [self._grammar(r, p) for r, p in pairs]  # before any page: a bad one changes nothing
        block = self.block_size
        shared = [self._cached_prefix(r, p, reuse) for r, p in pairs]
        counts = [
            self.blocks.pages_for(len(p) + r.stopping.max_new_tokens) - len(pages)
            for (r, p), (pages, _h) in zip(pairs, shared, strict=True)
        ]
        leaders = self._in_batch_leaders(shared) if reuse is Reuse.PREFILL else [None] * len(shared)
        for i, lead in enumerate(leaders):
            if lead is not None:
                counts[i] -= lead[1] - len(shared[i][0])
                shared[i] = ([], shared[i][1])
        page_lists = self.blocks.allocate_many(counts, [pages for pages, _h in shared])
        for i, lead in enumerate(leaders):
            if lead is not None:  # the leader's first pages, held once more (its list is final: j < i)
                pages = page_lists[lead[0]][: lead[1]]
                self.blocks.share(pages)
                page_lists[i] = pages + page_lists[i]
                shared[i] = (pages, shared[i][1])
        requests = [
            self._new_request(r, p, pages, g)
            for (r, p), pages, g in zip(pairs, page_lists, grammars, strict=True)
        ]
        for request, (pages, hashes) in zip(requests, shared, strict=True):
            request.num_cached = request.cached_tokens = len(pages) * block
            request.page_hashes = hashes[: len(pages)]
        for lead in leaders:
            if lead is not None:
                leader = requests[lead[0]]
                leader.shared_upto = max(leader.shared_upto, lead[1] * block)
        return Batch(id=spec.id, requests=requests)

    @staticmethod
    def _in_batch_leaders(shared: list[tuple[list[PageId], list[int]]]) -> list[tuple[int, int] | None]:
        """Per request: (earlier request, pages) to share when it matches more full pages than the cache.

        Only a request that follows nobody leads (one wave of computing before the batch's forward).
        Hashes are chained, so a request holding page p's hash holds the whole prefix up to p: the
        owner of the last matching hash leads (linear in the batch's pages).
        """
        owner: dict[int, int] = {}  # hash -> the first leading request holding it
        leaders: list[tuple[int, int] | None] = []
        for i, (cached, hashes) in enumerate(shared):
            common, lead = 0, -1
            while common < len(hashes) and hashes[common] in owner:
                lead = owner[hashes[common]]
                common += 1
            if common > len(cached):
                leaders.append((lead, common))
                continue
            leaders.append(None)
            for digest in hashes:
                owner.setdefault(digest, i)
        return leaders

    def _check_weights(self) -> None:
        """Drop the prefix cache once the weights were unloaded since it was filled (ResetStatus)."""
        resets = self.readiness.resets
        if resets != self._weights_resets:
            self.blocks.drop_cache()
            self._weights_resets = resets

    def _cached_prefix(
        self, spec: RequestSpec, prompt: list[int], reuse: Reuse
    ) -> tuple[list[PageId], list[int]]:
        """(pages, hashes) of the longest cached run of full pages `reuse` allows: before the prompt's
        last token for a prefill (none when it wants prompt logprobs), every one for a migration."""
        if reuse is Reuse.NONE or not self.blocks.prefix_cache:
            return [], []
        if reuse is Reuse.PREFILL and spec.prefill_logprobs:
            return [], []
        covered = prompt if reuse is Reuse.WHOLE_PROMPT else prompt[: len(prompt) - 1]
        hashes = page_hashes(covered, self.block_size)
        return self.blocks.lookup(hashes), hashes

    def register_pages(self, request: RequestState) -> None:
        """Name the request's full pages whose K/V are written (`num_cached` tokens) by their PageHash.

        Called whenever `num_cached` grows (after a forward, or when a migration's K/V arrived); a
        page whose hash another page already keeps stays unnamed and is freed, not cached, later.
        """
        if not self.blocks.prefix_cache:
            return
        block, hashes, tokens = self.block_size, request.page_hashes, request.tokens
        full = min(request.num_cached // block, len(request.pages))
        parent = hashes[-1] if hashes else 0
        for index in range(len(hashes), full):
            parent = page_hash(parent, tokens[index * block : (index + 1) * block])
            self.blocks.register(request.pages[index], parent)
            hashes.append(parent)

    def _grammar(self, spec: RequestSpec, prompt: list[int]) -> GrammarState | None:
        """A constrained request's matcher, advanced over a continuation's earlier tokens."""
        if spec.grammar is None:
            return None
        where = f"request {spec.id}"
        try:
            return self.grammars.state(spec.grammar, prompt[len(prompt) - spec.generated_prefix :])
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {exc}") from None

    def _new_request(
        self, spec: RequestSpec, prompt: list[int], pages: list[PageId], grammar: GrammarState | None
    ) -> RequestState:
        return RequestState(
            spec=spec,
            tokens=list(prompt),
            prompt_len=len(prompt),
            pages=pages,
            stop=StopChecker.resuming(spec.stopping, self.eos_token_ids, self._prefix_text(spec, prompt)),
            detok=self.detok.state_after(prompt),
            grammar=grammar,
        )

    def _prefix_text(self, spec: RequestSpec, prompt: list[int]) -> str:
        """What the earlier runs of a continuation generated, as text (only stop sequences need it)."""
        if not spec.generated_prefix or not spec.stopping.stop_sequences:
            return ""
        start = len(prompt) - spec.generated_prefix
        # decoded after a few prompt tokens of context, as a streaming detokenizer would have printed it
        context = prompt[max(start - 5, 0) : start]
        return self.detok.decode(prompt[max(start - 5, 0) :])[len(self.detok.decode(context)) :]

    def adopt(self, batch: Batch) -> CachedBatchInfo:
        """Cache an admitted batch whose prompt K/V someone else wrote into its pages (a migration).

        Every prompt token counts as cached; the first generated token arrives later through
        DecodeV2's `last_iter_tokens`, exactly as if it had been generated here.
        """
        self.store.check_new(batch.id, [])
        for request in batch:
            request.num_cached = request.prompt_len
            self.register_pages(request)
        self.store.put(batch)
        return batch.info(self.block_size)

    def prefill(self, spec: BatchSpec, chunk_tokens: int = 0) -> StepResult:
        """Forward of a new batch, first tokens sampled, batch cached (unless all finished).

        With `chunk_tokens` the call computes at most that many prompt tokens (one forward): a batch
        whose prompts are not all computed by then is cached as *prefilling* and the answer has no
        generations; `prefill_chunk` continues it.
        """
        start = time.perf_counter_ns()
        self.readiness.require_complete("a NORMAL prefill")
        if chunk_tokens < 0:
            raise InvalidArgument(f"chunk_tokens must be >= 0, got {chunk_tokens}")
        batch = self.admit(spec, Reuse.PREFILL)
        return self._prefill_step(batch, chunk_tokens, start, cached=False)

    def prefill_chunk(self, batch_id: BatchId, chunk_tokens: int) -> StepResult:
        """The next chunk (at most `chunk_tokens` prompt tokens) of a prefilling batch; the first tokens
        once its prompts are computed (the batch is then an ordinary cached batch)."""
        start = time.perf_counter_ns()
        self.readiness.require_complete("a prefill chunk")
        if chunk_tokens <= 0:
            raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
        batch = self.store.get(batch_id)
        if not batch.prefilling:
            raise FailedPrecondition(f"batch {batch_id} is not being prefilled in chunks")
        return self._prefill_step(batch, chunk_tokens, start, cached=True)

    def _prefill_step(self, batch: Batch, chunk_tokens: int, start: int, cached: bool) -> StepResult:
        """Compute (a chunk of) the batch's prompts; sample once they are done. A failure frees it."""
        try:
            chunk_start = time.perf_counter_ns()
            if chunk_tokens > 0:
                done = self.feeder.advance(batch.requests, chunk_tokens)
            else:
                budget = self.limits.prefill_chunk_tokens
                self.feeder.leaders(batch.requests, budget or sum(len(r.tokens) for r in batch.requests))
                self.feeder.chunks(batch.requests, budget)
                done = True
            chunks_ns = time.perf_counter_ns() - chunk_start
            if not done:
                return self._prefilling(batch, cached, chunks_ns, start)
            generations, times = self._step(batch.requests, with_prompt_logprobs=True)
        except BaseException:
            if cached:
                self.store.pop(batch.id)
            self.blocks.free(batch.pages())
            raise
        batch.prefilling = False
        info = self._keep_or_drop(batch, cached=cached)
        total = time.perf_counter_ns() - start
        evicted = tuple(self.blocks.take_evicted())
        forward_ns = chunks_ns + times.forward_ns
        return StepResult(tuple(generations), info, forward_ns, times.decode_ns, total, 0, evicted)

    def _prefilling(self, batch: Batch, cached: bool, forward_ns: int, start: int) -> StepResult:
        """A chunk was computed and more are left: keep the batch as prefilling, answer no tokens."""
        batch.prefilling = True
        if not cached:
            self.store.put(batch)
        total = time.perf_counter_ns() - start
        evicted = tuple(self.blocks.take_evicted())
        return StepResult((), batch.info(self.block_size), forward_ns, 0, total, 0, evicted)

    # ------------------------------------------------------------------------------------ decode
    def decode(self, inputs: Sequence[DecodeInput]) -> StepResult:
        """Append the given tokens, merge the batches (id = first), one forward for every active request."""
        start = time.perf_counter_ns()
        if not inputs:
            raise InvalidArgument("decode needs at least one batch")
        self.readiness.require_complete("decode")
        batches = self.store.get_many([i.batch_id for i in inputs])
        prefilling = [b.id for b in batches if b.prefilling]
        if prefilling:
            raise FailedPrecondition(f"batches {prefilling} are still being prefilled in chunks")
        for batch, inp in zip(batches, inputs, strict=True):
            if inp.last_iter_tokens:
                check_appended(inp.last_iter_tokens, len(batch), self.limits.vocab_size, f"batch {batch.id}")
                self._check_grammars(batch, inp.last_iter_tokens)
        merged = merge(batches)
        for batch in batches:
            self.store.pop(batch.id)
        self.store.put(merged)
        concat_ns = time.perf_counter_ns() - start
        generations = self._append(batches, inputs)
        active = merged.active()
        times = _StepTimes(0, 0)
        if active:
            stepped, times = self._step(active, with_prompt_logprobs=False)
            generations.extend(stepped)
        info = self._keep_or_drop(merged, cached=True)
        total = time.perf_counter_ns() - start
        evicted = tuple(self.blocks.take_evicted())
        return StepResult(
            tuple(generations), info, times.forward_ns, times.decode_ns, total, concat_ns, evicted
        )

    def _check_grammars(self, batch: Batch, tokens: Sequence[int]) -> None:
        """Refuse appended tokens a constrained request's grammar would not have allowed (nothing changed)."""
        for request, token in zip(batch.requests, tokens, strict=False):
            grammar = request.grammar
            if grammar is None or request.finished or grammar.allows(token):
                continue
            message = f"batch {batch.id}: token {token} does not match request {request.id}'s grammar"
            raise InvalidArgument(message)

    def _append(self, batches: Sequence[Batch], inputs: Sequence[DecodeInput]) -> list[Generation]:
        """Tokens generated elsewhere count exactly as if generated here."""
        generations = []
        for batch, inp in zip(batches, inputs, strict=True):
            # no last_iter_tokens = nothing to append (zip stops at once)
            for request, token in zip(batch.requests, inp.last_iter_tokens, strict=False):
                if not request.finished:
                    generation = appended_generation(request, token, self.detok)
                    if generation is not None:
                        generations.append(generation)
        return generations

    # ------------------------------------------------------------------------------ shared step
    def _step(
        self, requests: list[RequestState], with_prompt_logprobs: bool
    ) -> tuple[list[Generation], _StepTimes]:
        """Forward the uncached tokens of `requests`, choose one token each, account it."""
        start = time.perf_counter_ns()
        out = self.runner.forward(self.seq_inputs(requests, with_prompt_logprobs))
        forward_ns = time.perf_counter_ns() - start
        generations = self._choose(requests, out)
        return generations, _StepTimes(forward_ns, time.perf_counter_ns() - start - forward_ns)

    @staticmethod
    def seq_inputs(requests: Sequence[RequestState], with_prompt_logprobs: bool) -> list[SeqInput]:
        """What a forward feeds for `requests`: their uncached tokens, pages and cached counts."""
        return [
            SeqInput(r.pending, r.pages, r.num_cached, with_prompt_logprobs and r.spec.prefill_logprobs)
            for r in requests
        ]

    def _choose(self, requests: Sequence[RequestState], out: Any, complete: bool = True) -> list[Generation]:
        """Choose one token per request from a forward's output and account it (`complete`: every
        layer's K/V of the prompt is in its pages here, so full pages join the prefix cache)."""
        rows = [_row_input(r) for r in requests]
        choices = self.runner.choose(out, rows)
        generations = []
        detok = self.detok
        block = self.block_size if self.blocks.prefix_cache else 0
        for i, (request, choice) in enumerate(zip(requests, choices, strict=True)):
            prefill = None
            if request.spec.prefill_logprobs and request.num_cached == 0:
                prompt = request.tokens[: request.prompt_len]
                prefill = prefill_tokens(prompt, self.runner.prompt_logprobs(out, i, prompt), detok)
            request.num_cached = len(request.tokens)
            if complete and block and request.num_cached >= (len(request.page_hashes) + 1) * block:
                self.register_pages(request)
            generation = step_generation(request, choice, detok, prefill)
            if request.cached_tokens and len(request.tokens) == request.prompt_len + 1:  # its first token
                generation = generation._replace(cached_tokens=request.cached_tokens)
            generations.append(generation)
        return generations

    def finish_prefill(self, batch: Batch, out: Any, start_ns: int, forward_ns: int,
                       complete: bool = True) -> StepResult:
        """First tokens of an admitted batch whose forward ran in parts elsewhere (layer-level prefill).

        Like the end of `prefill`: choose, cache the batch (or drop it if every request finished);
        on failure its pages are freed before the error leaves. `complete` False: only some layers'
        K/V were written here (a relay's last layers): its pages never join the prefix cache, where
        a later prompt with the same prefix would read the other layers' stale rows.
        """
        sample_start = time.perf_counter_ns()
        try:
            generations = self._choose(batch.requests, out, complete)
        except BaseException:
            self.blocks.free(batch.pages())
            raise
        info = self._keep_or_drop(batch, cached=False)
        end = time.perf_counter_ns()
        evicted = tuple(self.blocks.take_evicted())
        return StepResult(
            tuple(generations), info, forward_ns, end - sample_start, end - start_ns, 0, evicted
        )

    def _keep_or_drop(self, batch: Batch, cached: bool) -> CachedBatchInfo | None:
        """Cache a batch that still runs; drop (and free) one whose requests all finished."""
        if batch.all_finished:
            if cached:
                self.store.pop(batch.id)
            self.blocks.free(batch.pages())
            return None
        if not cached:
            self.store.put(batch)
        return batch.info(self.block_size)

    # ------------------------------------------------------------------------ filter and clear
    def filter(self, batch_id: BatchId, keep: Sequence[RequestId]) -> CachedBatchInfo:
        """Keep only `keep` in the batch; free the pages of the others (an empty list drops the batch)."""
        batch = self.store.get(batch_id)
        kept, dropped = batch.split(keep)
        self.blocks.free([p for r in dropped for p in r.pages])
        batch.requests = kept
        if not kept:
            self.store.pop(batch_id)
        return batch.info(self.block_size)

    def clear(self, batch_id: BatchId | None = None) -> None:
        """Free one batch (NotFound if unknown) or, with no id, every batch."""
        batches = [self.store.get(batch_id)] if batch_id is not None else list(self.store)
        for batch in batches:
            self.store.pop(batch.id)
            self.blocks.free(batch.pages())

    # ------------------------------------------------------------------------------------- info
    def info(self) -> EngineInfo:
        """Model and cache facts, exact at this instant."""
        config = self.runner.config
        ready = self.readiness.snapshot()
        return EngineInfo(
            model_id=self.meta.model_id,
            dtype=self.meta.dtype,
            device_type=self.meta.device_type,
            num_layers=config.num_layers,
            block_size=self.block_size,
            num_blocks_total=self.blocks.num_blocks,
            num_blocks_free=self.blocks.num_free,
            embed_ready=ready.embed,
            num_layers_loaded=ready.layers,
            lm_head_ready=ready.head,
            num_cached_batches=len(self.store),
            max_input_tokens=self.limits.max_input_tokens,
            max_total_tokens=self.limits.max_total_tokens,
            window_size=config.sliding_window,
            device=self.meta.device,
            gpu_name=self.meta.gpu_name,
            attention_backend=self.meta.attention_backend,
            cuda_graphs=self.meta.cuda_graphs,
            prefix_cache=self.blocks.prefix_cache,
            num_blocks_cached=self.blocks.num_cached,
            cached_page_hashes=tuple(self.blocks.cached_hashes()),
        )

    def replace_cache(self, runner: Runner) -> None:
        """Swap in a runner over a new KV cache (only while no batch is cached)."""
        if len(self.store):
            raise FailedPrecondition("cannot resize the KV cache while batches are cached")
        self.runner = runner
        lost = self.blocks.take_evicted() + self.blocks.cached_hashes()
        self.blocks = BlockManager(runner.cache.num_blocks, runner.cache.block_size, self.meta.prefix_cache)
        self.blocks.note_evicted(lost)  # the router's cache index forgets them with the next response

    def switch_model(self, runner: Runner, detok: Detokenizer, limits: Limits, model_id: str) -> None:
        """Serve another model (`replica/engine/switch.py`): a runner over its weights and a new KV
        cache, its tokenizer, limits and name (only while no batch is cached)."""
        self.replace_cache(runner)
        self.detok, self.limits = detok, limits
        self.meta = replace(self.meta, model_id=model_id)
        self.eos_token_ids = frozenset(runner.config.eos_token_ids)
        self.grammars = Grammars(detok.tokenizer, limits.vocab_size, self.eos_token_ids)


def _row_input(r: RequestState) -> RowInput:
    """What choosing `r`'s next token needs (a continuation's earlier tokens count as generated)."""
    spec = r.spec
    prompt_len = r.prompt_len - spec.generated_prefix
    return RowInput(spec.sampling, r.tokens, prompt_len, spec.top_n_tokens, r.grammar, r.stop.banned())
