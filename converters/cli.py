"""The converters' command line: ``rlmega convert <what> ...`` or ``python -m converters <what> ...``.

Exit codes: 0 done (verify: everything matches); 1 verify found differences; 2 the input or the
output path is not usable (a one-line message says what and how to fix it; nothing is left behind).
"""

from __future__ import annotations

import argparse
import sys

HELP = "convert checkpoints: Megatron torch_dist <-> Hugging Face safetensors, and verify exports"

DESCRIPTION = """\
Convert model checkpoints between Megatron-Core's torch_dist format and Hugging Face safetensors.

  mcore-to-hf   a torch_dist checkpoint, saved in any TP/PP/VPP/EP layout, -> an HF model directory
                (sharded safetensors + index, config.json, generation_config.json, tokenizer files).
                Reads tensors directly (no model build, no GPU, no process group), a bucket at a time.
  hf-to-mcore   an HF model directory -> a torch_dist checkpoint for a target parallel layout
                (builds the model on CPU ranks at that layout and saves it with Megatron).
  verify        compare an exported HF directory with a reference one: bit for bit, or logits.

Output goes to a hidden sibling directory that is renamed into place only when complete.
"""

EPILOG = """\
examples:
  rlmega convert mcore-to-hf ckpts/run1 hf/run1-step10 --hf-base Qwen/Qwen3-8B-local-dir
  rlmega convert hf-to-mcore hf/Qwen3-8B ckpts/qwen3-tp2 --tp 2 --iteration 0
  rlmega convert hf-to-mcore hf/DeepSeek-V3 ckpts/dsv3 --pp 16 --ep 16 --first-stage-layers 3 --last-stage-layers 2
  rlmega convert verify hf/run1-step10 hf/reference --logits
"""


def _size(text: str) -> int:
    from converters.output import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """What every conversion that writes a directory takes."""
    parser.add_argument("--overwrite", action="store_true", help="replace the output directory if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    commands = parser.add_subparsers(title="conversions", dest="conversion", metavar="<conversion>", required=True)

    to_hf = commands.add_parser(
        "mcore-to-hf", help="Megatron torch_dist checkpoint -> HF safetensors directory",
        description="Export a Megatron torch_dist checkpoint (any TP/PP/VPP/EP layout) as an HF model directory. "
        "Optimizer state and non-tensor objects in the checkpoint are skipped; the embedding and LM head lose "
        "Megatron's vocabulary padding. Every name and shape is checked against the --hf-base config first.",
    )
    to_hf.add_argument("checkpoint", help="an iter_NNNNNNN directory, or its parent holding latest_checkpointed_iteration.txt")
    to_hf.add_argument("output", help="the HF directory to create")
    to_hf.add_argument("--hf-base", required=True, help="HF directory of the model the checkpoint was trained from: "
                       "its config.json gives the architecture; its tokenizer and generation config are copied")
    to_hf.add_argument("--bucket-size", type=_size, default="1GiB",
                       help="bytes read, converted and written at a time (the next bucket is read while one is written); "
                       "peak memory is about twice this plus the largest tensor (default: 1GiB)")
    to_hf.add_argument("--shard-size", type=_size, default="5GiB", help="largest safetensors file (default: 5GiB)")
    to_hf.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="cast the weights (default: as stored)")
    to_hf.add_argument("--fp8", action="store_true",
                       help="linear weights as blockwise FP8 (128x128 blocks, fp32 weight_scale_inv; DeepSeek-V3's "
                       "format, which vLLM and SGLang serve in FP8); norms, embeddings, routers and the LM head "
                       "stay in --dtype")
    _add_output_options(to_hf)
    to_hf.set_defaults(conversion_run=_run_mcore_to_hf)

    to_mcore = commands.add_parser(
        "hf-to-mcore", help="HF safetensors directory -> Megatron torch_dist checkpoint for a parallel layout",
        description="Build the model at the target layout on CPU gloo ranks (tp*pp*... processes on this machine), "
        "import the HF weights into it and save it with Megatron's dist_checkpointing. The checkpoint loads at "
        "that layout and at any other with the same padded vocabulary (the padding depends on --tp).",
    )
    to_mcore.add_argument("hf_dir", help="HF model directory (config.json + safetensors)")
    to_mcore.add_argument("output", help="the checkpoint directory to create")
    to_mcore.add_argument("--tp", type=_positive, default=1, help="tensor parallel degree (default: 1)")
    to_mcore.add_argument("--pp", type=_positive, default=1, help="pipeline parallel degree (default: 1)")
    to_mcore.add_argument("--vpp", type=_positive, default=None, help="virtual stages per pipeline rank")
    to_mcore.add_argument("--ep", type=_positive, default=1, help="expert parallel degree (default: 1)")
    to_mcore.add_argument("--etp", type=_positive, default=None, help="expert tensor parallel degree (default: 1 under --ep > 1, else --tp)")
    to_mcore.add_argument("--first-stage-layers", type=_positive, default=None,
                          help="layers on the first pipeline stage when stages are uneven (the rest split evenly)")
    to_mcore.add_argument("--last-stage-layers", type=_positive, default=None,
                          help="layers on the last pipeline stage when stages are uneven")
    to_mcore.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="parameter dtype (default: config.json's)")
    to_mcore.add_argument("--iteration", type=int, default=None,
                          help="write Megatron's training layout, OUTPUT/iter_NNNNNNN/ + latest_checkpointed_iteration.txt "
                          "(default: the checkpoint directly in OUTPUT)")
    to_mcore.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped (default: 3600)")
    _add_output_options(to_mcore)
    to_mcore.set_defaults(conversion_run=_run_hf_to_mcore)

    check = commands.add_parser(
        "verify", help="compare an exported HF directory with a reference HF directory",
        description="Every tensor must be bit-identical. Where dtypes differ (or with --logits), both models also run on "
        "fixed probe tokens in fp32 and the logits must agree within --atol. Differences are listed by key; "
        "the exit code is 1 on any mismatch.",
    )
    check.add_argument("exported", help="the HF directory to check")
    check.add_argument("reference", help="the HF directory it should equal")
    check.add_argument("--logits", action="store_true", help="also compare logits on probe tokens")
    check.add_argument("--atol", type=float, default=1e-4,
                       help="largest allowed logit difference (default: 1e-4, for fp32; raise it for bf16 exports)")
    check.set_defaults(conversion_run=_run_verify)


