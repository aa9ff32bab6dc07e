"""Stand-ins for the vllm and sglang packages, backed by a tiny transformers model on CPU (see tiny_backend)."""

import contextlib

import torch


@contextlib.contextmanager
def one_thread():
    """The tiny models run ~100x faster on one intra-op thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
