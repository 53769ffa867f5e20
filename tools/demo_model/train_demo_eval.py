"""Evaluation of the demo model (tools/demo_model/train_demo.py) beyond held-out loss: greedy continuations of held-out
function prompts and whether they parse, and MTP acceptance at K = 1..3.

Prompts: the header (signature line, plus the docstring where there is one) of top-level functions of
held-out files, which training never saw. A continuation stops at the first top-level `def` / `class` /
`@` / `if __name__` line (the usual stop sequences of code completion) or at EOS, else it is cut at its last
complete line; it passes when `ast.parse(prompt + continuation)` succeeds. The token limit (--gen-tokens, 256)
is set so that every held-out function's own body fits (the longest is 184 tokens; 96 cut off 9 of 64).
Prompts are encoded as the engine encodes them, with the tokenizer's BOS.

Acceptance is measured two ways: through hybridserve's own engine (`LLM(..., speculative_config=mtp)`,
greedy, the serving drafter applied K times) where it runs, and always by replaying the model's own greedy
continuations through the trained trunk and the recurrent MTP (`recurrent_mtp`): a step drafts K tokens
from the position after the last verified token, accepts them up to the first mismatch, and moves on by the
accepted tokens + 1, which is what greedy speculative decoding with this drafter does.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import logging
import time
from pathlib import Path

import torch
from train_demo_mtp import MTP, forward_losses, recurrent_mtp  # loaded by train_demo.py before this module

logger = logging.getLogger("train_demo")
STOPS = ("\ndef ", "\nclass ", "\n@", "\nif __name__", "\nasync def ")


def heldout_prompts(files: list[tuple[str, str]], count: int, per_file: int = 2) -> list[str]:
    """Headers of short top-level functions (<= 15 lines, a one-line signature) of the held-out files."""
    prompts: list[str] = []
    for _, text in sorted(files):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        taken = 0
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list or not node.body:
                continue
            end = node.end_lineno or node.lineno
            if end - node.lineno > 15 or node.body[0].lineno == node.lineno or not lines[node.lineno - 1].rstrip().endswith(":"):
                continue
            first = node.body[0]
            is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
            if is_doc and len(node.body) == 1:
                continue  # nothing left to write
            header_end = (first.end_lineno or first.lineno) if is_doc else node.lineno
            prompt = "".join(lines[node.lineno - 1 : header_end])
            if len(prompt) > 600 or not prompt.endswith("\n"):
                continue
            prompts.append(prompt)
            taken += 1
            if taken == per_file or len(prompts) == count:
                break
        if len(prompts) == count:
            break
    return prompts


def cut_continuation(text: str, finished: bool) -> str:
    """Up to the first stop sequence; otherwise whole if generation ended at EOS, else to the last newline."""
    stops = [text.find(s) for s in STOPS if text.find(s) >= 0]
    if stops:
        return text[: min(stops)] + "\n"
    if finished:
        return text
    return text[: text.rfind("\n") + 1] if "\n" in text else ""


def parses(prompt: str, continuation: str, finished: bool) -> bool:
    try:
        ast.parse(prompt + cut_continuation(continuation, finished))
    except (SyntaxError, ValueError):
        return False
    return True


@torch.no_grad()
def greedy_hf(trunk, tokenizer, prompts: list[str], max_tokens: int, device: str, budget_s: float) -> list[dict]:  # noqa: ANN001
    """Greedy continuations with transformers' cached generate (one prompt at a time), within a time budget."""
    eos = tokenizer.eos_token_id
    out = []
    t0 = time.perf_counter()
    for prompt in prompts:
        if time.perf_counter() - t0 > budget_s:
            logger.warning("greedy generation: time budget spent after %d of %d prompts", len(out), len(prompts))
            break
        ids = tokenizer.encode(prompt)  # with BOS, as the engine and the server encode a prompt
        x = torch.tensor([ids], device=device)
        gen = trunk.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)[0, len(ids) :].tolist()
        finished = eos in gen
        gen = gen[: gen.index(eos)] if finished else gen
        out.append({"prompt": prompt, "prompt_ids": ids, "token_ids": gen, "finished": finished,
                    "text": tokenizer.decode(gen)})
    return out


