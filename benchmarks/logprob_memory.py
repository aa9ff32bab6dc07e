"""Peak memory of token log-probs + entropy: rlmega's chunked vocab-parallel path vs a full softmax.

    python benchmarks/logprob_memory.py                  # 2048 tokens x 151,936 vocab, bf16 logits
    python benchmarks/logprob_memory.py --tokens 512     # quicker

Each method runs in its own fresh process (so one's peak cannot hide the other's) on the same
bf16 logits; a sampler reads the process's resident memory every millisecond, and the result is
the peak above the memory held once the logits exist. Forward (log-probs and entropy) and
backward (the gradient into the logits, which both methods must materialise) are reported
separately. The target is a forward peak of at most 25 % of the naive path's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

MIB = 1024**2


def _measure(method: str, tokens: int, vocab: int, chunk_tokens: int) -> dict:
    import psutil
    import torch

    from rlmega.workers.logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    process = psutil.Process()
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    def run(fn):
        baseline = process.memory_info().rss
        peak[0], thread = baseline, threading.Thread(target=sample, daemon=True)
        stop.clear()
        thread.start()
        started = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - started
        stop.set()
        thread.join()
        return out, (peak[0] - baseline) / MIB, seconds

    if method == "naive":
        def forward():
            logp_all = torch.log_softmax(logits.float(), dim=-1)
            logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return logp, entropy
    else:
        def forward():
            return vocab_parallel_logprobs(logits, targets, vocab_size=vocab, with_entropy=True, chunk_tokens=chunk_tokens)

    (logp, entropy), forward_mib, forward_s = run(forward)
    _, backward_mib, backward_s = run(lambda: (logp.sum() + entropy.sum()).backward())
    return dict(forward_mib=forward_mib, backward_mib=backward_mib, forward_s=forward_s, backward_s=backward_s,
                logits_mib=logits.numel() * logits.element_size() / MIB, checksum=float(logp.double().sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child, args.tokens, args.vocab, args.chunk_tokens)))
        return

    # A fixed mmap threshold makes freed large blocks leave RSS at once, so RSS tracks live memory.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MIB), OMP_NUM_THREADS="2")
    results = {}
    for method in ("naive", "chunked"):
        command = [sys.executable, __file__, "--child", method, "--tokens", str(args.tokens),
                   "--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=True)
        results[method] = json.loads(done.stdout.strip().splitlines()[-1])
    naive, chunked = results["naive"], results["chunked"]
    assert abs(naive["checksum"] - chunked["checksum"]) <= 1e-3 * abs(naive["checksum"]), "methods disagree"
    print(f"{args.tokens} tokens x {args.vocab} vocab, bf16 logits {naive['logits_mib']:.0f} MiB, chunk {args.chunk_tokens} tokens")
    print(f"{'':<10}{'forward MiB':>12}{'backward MiB':>14}{'forward s':>11}{'backward s':>12}")
    for name, r in results.items():
        print(f"{name:<10}{r['forward_mib']:>12.0f}{r['backward_mib']:>14.0f}{r['forward_s']:>11.2f}{r['backward_s']:>12.2f}")
    print(f"chunked / naive peak: forward {chunked['forward_mib'] / naive['forward_mib']:.1%}, "
          f"backward {chunked['backward_mib'] / naive['backward_mib']:.1%} (forward target <= 25%)")


if __name__ == "__main__":
    main()
