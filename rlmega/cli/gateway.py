"""``rlmega gateway``: the OpenAI-compatible gateway over a Hugging Face checkpoint, to develop an agent harness
against the policy before training with it (rlmega/gateway/README.md)."""

from __future__ import annotations

import argparse
import threading

HELP = "serve a checkpoint behind the OpenAI-compatible gateway (one session per trajectory) for an agent harness"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face checkpoint directory (with its tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine "
                                                             "only; any other needs --token)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    parser.add_argument("--token", default=None, help="bearer token the harness must send (needed off 127.0.0.1)")
    parser.add_argument("--device", default="cpu", help="torch device of the engine (default: cpu)")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from rlmega.gateway import Gateway
    from rlmega.rollout import HFEngine

    Gateway.check_binding(args.host, args.token)  # before loading the model
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = HFEngine(args.model, device=args.device)
    gateway = Gateway(engine.generate, tokenizer, host=args.host, port=args.port, token=args.token).serve()
    print(f"rlmega gateway: serving {args.model} at {gateway.url}; a session's base_url is "
          f"{gateway.session_url('<session id>')} (Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    finally:
        gateway.close()
    return 0