@torch.no_grad()
def replay_acceptance(trunk, mtp, recurrent_mtp, generations: list[dict], max_k: int, device: str) -> dict:  # noqa: ANN001
    """{K: acceptance length} over the greedy continuations (see the module docstring)."""
    tokens = {k: 0 for k in range(1, max_k + 1)}
    steps = {k: 0 for k in range(1, max_k + 1)}
    for item in generations:
        seq = item["prompt_ids"] + item["token_ids"]
        if len(item["token_ids"]) < 2 or len(item["prompt_ids"]) < 2:
            continue
        x = torch.tensor([seq], device=device)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            h = trunk.model(input_ids=x, use_cache=False).last_hidden_state
            gs = recurrent_mtp(mtp, trunk.model.embeddings(x[:, 1:]), h[:, :-1], max_k)
            # drafts[d-1][q] = the depth-d draft computed at position q (slot q-1), predicting x_{q+1}
            drafts = [torch.cat([x.new_full((1,), -1), trunk.lm_head(g[0]).argmax(-1)]).tolist() for g in gs]
        n = len(seq)
        for k in range(1, max_k + 1):
            t = len(item["prompt_ids"])  # the target's first token came from prefill; drafting starts after it
            while t < n - 1:
                accepted = 0
                for d in range(1, k + 1):
                    q = t + d - 1
                    if q + 1 > n - 1 or drafts[d - 1][q] != seq[q + 1]:
                        break
                    accepted += 1
                steps[k] += 1
                tokens[k] += accepted + 1
                t += accepted + 1
    return {k: tokens[k] / steps[k] if steps[k] else float("nan") for k in tokens}


def engine_eval(model_dir: Path, prompts: list[str], max_tokens: int, max_k: int, deadline: float,
                acceptance_prompts: int) -> dict:
    """Greedy outputs of `prompts` and MTP acceptance over the first `acceptance_prompts` of them through
    hybridserve's engine (may raise where it cannot run); K = max_k first, the smaller K only while `deadline` (a
    perf_counter time) is not near."""
    from hybridserve import LLM, SamplingParams

    t0 = time.perf_counter()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    bare = LLM(str(model_dir), generation_config="none").generate(prompts, greedy)
    llm = LLM(str(model_dir))  # greedy under the checkpoint's shipped defaults (its repetition penalty), as served
    params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=max_tokens, temperature=0.0, seed=0)
    plain = llm.generate(prompts, params)
    del llm
    result: dict = {"texts": [o.text for o in plain], "finished": [o.finish_reason == "stop" for o in plain],
                    "bare_texts": [o.text for o in bare], "bare_finished": [o.finish_reason == "stop" for o in bare],
                    "sampling_defaults": {"repetition_penalty": params.repetition_penalty},
                    "acceptance_length": {}, "greedy_equal": {}}
    for k in [max_k, *range(1, max_k)]:
        if time.perf_counter() > deadline - 25.0:
            logger.warning("engine evaluation: time budget spent before K=%d", k)
            break
        llm = LLM(str(model_dir), speculative_config={"method": "mtp", "num_speculative_tokens": k})
        outs = llm.generate(prompts[:acceptance_prompts], params)
        result["acceptance_length"][k] = llm.engine.spec.metrics.acceptance_length
        result["greedy_equal"][k] = sum(o.token_ids == p.token_ids for o, p in zip(outs, plain)) / len(outs)
        del llm
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


@torch.no_grad()
def heldout_metrics(trunk, mtp: MTP, windows: torch.Tensor, batch_size: int, device: str, depths: int) -> dict:  # noqa: ANN001
    """Held-out trunk loss / top-1 and, per MTP depth, loss / top-1 over non-overlapping windows."""
    nan = float("nan")
    if windows.shape[0] == 0:
        return {"trunk_loss_nats_per_token": nan, "trunk_top1_accuracy": nan, "mtp_loss_nats_per_token": nan,
                "mtp_top1_accuracy": nan, "mtp_depths": [], "tokens": 0}
    trunk.eval()
    mtp.eval()
    nll = correct = n = 0.0
    d_nll, d_correct, d_n = [0.0] * depths, [0] * depths, [0] * depths
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device).long()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            loss, mtp_losses, logits, mtp_logits = forward_losses(trunk, mtp, batch, depths)
        count = batch[:, 1:].numel()
        nll += float(loss) * count
        correct += int((logits.argmax(-1) == batch[:, 1:]).sum())
        n += count
        for d in range(depths):
            target = batch[:, d + 2 :]
            d_nll[d] += float(mtp_losses[d]) * target.numel()
            d_correct[d] += int((mtp_logits[d].argmax(-1) == target).sum())
            d_n[d] += target.numel()
    trunk.train()
    mtp.train()
    per_depth = [{"depth": d + 1, "loss_nats_per_token": d_nll[d] / d_n[d], "top1_accuracy": d_correct[d] / d_n[d]}
                 for d in range(depths)]
    return {
        "trunk_loss_nats_per_token": nll / n,
        "trunk_top1_accuracy": correct / n,
        "mtp_loss_nats_per_token": per_depth[0]["loss_nats_per_token"],
        "mtp_top1_accuracy": per_depth[0]["top1_accuracy"],
        "mtp_depths": per_depth,
        "tokens": int(n),
    }


