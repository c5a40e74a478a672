"""The vLLM side of `pdcluster bench engine --peer vllm`, run by vLLM's own interpreter (its venv).

Standalone on purpose: it imports only the standard library and vllm (pdcluster is not installed in
vLLM's venv). It builds one offline `LLM` (float32, eager, prefix caching off, one sequence slot per
request), prints `ready`, then answers each line `round` on stdin with one JSON line on stdout:
the seconds of `generate` with 1 new token (prefill and the first token) and with `output_len`
new tokens (EOS ignored), for the same `batch` prompts of `input_len` random token ids. The parent
takes (output_len - 1) * batch tokens over the difference as the decode rate. EOF or `quit` ends it.

usage: python vllm_peer.py MODEL_DIR BATCH INPUT_LEN OUTPUT_LEN SEED
"""

import json
import os
import random
import sys
import time


def main() -> None:
    model, batch, input_len, output_len, seed = sys.argv[1], *map(int, sys.argv[2:6])
    # vLLM logs to stdout (its spawned processes too): the answers get a private copy of it, and
    # fd 1 becomes stderr for everything else
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=max(512, input_len + output_len),
        max_num_seqs=batch,
        seed=seed,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(input_len)]} for _ in range(batch)
    ]

    def timed(new_tokens: int) -> float:
        params = SamplingParams(
            temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != new_tokens for o in outputs):
            raise RuntimeError(f"vLLM did not generate exactly {new_tokens} tokens per request")
        return seconds

    timed(output_len)  # warm-up: lazy initialisation, first-shape costs
    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        first = timed(1)
        full = timed(output_len)
        print(json.dumps({"first_s": first, "full_s": full}), file=answers, flush=True)


if __name__ == "__main__":
    main()
