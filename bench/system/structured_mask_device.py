"""Per-step cost of a grammar mask on the device, as the engine pays it (`engine.structured_output.GrammarBackend.
apply`): for a batch of B structured requests, fill one xgrammar bitmask row per request on the host, copy the
[B, V/32] mask to the device and apply it to the [B, V] logits; walked token by token through a JSON instance.
Reported per step (median over steps and repeats): `fill` (host, all B rows), `apply` (H2D copy + the masking
kernel, synchronized), `step` (the engine's whole path: allocate, fill, copy, apply), and in the same run two
floors: `argmax` of the same logits (a cost every step pays anyway) and an empty device sync.

The vocabulary defaults to NemotronH Nano-9B-v2's size, 131072: with `--tokenizer DIR` its real tokenizer (a
local HF directory), else a synthetic byte-level-like one built here from the Python standard library's text
(frequent word pieces, then their prefixes), so the run needs no download.

    python bench/system/structured_mask_device.py --device cuda [--tokenizer DIR] [--batch 1,8,32,128]
        [--repeats 5] [--out structured_mask_device.json]
CPU smoke: python bench/system/structured_mask_device.py --device cpu --vocab-size 32768 --batch 1,4 --repeats 1
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import re
import statistics
import sysconfig
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["id", "name", "tags"], "additionalProperties": False}},
    "ok": {"type": "boolean"}}, "required": ["items", "ok"], "additionalProperties": False}
INSTANCE = {"items": [{"id": 1, "name": "alpha beta", "tags": ["a", "b"]}, {"id": 22, "name": "gamma", "tags": ["c"]},
                      {"id": 333, "name": "delta epsilon zeta", "tags": []}], "ok": True}


def synthetic_vocab(size: int) -> list[bytes]:
    """Token 0 the end-of-sequence token, then the 256 bytes, then frequent word pieces of the stdlib's source
    text and their prefixes, up to `size` distinct tokens."""
    vocab: list[bytes] = [b"</s>"] + [bytes([b]) for b in range(256)]
    seen = set(vocab)
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]:
        counts.update(re.findall(r" ?\w+| +|[^\w\s]+|\n+", path.read_text(encoding="utf-8", errors="ignore")))
    pieces = [p.encode() for p, _ in counts.most_common()]
    for piece in pieces + [p[:k] for p in pieces for k in range(len(p) - 1, 1, -1)]:
        if len(vocab) == size:
            break
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    while len(vocab) < size:  # pad with unique filler pieces if the text ran out
        vocab.append(f"<filler{len(vocab)}>".encode())
    return vocab


def tokenize_longest(text: bytes, vocab: list[bytes]) -> list[int]:
    ids = {piece: i for i, piece in enumerate(vocab) if i > 0}
    longest = max(len(p) for p in vocab)
    out, at = [], 0
    while at < len(text):
        for k in range(min(longest, len(text) - at), 0, -1):
            if text[at : at + k] in ids:
                out.append(ids[text[at : at + k]])
                at += k
                break
    return out


def grammar_and_ids(args: argparse.Namespace) -> tuple[Any, list[int], int, str]:
    import xgrammar as xgr

    text = json.dumps(INSTANCE, separators=(",", ":"))
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        vocab_size = max(args.vocab_size, len(tok))
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[tok.eos_token_id])
        ids = list(tok.encode(text, add_special_tokens=False))
        source = f"tokenizer {args.tokenizer}"
    else:
        vocab = synthetic_vocab(args.vocab_size)
        vocab_size = len(vocab)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[0])
        ids = tokenize_longest(text.encode(), vocab)
        source = "synthetic vocabulary from the stdlib's text"
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                            separators=(",", ":"))
    return compiled, ids, vocab_size, source


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(compiled: Any, ids: list[int], vocab: int, batch: int, device: torch.device, repeats: int) -> dict:
    """Median microseconds per step for `batch` requests walking `ids` together."""
    import xgrammar as xgr

    logits = torch.randn(batch, vocab, device=device)
    pinned = xgr.allocate_token_bitmask(batch, vocab)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "step": [], "argmax": [], "sync": []}
    for _ in range(repeats):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        for token in ids:
            t0 = time.perf_counter()
            for row, m in enumerate(matchers):
                m.fill_next_token_bitmask(pinned, row)
            t1 = time.perf_counter()
            sync(device)
            t2 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, pinned.to(device), vocab_size=vocab)
            sync(device)
            t3 = time.perf_counter()
            bitmask = xgr.allocate_token_bitmask(batch, vocab)  # the engine's path, as GrammarBackend.apply runs it
            for row, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, row)
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(device), vocab_size=vocab, indices=list(range(batch)))
            sync(device)
            t4 = time.perf_counter()
            logits.argmax(dim=-1)
            sync(device)
            t5 = time.perf_counter()
            sync(device)
            t6 = time.perf_counter()
            for kind, seconds in zip(times, (t1 - t0, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                times[kind].append(seconds * 1e6)
            for m in matchers:
                if not m.accept_token(token):
                    raise RuntimeError("the grammar refused the instance's token")
            logits.normal_()  # masked -inf rows would make later argmaxes trivial
    return {"batch": batch, "steps": len(ids), **{f"{k}_us": statistics.median(v) for k, v in times.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", default=None, help="a local HF tokenizer directory (default: synthetic)")
    parser.add_argument("--vocab-size", type=int, default=131072)
    parser.add_argument("--batch", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    compiled, ids, vocab, source = grammar_and_ids(args)
    rows = [measure(compiled, ids, vocab, int(b), device, args.repeats) for b in args.batch.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"{name}, vocab {vocab} ({source}), {len(ids)} steps, median us per step")
    print(f"{'batch':>6} {'fill':>9} {'apply':>9} {'step':>9} {'argmax':>9} {'sync':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['fill_us']:>9.1f} {r['apply_us']:>9.1f} {r['step_us']:>9.1f} {r['argmax_us']:>9.1f}"
              f" {r['sync_us']:>7.1f}")
    result = {"device": name, "vocab_size": vocab, "vocab_source": source, "schema": SCHEMA, "steps": len(ids),
              "repeats": args.repeats, "statistic": "median over steps and repeats, microseconds per step",
              "versions": {"xgrammar": version("xgrammar"), "torch": torch.__version__}, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
