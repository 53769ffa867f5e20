"""The demo model's model card (README.md) from its training report (tools/demo_model/train_demo.py)."""

from __future__ import annotations


def model_card(report: dict, cfg: dict, mtp_kinds: list[str]) -> str:
    """The README.md of the checkpoint."""
    m, t, d = report["heldout"], report["train"], report["data"]
    a = report["args"]
    samples = "\n\n".join(f"```python\n{prompt}{text}\n```" for prompt, text in report["samples"].items())
    return f"""# hybridserve demo model: nemotron-h-pycode-demo

A small NemotronH (hybrid Mamba2 + attention + MLP) with a multi-token-prediction (MTP) module, trained
from scratch{' (then fine-tuned against greedy loops)' if a.get('init_from') else ''} on Python source code (the standard library and {len(packages(d))} widely used packages). It is `hybridserve`'s embedded default model:
big enough to write plausible-looking Python, small enough ({report['model']['safetensors_mb']} MB in bf16)
to ship in the package. It is a demo, not a useful code model.

## Architecture

| | |
|---|---|
| layers | `{cfg['hybrid_override_pattern']}` (M = Mamba2, * = attention, - = MLP) |
| hidden size | {cfg['hidden_size']} |
| attention | {cfg['num_attention_heads']} heads x {cfg['head_dim']}, {cfg['num_key_value_heads']} KV heads, no positional embedding |
| Mamba2 | {cfg['mamba_num_heads']} heads x {cfg['mamba_head_dim']}, state {cfg['ssm_state_size']}, {cfg['n_groups']} groups, conv 4, chunk {cfg['chunk_size']} |
| MLP | relu2, intermediate {cfg['intermediate_size']} |
| vocabulary | {cfg['vocab_size']} (byte-level BPE) |
| MTP | one module (layers {mtp_kinds}) trained applied recurrently {a['mtp_depths']} times; `mtp.layers.0.{{enorm,hnorm,eh_proj}}`, shared embedding and lm_head |
| parameters | trunk {report['model']['trunk_params'] / 1e6:.2f} M, MTP {report['model']['mtp_params'] / 1e6:.2f} M |

The trunk is transformers' `NemotronHForCausalLM` (loads with `from_pretrained`, which ignores `mtp.*`).
MTP slot q (q >= 1) computes `u = eh_proj([enorm(embed(x_q)), hnorm(h_(q-1))])` from the trunk's final-normed
hidden state, then `u = u + mixer(norm(u))` per MTP layer (causal attention over the slots, no positional
embedding), `g = final_layernorm(u)`, and `lm_head(g)` predicts x_(q+1). Draft d >= 2 feeds draft d-1's `g`
in place of h, as the serving drafter does (`engine/mtp_drafter.py`); training unrolls the {a['mtp_depths']} depths
with the attention mask of the serving KV cache (depth-1 keys up to the chain's start, then the chain's own
draft keys), loss = CE(trunk) + {a['mtp_weight']} x sum of the depths' CE.

## Data

{data_text(d)} Files are split by `b = sha256(key) % 100` (key: the stdlib-relative path for stdlib files,
`<package>/<path>` otherwise) into {d['heldout_files']} held-out files (b < {d['heldout_percent']},
{d['heldout_tokens'] / 1e3:.0f} k tokens; only for the numbers below and the parse test's prompts),
{d['validation_files']} validation files (the next {d['validation_percent']} buckets; they pick the shipped step)
and {d['train_files']} training files ({d['train_bytes'] / 1e6:.1f} MB, {d['train_tokens'] / 1e6:.2f} M tokens).
Each file is followed by `<|endoftext|>`.

## Tokenizer

Byte-level BPE (GPT-2 pre-tokenization, no prefix space) with {cfg['vocab_size']} tokens trained with
`tokenizers` on the training files; `<|endoftext|>` (id {cfg['eos_token_id']}) is EOS, BOS and pad. Encoding with
special tokens (what the server does with a prompt) puts it in front, so a prompt reads as the start of a file.
In training, {report['args'].get('line_break_rate', 0.0):.0%} of line ends are encoded as piece boundaries (a lone newline token, then the
next line's indentation), which is how a prompt that ends in a newline is tokenized.
Loads with `transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)`.

## Training

```bash
{report['command']}
```

{finetune_text(a)}Seed {a['seed']}; {t['steps']} steps of {a['batch_size']} x {a['seq_len']} random windows
({t['tokens_seen'] / 1e6:.0f} M tokens); AdamW (betas 0.9/0.95, weight decay {a['weight_decay']} on matrices),
peak lr {a['lr']} with {a['warmup']} warmup steps and cosine decay to {a['min_lr']}, grad clip 1.0, bf16 autocast;
trunk and MTP trained jointly; {shipped_text(t, a)}. The step count was sized to a
{a['total_budget_s']:.0f} s budget for the whole script after timing the first steps. Device: {report['device']}; training loop
{t['train_time_s']} s, whole script {t['total_time_s']} s (tokenizer and encoding {t['tokenizer_and_encoding_s']} s).
torch {report['versions']['torch']}, transformers {report['versions']['transformers']},
tokenizers {report['versions']['tokenizers']}.

## Held-out results (bf16 weights, {m['tokens']} tokens of {d['heldout_files']} held-out files)

| | |
|---|---|
| trunk loss | {m['trunk_loss_nats_per_token']:.4f} nats/token |
| trunk top-1 accuracy | {m['trunk_top1_accuracy']:.4f} |
{depth_rows(m)}
| parse rate of greedy continuations | {parse_line(report)} |
| MTP acceptance length, K = 1 / 2 / 3 | {acceptance_line(report)} |

The parse test: the header (signature, docstring) of {report['parse'].get('prompts', 0)} short top-level functions of
held-out files; greedy continuation of up to {report['parse'].get('max_tokens', 0)} tokens, stopped at the next top-level
`def` / `class` / `@` / `if __name__` line or EOS, else cut at its last complete line; it passes when
`ast.parse(prompt + continuation)` succeeds. Acceptance: {report['acceptance'].get('path', '-')}{engine_line(report)}.

All numbers are also in `training_report.json`. The MTP loss covers slots q = 1..L-1 of each window
(windows hold L + 1 tokens, so the last slot has its target too).

## Limits

{d['train_tokens'] / 1e6:.1f} M training tokens seen {t['tokens_seen'] / max(1, d['train_tokens']):.1f} times by a
{(report['model']['trunk_params'] + report['model']['mtp_params']) / 1e6:.0f} M-parameter model: it writes
plausible-looking Python with invented names and repeats itself under greedy decoding; it is not a useful code
model. {"The Mamba2 scan trained through mamba_ssm's Triton kernels (forward and backward; `tools/demo_model/train_demo_scan.py`)." if t.get('triton_scan') else "Mamba2 ran on transformers' PyTorch fallback (no `mamba_ssm` sources carried), which bounded the step count."}

{package_table(d)}
## Greedy samples

{samples}
"""


