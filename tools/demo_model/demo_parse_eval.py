"""The embedded demo model's parse test through hybridserve's engine, apart from training: greedy
continuations of held-out function prompts (tools/demo_model/train_demo_eval.py says how prompts are picked and cut), at
several repetition penalties, plus MTP acceptance at K = 1..3 under the model's shipped defaults.

Plain greedy decoding makes a model this small loop (a line or a phrase repeated until the token limit: every
failure in bench/results/h200/demo_model/demo_parse.json is one), so the checkpoint ships a repetition penalty in its
generation_config.json, which `LLM`, `serve` and vLLM apply to requests that leave it unset. Deterministic:
CPU fp32 gives the GPU's rate (73.4 % plain greedy on the 64 prompts of training's own evaluation, both).

    python tools/demo_model/demo_parse_eval.py --corpus .demo_data/corpus.tar.xz --out demo_parse.json
    python tools/demo_model/demo_parse_eval.py --corpus .demo_data/corpus.tar.xz --device cuda \
        --out bench/results/h200/demo_model/demo_parse.json
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridserve import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo_data  # noqa: E402 - bench/ siblings
import train_demo_eval  # noqa: E402


def failure_kind(prompt: str, continuation: str, finished: bool) -> str:
    """"" when it parses, else the SyntaxError's message without its position."""
    try:
        ast.parse(prompt + train_demo_eval.cut_continuation(continuation, finished))
    except SyntaxError as exc:
        return (exc.msg or "syntax error").split(" (")[0].split(" on line")[0]
    except ValueError as exc:
        return str(exc)
    return ""


def looped(text: str, min_repeats: int = 4) -> bool:
    """A non-blank line that occurs at least `min_repeats` times: the greedy loop."""
    counts = Counter(line.strip() for line in text.splitlines() if line.strip())
    return bool(counts) and counts.most_common(1)[0][1] >= min_repeats


def run(llm: LLM, prompts: list[str], penalty: float, ngram: int, max_tokens: int) -> dict:
    """Greedy continuations of `prompts` under one (repetition penalty, no-repeat n-gram size) setting (the LLM
    runs without prefix caching, so every setting computes its prompts afresh)."""
    from hybridserve import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0,
                                                repetition_penalty=penalty, no_repeat_ngram_size=ngram))
    kinds = [failure_kind(p, o.text or "", o.finish_reason == "stop") for p, o in zip(prompts, outs)]
    failed = [(o.text or "") for o, k in zip(outs, kinds) if k]
    return {"repetition_penalty": penalty, "no_repeat_ngram_size": ngram, "parse_rate": kinds.count("") / len(prompts),
            "parsed": kinds.count(""), "prompts": len(prompts),
            "failures": dict(Counter(k for k in kinds if k).most_common()),
            "failures_that_loop": sum(looped(t) for t in failed),
            "outputs_that_loop": sum(looped(o.text or "") for o in outs),
            "seconds": round(time.perf_counter() - t0, 1)}


def acceptance(model: str, prompts: list[str], max_tokens: int, max_k: int, engine: dict) -> dict:
    """MTP acceptance length at K = 1..max_k under the checkpoint's own defaults, greedy."""
    import dataclasses

    from hybridserve import LLM

    result = {}
    for k in range(1, max_k + 1):
        llm = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine)
        params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=max_tokens, temperature=0.0,
                                     seed=0)
        llm.generate(prompts, params)
        result[k] = round(llm.engine.spec.metrics.acceptance_length, 3)
    return result


def select(rows: list[dict]) -> dict:
    """The setting with the highest parse rate; ties go to the milder one (lower penalty, then no / longer n-gram
    ban), so a setting is only chosen over plain greedy when it parses more prompts."""
    return max(rows, key=lambda r: (r["parsed"], -r["repetition_penalty"],
                                    -(1 / r["no_repeat_ngram_size"] if r["no_repeat_ngram_size"] else 0.0)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "demo_model"))
    p.add_argument("--corpus", type=Path, required=True, help="tools/demo_model/train_demo_fetch.py's archive")
    p.add_argument("--prompts", type=int, default=256, help="prompts per split at most (held-out has ~160)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--penalties", type=float, nargs="+", default=[1.0, 1.05, 1.1, 1.15, 1.2])
    p.add_argument("--ngram-sizes", type=int, nargs="+", default=[0], help="no_repeat_ngram_size values (0: off)")
    p.add_argument("--select-on-validation", action="store_true",
                   help="also run the grid on prompts of the validation files (never trained on, never reported as "
                   "held-out), pick the best setting there, and report the held-out rate of that pick")
    p.add_argument("--mtp-prompts", type=int, default=64, help="prompts of the acceptance run (0: skip)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda runs bf16 (as training's eval)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from hybridserve import LLM

    engine = {"device": "cuda", "dtype": "bfloat16", "warmup": False} if args.device == "cuda" else {}
    corpus = train_demo_data.load_corpus(4, 3, None, args.corpus)  # train_demo.py's default split
    splits = {"heldout": train_demo_eval.heldout_prompts(corpus.heldout, args.prompts)}
    if args.select_on_validation:
        splits["validation"] = train_demo_eval.heldout_prompts(corpus.validation, args.prompts)
    shipped = json.loads((Path(args.model) / "generation_config.json").read_text()).get("repetition_penalty", 1.0)
    llm = LLM(args.model, generation_config="none", enable_prefix_caching=False, **engine)
    rows: dict[str, list[dict]] = {name: [] for name in splits}
    for name, prompts in splits.items():
        for penalty in args.penalties:
            for ngram in args.ngram_sizes:
                rows[name].append(run(llm, prompts, penalty, ngram, args.max_tokens))
                print(name, json.dumps(rows[name][-1]), flush=True)
    del llm
    result = {"command": " ".join(sys.argv), "model": args.model, "device": args.device, "shipped_repetition_penalty": shipped,
              "max_tokens": args.max_tokens, "machine": platform.platform(), "rows": rows["heldout"],
              "first_64_prompts_note": "tools/demo_model/train_demo.py's own evaluation uses the first 64 of these prompts"}
    if args.select_on_validation:
        pick = select(rows["validation"])
        key = (pick["repetition_penalty"], pick["no_repeat_ngram_size"])
        heldout = next(r for r in rows["heldout"] if (r["repetition_penalty"], r["no_repeat_ngram_size"]) == key)
        result["validation_rows"] = rows["validation"]
        result["selected_on_validation"] = {"repetition_penalty": key[0], "no_repeat_ngram_size": key[1],
                                            "validation_parse_rate": pick["parse_rate"],
                                            "heldout_parse_rate": heldout["parse_rate"],
                                            "validation_prompts": len(splits["validation"]),
                                            "heldout_prompts": len(splits["heldout"])}
        print(json.dumps(result["selected_on_validation"]), flush=True)
    if args.mtp_prompts:
        result["mtp_acceptance_with_shipped_defaults"] = acceptance(args.model, splits["heldout"][: args.mtp_prompts],
                                                                    args.max_tokens, 3, engine)
        print(json.dumps(result["mtp_acceptance_with_shipped_defaults"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
