"""Per-token grammar mask cost, xgrammar vs llguidance, on one tokenizer: walk a JSON instance of each schema
token by token, filling the next-token bitmask at every step (what the engine does per structured request per
step). Prints a table and writes JSON (device, versions, median of `--repeats` walks). CPU-only work: the mask
fill runs on the host in both libraries; applying it to the logits is one kernel on the device.

    python bench/system/structured_mask.py [--model-dir DIR] [--repeats 20] \
        [--out bench/results/cpu/structured_output/structured_mask.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from importlib.metadata import version
from pathlib import Path

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}, {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["id", "tags"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
        {"items": [{"id": 1, "tags": ["a", "b"]}, {"id": 22, "tags": ["c"]}, {"id": 333, "tags": []}]}),
}


def walk_xgrammar(tok, vocab: int, schema: dict, ids: list[int], repeats: int) -> float:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    runs = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        start = time.perf_counter()
        for t in ids:
            m.fill_next_token_bitmask(bitmask, 0)
            if not m.accept_token(t):
                raise RuntimeError("xgrammar refused the instance")
        runs.append((time.perf_counter() - start) / len(ids))
    return statistics.median(runs)


def walk_llguidance(tok, vocab: int, schema: dict, ids: list[int], repeats: int) -> float:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    runs = []
    for _ in range(repeats):
        m = llguidance.LLMatcher(lltok, grammar)
        start = time.perf_counter()
        for t in ids:
            llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
            if not m.consume_token(t):
                raise RuntimeError(f"llguidance refused the instance: {m.get_error()}")
        runs.append((time.perf_counter() - start) / len(ids))
    return statistics.median(runs)


def main() -> None:
    from transformers import AutoTokenizer

    from hybridserve.models.default_model import default_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(default_model_dir()))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results/cpu/structured_output/structured_mask.json")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    rows = []
    print(f"{'schema':<8} {'tokens':>6} {'xgrammar us/token':>18} {'llguidance us/token':>20}")
    for name, (schema, instance) in SCHEMAS.items():
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        xg = walk_xgrammar(tok, vocab, schema, ids, args.repeats) * 1e6
        ll = walk_llguidance(tok, vocab, schema, ids, args.repeats) * 1e6
        rows.append({"schema": name, "tokens": len(ids), "xgrammar_us_per_token": xg, "llguidance_us_per_token": ll})
        print(f"{name:<8} {len(ids):>6} {xg:>18.1f} {ll:>20.1f}")
    result = {"device": platform.processor() or platform.machine(), "vocab_size": vocab, "model_dir": args.model_dir,
              "versions": {"xgrammar": version("xgrammar"), "llguidance": version("llguidance")},
              "repeats": args.repeats, "statistic": "median of walks, per token", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