def _dtype(name):
    import torch

    return None if name is None else getattr(torch, name)


def _run_mcore_to_hf(args) -> int:
    from converters.mcore_to_hf import convert
    from converters.output import human_bytes

    result = convert(args.checkpoint, args.output, args.hf_base, bucket_bytes=args.bucket_size,
                     shard_bytes=args.shard_size, dtype=_dtype(args.dtype), overwrite=args.overwrite, quiet=args.quiet,
                     fp8=args.fp8)
    for line in result.notes:
        print(f"note: {line}")
    print(f"wrote {result.output}: {result.num_tensors} tensors, {human_bytes(result.bytes_written)} in "
          f"{result.num_shards} shard(s), {result.seconds:.1f} s")
    return 0


def _run_hf_to_mcore(args) -> int:
    from converters.hf_to_mcore import convert, layout_for
    from converters.output import human_bytes
    from rlmega.parallel.layout import LayoutError

    from converters.errors import ConversionError

    try:
        layout = layout_for(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp,
                            first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers)
    except LayoutError as error:
        raise ConversionError(str(error)) from None
    result = convert(args.hf_dir, args.output, layout, dtype=_dtype(args.dtype), iteration=args.iteration,
                     overwrite=args.overwrite, quiet=args.quiet, timeout_s=args.timeout)
    for line in result.notes:
        print(f"note: {line}")
    print(f"wrote {result.checkpoint_dir}: {layout.describe()}, {result.world_size} rank(s), "
          f"{human_bytes(result.bytes_written)}, {result.seconds:.1f} s")
    return 0


def _run_verify(args) -> int:
    from converters.verify import verify

    report = verify(args.exported, args.reference, logits=args.logits, atol=args.atol)
    for line in report.notes:
        print(f"note: {line}")
    for line in report.differences:
        print(f"DIFF {line}")
    logits = "" if report.logits_max_abs_diff is None else f", logits max abs diff {report.logits_max_abs_diff:.3g}"
    verdict = "match" if report.ok else f"{len(report.differences)} difference(s)"
    print(f"{verdict}: {report.num_identical}/{report.num_compared} tensors bit-identical{logits}")
    return 0 if report.ok else 1


def run(args: argparse.Namespace) -> int:
    from converters.errors import ConversionError

    try:
        return args.conversion_run(args)
    except ConversionError as error:
        print(f"rlmega convert {args.conversion}: error: {error}", file=sys.stderr)
        return 2


def main(argv=None, prog: str = "python -m converters") -> int:
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    return run(args)
