"""The CPU rollout engine next to transformers' own ``generate``, on the same batch, in one process.

The quickstart's model (``rlmega.trainer.assets``: 2 layers, hidden 128, character tokenizer) and its
arithmetic prompts, ``--prompts`` prompts x ``--n`` samples each, at most ``--max-new-tokens`` tokens,
temperature 1, stopping at the end-of-sequence token. Alternately, ``--repeats`` times each:

  engine     ``rlmega.rollout.HFEngine.generate``: a seeded generator per response, per-row sampling
             settings, log-probs of every chosen token
  generate   ``model.generate(do_sample=True, top_k=0, num_return_sequences=n)`` on the same left-padded
             prompts: one generator for the batch, no log-probs

Prints the median time of each and the ratio engine / generate (target: <= 1.0). ``--threads`` sets
torch's threads (default 2).

    python benchmarks/cpu_generation.py [--prompts 8] [--n 8] [--max-new-tokens 8] [--repeats 21]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per response at most (default 8)")
    parser.add_argument("--repeats", type=int, default=21, help="timed calls of each (default 21)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()

    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from rlmega.rollout import HFEngine, SamplingParams
    from rlmega.trainer.assets import prepare_tiny_assets

    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="rlmega-generation-") as work:
        paths = prepare_tiny_assets(work, num_train=max(64, args.prompts), num_val=8)
        tokenizer = AutoTokenizer.from_pretrained(paths["model"])
        rows = pq.read_table(paths["train"]).to_pylist()[:args.prompts]
        prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
                   for row in rows]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
        engine = HFEngine(paths["model"])
        model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
        stop = tokenizer.eos_token_id
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n,
                                stop_token_ids=[stop], seed=1)
        repeated = [p for p in prompts for _ in range(args.n)]
        longest = max(len(p) for p in repeated)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in repeated])
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in repeated])

        def run_engine() -> int:
            return sum(len(g.response_token_ids) for g in engine.generate(prompts, params))

        @torch.inference_mode()
        def run_generate() -> int:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, top_k=0,
                                 top_p=1.0, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                 eos_token_id=stop, pad_token_id=pad)
            new = out[:, longest:]
            stops = (new == stop).cumsum(dim=-1)  # each row's tokens: all before its first stop, and that stop
            return int(((stops == 0) | ((stops == 1) & (new == stop))).sum())

        times: dict[str, list[float]] = {"engine": [], "generate": []}
        tokens: dict[str, list[int]] = {"engine": [], "generate": []}
        for name, call in (("engine", run_engine), ("generate", run_generate)):
            call()  # warm-up
        for _ in range(args.repeats):
            for name, call in (("engine", run_engine), ("generate", run_generate)):
                started = time.perf_counter()
                tokens[name].append(call())
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    rows_per_batch = args.prompts * args.n
    print(f"{rows_per_batch} responses per batch, at most {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.repeats} calls each")
    for name in ("engine", "generate"):
        print(f"  {name:<9} {medians[name] * 1000:8.1f} ms   {statistics.mean(tokens[name]):6.0f} tokens per batch")
    print(f"ratio engine / generate: {medians['engine'] / medians['generate']:.2f} x (target <= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