def evaluate_trained(report: dict, trunk, mtp, tokenizer, corpus, heldout_windows, train_stream,  # noqa: ANN001, PLR0913
                  args: argparse.Namespace, deadline: float, out_dir: Path, save) -> None:  # noqa: ANN001
    """Held-out loss, reload check, samples, parse rate and acceptance into `report` (phases skipped when the
    time budget is spent, and said so)."""
    device = args.device
    report["heldout"] = heldout_metrics(trunk, mtp, heldout_windows, args.batch_size, device, args.mtp_depths)
    logger.info("held-out (bf16 weights): %s", report["heldout"])
    from transformers import NemotronHForCausalLM as Loaded

    reloaded = Loaded.from_pretrained(str(out_dir), dtype=torch.float32).to(device).eval()
    probe = train_stream[:257][None].to(device).long()
    with torch.no_grad():
        diff = float((trunk(probe, use_cache=False).logits - reloaded(probe, use_cache=False).logits).abs().max())
    report["model"]["reload_max_logit_diff"] = diff
    logger.info("reloaded checkpoint: max |logit diff| %.2e", diff)
    del reloaded
    gen_budget = max(0.0, min(60.0, deadline - time.perf_counter() - 45.0))
    samples = greedy_hf(trunk, tokenizer, list(SAMPLE_PROMPTS), 64, device, gen_budget)
    report["samples"] = {s["prompt"]: s["text"] for s in samples}
    # heldout_prompts takes files in order, so the first N of the engine's set are the N-prompt set
    engine_prompts = heldout_prompts(corpus.heldout, max(args.eval_prompts, args.engine_eval_prompts))
    prompts = engine_prompts[: args.eval_prompts]
    gens = greedy_hf(trunk, tokenizer, prompts, args.gen_tokens, device,
                     max(0.0, min(40.0, deadline - time.perf_counter() - 60.0)))
    passed = [parses(g["prompt"], g["text"], g["finished"]) for g in gens]
    report["parse"] = {"prompts": len(prompts), "generated": len(gens), "max_tokens": args.gen_tokens,
                       "parse_rate": sum(passed) / max(1, len(gens)), "path": "transformers generate (greedy)",
                       "examples": [{"prompt": g["prompt"], "continuation": g["text"], "parses": ok}
                                    for g, ok in list(zip(gens, passed))[:6]]}
    logger.info("parse rate %.3f over %d held-out prompts", report["parse"]["parse_rate"], len(gens))
    acc = replay_acceptance(trunk, mtp, recurrent_mtp, gens, args.mtp_depths, device)
    report["acceptance"] = {"path": "replay of the greedy continuations through trunk + recurrent MTP",
                            "acceptance_length": acc}
    logger.info("MTP acceptance length (replay) %s", {k: round(v, 3) for k, v in acc.items()})
    save()  # the transformers-side numbers are on disk before the engine runs
    if args.no_engine_eval or not device.startswith("cuda"):
        return
    if deadline - time.perf_counter() < 40.0:
        logger.warning("no time left for the engine evaluation")
        report["engine"] = {"skipped": "time budget"}
        return
    del trunk, mtp
    torch.cuda.empty_cache()
    try:
        engine = engine_eval(out_dir, engine_prompts, args.gen_tokens, args.mtp_depths, deadline, args.eval_prompts)
    except Exception as exc:  # noqa: BLE001 - the engine numbers are extra; the report says why they are missing
        logger.warning("engine evaluation failed: %r", exc)
        report["engine"] = {"error": repr(exc)}
        return
    ok = [parses(p, t or "", f) for p, t, f in zip(engine_prompts, engine.pop("texts"), engine.pop("finished"))]
    engine["parse_rate"] = sum(ok) / max(1, len(ok))
    engine["prompts"] = len(engine_prompts)
    bare = [parses(p, t or "", f)
            for p, t, f in zip(engine_prompts, engine.pop("bare_texts"), engine.pop("bare_finished"))]
    engine["parse_rate_without_defaults"] = sum(bare) / max(1, len(bare))
    report["engine"] = engine
    logger.info("engine: parse rate %.3f, acceptance %s (%.0fs)", engine["parse_rate"], engine["acceptance_length"],
                engine["seconds"])


SAMPLE_PROMPTS = ("def fib(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):")
