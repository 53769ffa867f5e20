"""The `hybridserve` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from exc


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt with the offline engine",
        description="Load a checkpoint (default: the embedded tiny NemotronH) and generate for one prompt.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory in transformers layout (default: embedded)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (needs a tokenizer in the checkpoint)")
    group.add_argument("--prompt-ids", type=_parse_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prefill-chunk-size", type=int, default=512)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from hybridserve.engine.llm import LLM
    from hybridserve.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, device=args.device, dtype=args.dtype, prefill_chunk_size=args.prefill_chunk_size)
    if args.prompt is not None:
        out = llm.generate([args.prompt], params)[0]
    else:
        out = llm.generate(sampling_params=params, prompt_token_ids=[args.prompt_ids])[0]
    if args.json:
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "num_cached_tokens": out.num_cached_tokens,
        }))
    else:
        if out.text is not None:
            print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}] ids: {out.token_ids}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridserve",
        description="Serve hybrid Mamba2 + attention models (NemotronH, Mamba2).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
