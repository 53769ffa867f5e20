"""The demo model's model card (README.md) from its training report (bench/train_demo.py)."""

from __future__ import annotations


def model_card(report: dict, cfg: dict, mtp_kinds: list[str]) -> str:
    """The README.md of the checkpoint."""
    m, t, d = report["heldout"], report["train"], report["data"]
    a = report["args"]
    samples = "\n\n".join(f"```python\n{prompt}{text}\n```" for prompt, text in report["samples"].items())
    return f"""# hybridserve demo model: nemotron-h-pystdlib-demo

A small NemotronH (hybrid Mamba2 + attention + MLP) with one multi-token-prediction (MTP) step, trained
from scratch on the Python standard library's source code. It is `hybridserve`'s embedded default model:
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
| MTP | 1 step, layers {mtp_kinds}; `mtp.layers.0.{{enorm,hnorm,eh_proj}}`, shared embedding and lm_head |
| parameters | trunk {report['model']['trunk_params'] / 1e6:.2f} M, MTP {report['model']['mtp_params'] / 1e6:.2f} M |

The trunk is transformers' `NemotronHForCausalLM` (loads with `from_pretrained`, which ignores `mtp.*`).
MTP slot q (q >= 1) computes `u = eh_proj([enorm(embed(x_q)), hnorm(h_(q-1))])` from the trunk's final-normed
hidden state, then `u = u + mixer(norm(u))` per MTP layer (causal attention over the slots, no positional
embedding), `g = final_layernorm(u)`, and `lm_head(g)` predicts x_(q+1).

## Data

Every `*.py` file under `sysconfig.get_paths()["stdlib"]` of Python {d['python']} (`{d['stdlib']}`), sorted,
test suites included where the installation ships them, `site-packages` excluded, non-UTF-8 files skipped ({d['skipped_files']}). Files are
split by `b = sha256(relative path) % 100` into {d['heldout_files']} held-out files (b < {d['heldout_percent']},
{d['heldout_tokens'] / 1e3:.0f} k tokens; only for the numbers below), {d['validation_files']} validation files (the next
{d['validation_percent']} buckets; they pick the shipped step) and {d['train_files']} training files
({d['train_bytes'] / 1e6:.1f} MB, {d['train_tokens'] / 1e6:.2f} M tokens). Each file is followed by `<|endoftext|>`.

## Tokenizer

Byte-level BPE (GPT-2 pre-tokenization, no prefix space) with {cfg['vocab_size']} tokens trained with
`tokenizers` on the training files; `<|endoftext|>` (id {cfg['eos_token_id']}) is EOS, BOS and pad.
Loads with `transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)`.

## Training

```bash
{report['command']}
```

Seed {a['seed']}; {t['steps']} steps of {a['batch_size']} x {a['seq_len']} random windows
({t['tokens_seen'] / 1e6:.0f} M tokens); AdamW (betas 0.9/0.95, weight decay {a['weight_decay']} on matrices),
peak lr {a['lr']} with {a['warmup']} warmup steps and cosine decay to {a['min_lr']}, grad clip 1.0, bf16 autocast;
loss = CE(trunk) + {a['mtp_weight']} x CE(MTP), trained jointly; the weights of step {t['shipped_step']} (lowest
validation loss, evaluated every {a['eval_every']} steps) are shipped. The step count was sized to a
{a['time_budget_s']:.0f} s budget after timing the first steps. Device: {report['device']}; training loop
{t['train_time_s']} s, whole script {t['total_time_s']} s (tokenizer and encoding {t['tokenizer_and_encoding_s']} s).
torch {report['versions']['torch']}, transformers {report['versions']['transformers']},
tokenizers {report['versions']['tokenizers']}.

## Held-out results (bf16 weights, {m['tokens']} tokens of {d['heldout_files']} held-out files)

| | |
|---|---|
| trunk loss | {m['trunk_loss_nats_per_token']:.4f} nats/token |
| trunk top-1 accuracy | {m['trunk_top1_accuracy']:.4f} |
| MTP loss (predicting x_(q+1) from x_q, h_(q-1)) | {m['mtp_loss_nats_per_token']:.4f} nats/token |
| MTP top-1 accuracy | {m['mtp_top1_accuracy']:.4f} |

All numbers are also in `training_report.json`. The MTP loss covers slots q = 1..L-1 of each window
(windows hold L + 1 tokens, so the last slot has its target too).

## Limits

The data is small ({d['train_tokens'] / 1e6:.1f} M tokens; {t['tokens_seen'] / max(1, d['train_tokens']):.0f} epochs in
this run), so the model has memorized stdlib idioms rather than learned to program: greedy decoding repeats
itself and invents names. Mamba2 ran on transformers' PyTorch fallback (no `mamba_ssm` on the training
machine), which bounded the step count.

## Greedy samples

{samples}
"""