def shipped_text(t: dict, a: dict) -> str:
    """Which step's weights ship: the lowest validation loss of the periodic evaluations, or the last step."""
    if not a.get("eval_every"):
        return f"the weights of the last step ({t['shipped_step']}) are shipped"
    return (f"the weights of step {t['shipped_step']} (lowest validation loss, evaluated every {a['eval_every']} "
            "steps) are shipped")


def finetune_text(a: dict) -> str:
    """The fine-tuning paragraph of a run that started from a checkpoint (--init-from), else nothing."""
    if not a.get("init_from"):
        return ""
    ditto = (f" Each step also trained {a['ditto_batch']} pseudo-repetitive windows (real code, then one span of 1-2 "
             f"real lines repeated to the window's end) with DITTO's loss (lambda {a['ditto_lambda']}, weight "
             f"{a['ditto_weight']}; `tools/demo_model/train_demo_ditto.py`), which teaches the model that a line's repetition "
             "becomes less likely with each copy: the greedy loops that fail the parse test." if a.get("ditto_batch") else "")
    return f"Fine-tuned from `{a['init_from']}` (its weights, shapes and tokenizer).{ditto}\n\n"


def packages(d: dict) -> list[dict]:
    return list((d.get("manifest") or {}).get("packages", []))


def data_text(d: dict) -> str:
    man = d.get("manifest")
    if not man:
        return (f"Every `*.py` file under `sysconfig.get_paths()['stdlib']` of Python {d['python']} "
                f"(`{d['corpus']}`), sorted, `site-packages` excluded, non-UTF-8 files skipped ({d['skipped_files']}).")
    corpus = "/".join(d["corpus"].split("/")[-2:])  # .demo_data/<archive>: where train_demo_fetch.py puts it
    return (f"`{corpus}`, built by `python tools/demo_model/train_demo_fetch.py`: the standard library of Python "
            f"{man['python']} ({man['stdlib']['files']} files) and the `*.py` files of {len(man['packages'])} "
            f"pinned wheels from PyPI (`pip download --no-deps`; table below), {man['files']} files and "
            f"{man['bytes'] / 1e6:.1f} MB in all; vendored copies (`_vendor/`), files over 256 KB and exact "
            f"duplicates dropped; wheels whose licence is not permissive were left out "
            f"({', '.join(x['name'] for x in man['excluded']) or 'none'}).")


