"""Anti-loop training for the demo model (tools/demo_model/train_demo.py --ditto-batch): the published DITTO recipe (Xu et al.,
"Learning to Break the Loop", NeurIPS 2022) on Python source.

Why: every parse-test failure of the demo model is a greedy loop (a line repeated until the token limit), and
better-trained models of the same size loop more (bench/results/h200/demo_model/). DITTO shows a
model pseudo-repetitive sequences -- real context, then one span of real lines repeated until the window is full --
and trains the probability of each token of copy n to be lambda times (a constant fraction of) its probability in
copy n-1, instead of the rising, self-reinforcing probability that makes greedy decoding loop:

    loss_t = -log(1 - |p(x_t | x_<t) - lambda * sg(p(x_(t-m) | x_<(t-m)))|)      for t in copies 2.. (span m tokens)

The ordinary language-model loss on real windows is trained alongside in the same steps, so fluency stays.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def newline_token_mask(tokenizer, vocab: int) -> np.ndarray:  # noqa: ANN001 - PreTrainedTokenizerFast
    """[vocab] bool: the token's text ends a line (contains a newline): where repeated spans start and end."""
    mask = np.zeros(vocab, dtype=bool)
    for token_id in range(min(vocab, len(tokenizer))):
        mask[token_id] = "\n" in tokenizer.decode([token_id])
    if not mask.any():
        raise ValueError("the tokenizer has no token containing a newline: DITTO spans are whole lines")
    return mask


def pseudo_batch(stream: np.ndarray, newline: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator,
                 max_lines: int = 2, span_tokens: tuple[int, int] = (4, 48)) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` pseudo-repetitive windows of seq_len + 1 tokens -> (tokens [B, L+1] int64, prev [B, L] int64).

    Each window: a real prefix of the training stream ending at a line end, then the next 1..max_lines lines of
    the stream (a span of m tokens, span_tokens[0] <= m <= span_tokens[1]) repeated to fill the window. prev[b, i]
    is, for the target tokens[b, i + 1] inside the second or later copy, the target index i - m of the same token
    in the previous copy; -1 elsewhere (no DITTO loss)."""
    tokens = np.empty((batch, seq_len + 1), dtype=np.int64)
    prev = np.full((batch, seq_len), -1, dtype=np.int64)
    lo, hi = span_tokens
    filled = 0
    while filled < batch:
        start = int(rng.integers(0, stream.size - 2 * seq_len))
        window = stream[start : start + 2 * seq_len]
        ends = np.flatnonzero(newline[window])  # positions of line-ending tokens
        prefix_len = int(rng.integers(16, seq_len // 2))
        after = ends[ends >= prefix_len - 1]
        lines = int(rng.integers(1, max_lines + 1))
        if after.size <= lines:
            continue
        span_start, span_end = int(after[0]) + 1, int(after[lines]) + 1  # the span: whole lines after the prefix
        m = span_end - span_start
        if not lo <= m <= hi or span_start + 2 * m > seq_len + 1:
            continue
        copies = (seq_len + 1 - span_start) // m + 1
        row = np.concatenate([window[:span_start], np.tile(window[span_start:span_end], copies)])[: seq_len + 1]
        tokens[filled] = row
        targets = np.arange(span_start + m, seq_len + 1)  # token indices in copies 2..
        prev[filled, targets - 1] = targets - 1 - m
        filled += 1
    return torch.from_numpy(tokens), torch.from_numpy(prev)


def ditto_loss(trunk, tokens: torch.Tensor, prev: torch.Tensor, lam: float) -> torch.Tensor:  # noqa: ANN001
    """DITTO's loss over the targets of repeated copies: tokens [B, L+1], prev [B, L] (pseudo_batch's) -> scalar."""
    logits = trunk(input_ids=tokens[:, :-1], use_cache=False).logits.float()  # [B, L, V]
    prob = torch.softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, L] p(target)
    valid = prev >= 0
    previous = prob.detach().gather(1, prev.clamp_min(0))  # [B, L] p of the same token one copy earlier
    gap = (prob - lam * previous).abs()
    per_token = -torch.log((1.0 - gap).clamp_min(1e-5))
    return (per_token * valid).sum() / valid.sum().clamp_min(1)


def load_initial(model_dir: Path, device: str):  # noqa: ANN201 - (trunk, mtp state dict, MTP layer kinds)
    """A demo checkpoint to start from (trunk in fp32, the `mtp.*` tensors, its MTP layer kinds): what --init-from
    reads; the trunk's config carries the shapes."""
    from safetensors.torch import load_file
    from transformers import NemotronHForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    kinds = config.get("mtp_layers_block_type")
    if not kinds:
        raise ValueError(f"{model_dir}: config.json has no mtp_layers_block_type; --init-from needs a demo checkpoint "
                         "with its MTP module (tools/demo_model/train_demo.py's output)")
    trunk = NemotronHForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    mtp_state = {name.removeprefix("mtp."): t.float() for name, t in load_file(str(model_dir / "model.safetensors")).items()
                 if name.startswith("mtp.")}
    return trunk, mtp_state, list(kinds)

