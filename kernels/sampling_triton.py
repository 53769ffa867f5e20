"""Triton Gumbel-max sampling: one token per row of logits [R, V] in two small launches (the reference and the
method: `sampling.py`).

The step's sampling tail was ~12 eager kernels after the forward (a gather of the sampled rows, the tempered
softmax, a cumulative sum, a search, the scatter back), ~75 us of GPU time for a few rows of a 131K vocabulary:
torch's softmax runs one block per row, so a batch of 5 rows streamed through 5 SMs. Here each row's vocabulary
is split over enough programs to fill the device; each keeps the best (key, index) of its span, with Philox noise
drawn in place (`tl.rand(seed, token index)`: no noise tensor); a second launch picks each row's best span. No
library on our stack offers this (FlashInfer's samplers take their own RNG state and are not a dependency).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hybridserve.kernels.triton_utils import cdiv, check_same_device

BLOCK = 1024  # tokens per program iteration
MAX_SPLITS = 256  # spans per row (the second launch reads them all in one block)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


# the integer arguments change with the batch size: not specialised on, so one compile (at warm-up) serves them all
@triton.jit(do_not_specialize=["V", "stride_row", "SPAN", "SPLITS"])
def _gumbel_span_kernel(logits_ptr, rows_ptr, key_ptr, index_ptr, V, stride_row, SPAN, SPLITS,
                        BLOCK: tl.constexpr):
    """Program (r, s): the best key logits * inv_t + Gumbel noise (greedy: the logit) over tokens
    [s * SPAN, (s + 1) * SPAN) of row r, and its first index, into key[r, s], index[r, s]."""
    row = tl.program_id(0)
    span = tl.program_id(1)
    inv_t = tl.load(rows_ptr + 2 * row).to(tl.float32, bitcast=True)
    seed = tl.load(rows_ptr + 2 * row + 1)
    noisy = inv_t != 0.0
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    start = span * SPAN
    for offset in range(0, SPAN, BLOCK):
        tokens = start + offset + tl.arange(0, BLOCK)
        valid = tokens < V
        x = tl.load(logits_ptr + row * stride_row + tokens, mask=valid, other=float("-inf")).to(tl.float32)
        uniform = tl.rand(seed, tokens)  # [0, 1); 0 gives -inf noise: never drawn
        gumbel = -tl.log(-tl.log(uniform))
        key = x * tl.where(noisy, inv_t, 1.0) + tl.where(noisy, gumbel, 0.0)  # no -inf * 0
        key = tl.where(valid, key, float("-inf"))
        better = key > best  # strict: an earlier token keeps its place on a tie
        best = tl.where(better, key, best)
        best_index = tl.where(better, tokens, best_index)
    top = tl.max(best, axis=0)
    # the first index among lanes holding the maximum (a lane that never beat -inf holds index 0 or its own)
    first = tl.min(tl.where(best == top, best_index, V), axis=0)
    first = tl.where(top == float("-inf"), start, first)  # an all -inf span: its first token, as torch.argmax
    tl.store(key_ptr + row * SPLITS + span, top)
    tl.store(index_ptr + row * SPLITS + span, first)


@triton.jit(do_not_specialize=["SPLITS"])
def _best_span_kernel(key_ptr, index_ptr, out_ptr, SPLITS, BLOCK_S: tl.constexpr):
    """Program r: the token of row r's best span (the first span on a tie: spans are in token order)."""
    row = tl.program_id(0)
    spans = tl.arange(0, BLOCK_S)
    valid = spans < SPLITS
    key = tl.load(key_ptr + row * SPLITS + spans, mask=valid, other=float("-inf"))
    index = tl.load(index_ptr + row * SPLITS + spans, mask=valid, other=0)
    top = tl.max(key, axis=0)
    first_span = tl.min(tl.where(valid & (key == top), spans, BLOCK_S), axis=0)
    token = tl.sum(tl.where(spans == first_span, index, 0), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


def spans_for(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(span, splits): each row's vocabulary in `splits` spans of `span` tokens (a multiple of BLOCK), enough
    programs for about four per SM, none empty."""
    splits = max(1, min(MAX_SPLITS, cdiv(4 * _num_sms(device), rows), cdiv(vocab, BLOCK)))
    span = cdiv(cdiv(vocab, splits), BLOCK) * BLOCK
    return span, cdiv(vocab, span)


def gumbel_sample_triton(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (fp32 / bf16 / fp16, unit stride in V), rows [R, 2] int32 from `sampling.pack_rows` ->
    token ids [R] int64, without a host sync."""
    if logits.dim() != 2 or rows.shape != (logits.shape[0], 2) or rows.dtype != torch.int32:
        raise ValueError(f"logits [R, V] and int32 rows [R, 2] expected, got {tuple(logits.shape)} and "
                         f"{tuple(rows.shape)} {rows.dtype}")
    check_same_device(logits, rows)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    span, splits = spans_for(num_rows, vocab, logits.device)
    keys = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    indices = torch.empty(num_rows, splits, dtype=torch.int32, device=logits.device)
    _gumbel_span_kernel[(num_rows, splits)](logits, rows.contiguous(), keys, indices, vocab, logits.stride(0), span,
                                            splits, BLOCK=BLOCK, num_warps=4)
    _best_span_kernel[(num_rows,)](keys, indices, out, splits, BLOCK_S=MAX_SPLITS, num_warps=1)
    return out