def package_table(d: dict) -> str:
    rows = packages(d)
    if not rows:
        return ""
    body = "\n".join(f"| {r['name']} | {r['version']} | {r['licence']} | {r['files']} |" for r in rows)
    return "## Packages in the data\n\n| package | version | licence | files |\n|---|---|---|---|\n" + body + "\n"


def depth_rows(m: dict) -> str:
    return "\n".join(f"| MTP depth {x['depth']} loss / top-1 (predicting {x['depth'] + 1} tokens ahead of h) | "
                     f"{x['loss_nats_per_token']:.4f} / {x['top1_accuracy']:.4f} |" for x in m.get("mtp_depths", []))


def parse_line(report: dict) -> str:
    p = report.get("parse") or {}
    line = f"{p.get('parse_rate', float('nan')):.3f} ({p.get('generated', 0)} prompts, transformers greedy)"
    engine = report.get("engine") or {}
    if "parse_rate" in engine:
        penalty = (engine.get("sampling_defaults") or {}).get("repetition_penalty", 1.0)
        line += (f"; {engine['parse_rate']:.3f} through hybridserve's engine ({engine.get('prompts', '?')} prompts, "
                 f"greedy, repetition_penalty {penalty}")
        line += " from generation_config.json)"
        if "parse_rate_without_defaults" in engine:
            line += f", {engine['parse_rate_without_defaults']:.3f} with plain greedy"
    return line


def acceptance_line(report: dict) -> str:
    acc = (report.get("acceptance") or {}).get("acceptance_length", {})
    line = " / ".join(f"{acc[k]:.2f}" for k in sorted(acc)) + " (replay)" if acc else "-"
    engine = (report.get("engine") or {}).get("acceptance_length")
    if engine:
        line += "; " + " / ".join(f"{engine[k]:.2f}" for k in sorted(engine)) + " (hybridserve engine, greedy)"
    return line


def engine_line(report: dict) -> str:
    engine = report.get("engine")
    if not engine:
        return "; the engine was not run"
    if "acceptance_length" in engine:
        return (f"; and through hybridserve's engine (`LLM(speculative_config=mtp, K)`, greedy, the same prompts; "
                f"greedy output equal to the non-speculative run for {engine['greedy_equal']} of the prompts)")
    return f"; the engine evaluation did not run: {engine}"
