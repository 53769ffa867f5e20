"""Paged attention with Nemotron-Nano-9B-v2 attention shapes (40 query heads, 8 KV heads, head_dim 128, bf16,
page 16): our Triton kernel vs torch SDPA on KV gathered from the pages, SDPA on contiguous KV (the no-paging
ideal) and compiled flex_attention, for decode (T=1), verify (T=4) and one prefill on a cached prefix.

`bench_attention(ceil, median_ms, quick)` is called by bench/kernels/kernel_table.py. The input builders and every variant
also run on the CPU (tests/bench/test_attention_bench.py checks that all of them compute the same attention as
`paged_attention_ref`). Decode / verify variants are timed as CUDA-graph replays where they can be captured.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from cuda_graph import capture
from torch.nn.attention.bias import causal_lower_right

HQ, HKV, DH, PAGE = 40, 8, 128, 16
BATCHES = (1, 32, 128)
CONTEXTS = (512, 4096, 32768)  # cached tokens before the T new ones
MAX_KV_BYTES = 8e9  # combos reading more K+V than this are skipped
PREFILL_NEW, PREFILL_PREFIX = 4096, 4096
VARIANTS = ("ours", "gather_sdpa", "sdpa", "flex")


@dataclass
class AttnInputs:
    """One attention problem, both paged and contiguous: every sequence has T new tokens and kv_len keys."""

    q: torch.Tensor  # [B * T, Hq, Dh] packed queries
    k_pages: torch.Tensor  # [num_pages, page, Hkv, Dh]
    v_pages: torch.Tensor
    cu_seqlens: torch.Tensor  # [B + 1]
    kv_lens: torch.Tensor  # [B], all kv_len
    block_tables: torch.Tensor  # [B, pages_per_seq] scattered pages
    k: torch.Tensor  # [B, Hkv, kv_len, Dh] contiguous copy of the same keys
    v: torch.Tensor
    scale: float
    T: int
    kv_len: int

    def ref_args(self) -> tuple:
        """Positional arguments of `paged_attention_ref` / `paged_attention_triton`."""
        return (self.q, self.k_pages, self.v_pages, self.cu_seqlens, self.kv_lens, self.block_tables, self.scale)


def gather_pages(pages: torch.Tensor, block_tables: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Keys (or values) of every sequence from its pages into a new tensor: [B, Hkv, kv_len, Dh] (strided view
    of a [B, pages * page, Hkv, Dh] copy; SDPA takes it as is)."""
    batch, num = block_tables.shape
    gathered = pages[block_tables]  # [B, pages_per_seq, page, Hkv, Dh]
    return gathered.reshape(batch, num * pages.shape[1], *pages.shape[2:])[:, :kv_len].transpose(1, 2)


def make_inputs(batch: int, T: int, kv_len: int, hq: int = HQ, hkv: int = HKV, dh: int = DH, page: int = PAGE,
                dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda", seed: int = 0) -> AttnInputs:
    """Random queries and a paged cache whose pages are scattered (a random permutation), plus contiguous KV."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = -(-kv_len // page)
    num_pages = batch * pages_per_seq
    k_pages = torch.randn(num_pages, page, hkv, dh, generator=gen, device=device, dtype=dtype)
    v_pages = torch.randn(num_pages, page, hkv, dh, generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(num_pages, generator=gen, device=device).view(batch, pages_per_seq)
    q = torch.randn(batch * T, hq, dh, generator=gen, device=device, dtype=dtype)
    return AttnInputs(
        q=q, k_pages=k_pages, v_pages=v_pages,
        cu_seqlens=torch.arange(0, batch * T + 1, T, device=device),
        kv_lens=torch.full((batch,), kv_len, device=device), block_tables=tables,
        k=gather_pages(k_pages, tables, kv_len).contiguous(), v=gather_pages(v_pages, tables, kv_len).contiguous(),
        scale=dh**-0.5, T=T, kv_len=kv_len,
    )


def _bhtd(q: torch.Tensor, T: int) -> torch.Tensor:
    """[B * T, Hq, Dh] -> [B, Hq, T, Dh] (a view)."""
    return q.view(-1, T, *q.shape[1:]).transpose(1, 2)


def _packed(out: torch.Tensor) -> torch.Tensor:
    """[B, Hq, T, Dh] -> [B * T, Hq, Dh]."""
    return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[3])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, T: int, scale: float) -> torch.Tensor:
    """SDPA of [B * T, Hq, Dh] queries on [B, Hkv, L, Dh] KV; the T queries are the last T positions (causal
    aligned bottom-right), GQA through enable_gqa (no repeated KV)."""
    mask = None if T == 1 else causal_lower_right(T, k.shape[2])
    return _packed(F.scaled_dot_product_attention(_bhtd(q, T), k, v, attn_mask=mask, scale=scale, enable_gqa=True))


def ours_fn(inp: AttnInputs) -> Callable[[], torch.Tensor]:
    """Our Triton paged attention (decode path for T <= 16, host-synced prefill path above)."""
    from hybridserve.kernels.paged_attention_triton import paged_attention_triton

    hint = inp.T if inp.T <= 16 else None
    return lambda: paged_attention_triton(*inp.ref_args(), max_query_len=hint)


def gather_sdpa_fn(inp: AttnInputs) -> Callable[[], torch.Tensor]:
    """Gather K and V from the pages into contiguous tensors, then SDPA (the gather is part of the time)."""
    def run() -> torch.Tensor:
        k = gather_pages(inp.k_pages, inp.block_tables, inp.kv_len)
        v = gather_pages(inp.v_pages, inp.block_tables, inp.kv_len)
        return sdpa(inp.q, k, v, inp.T, inp.scale)
    return run


def sdpa_fn(inp: AttnInputs) -> Callable[[], torch.Tensor]:
    """SDPA on KV that is already contiguous: the ideal without paging."""
    return lambda: sdpa(inp.q, inp.k, inp.v, inp.T, inp.scale)


def flex_fn(inp: AttnInputs, compiled: bool) -> Callable[[], torch.Tensor]:
    """flex_attention on contiguous KV (block mask built outside the timed call); compiled on the GPU."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T, L = inp.T, inp.kv_len
    block_mask = None
    if T > 1:
        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx <= q_idx + (L - T)
        block_mask = create_block_mask(causal, None, None, T, L, device=inp.q.device)
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    q = _bhtd(inp.q, T)
    return lambda: _packed(flex(q, inp.k, inp.v, block_mask=block_mask, scale=inp.scale, enable_gqa=True))


def variant_fns(inp: AttnInputs, compiled_flex: bool) -> dict[str, Callable[[], Callable[[], torch.Tensor]]]:
    """Builders (setup outside the timing) of every variant's timed call, by name."""
    return {"ours": lambda: ours_fn(inp), "gather_sdpa": lambda: gather_sdpa_fn(inp), "sdpa": lambda: sdpa_fn(inp),
            "flex": lambda: flex_fn(inp, compiled_flex)}


def _graph_ms(fn: Callable[[], Any], median_ms: Callable[..., float], quick: bool) -> float:
    """Median time of fn replayed as a CUDA graph (no launch overhead, as in the decode step)."""
    return median_ms(capture(fn).replay, quick)


def io_bytes(inp: AttnInputs) -> tuple[int, int]:
    """(K + V bytes read, q + out bytes) of one call."""
    kv = 2 * inp.k.numel() * inp.k.element_size()
    return kv, 2 * inp.q.numel() * inp.q.element_size()


def _time_variants(inp: AttnInputs, row: dict, median_ms: Callable[..., float], quick: bool, graphs: bool,
                   ref: torch.Tensor) -> None:
    """Time every variant into row (`<name>_us`, eager and graph), with its error text if it failed."""
    for name, build in variant_fns(inp, compiled_flex=True).items():
        try:
            if name == "flex":
                torch._dynamo.reset()  # every row compiles its own static shape (no recompile limit, no dynamic)
            start = time.perf_counter()
            fn = build()
            out = fn()  # compiles / autotunes
            torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.perf_counter() - start
            row[f"{name}_max_diff_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
            del out
            row[f"{name}_eager_us"] = median_ms(fn, quick) * 1e3
            row[f"{name}_us"] = row[f"{name}_eager_us"]
            if graphs and name != "flex":  # compiled flex keeps host-side guards: timed eagerly
                row[f"{name}_graph_us"] = _graph_ms(fn, median_ms, quick) * 1e3
                row[f"{name}_us"] = min(row[f"{name}_us"], row[f"{name}_graph_us"])
        except Exception as exc:  # noqa: BLE001 - a variant that does not run is a result too
            row[f"{name}_error"] = f"{exc!r}"[:800]
            print(f"  {name} failed: {traceback.format_exc(limit=3)[-800:]}", flush=True)
        torch.cuda.empty_cache()


def _finish(row: dict, names: tuple[str, ...]) -> dict:
    """Add the fastest variant, each variant's multiple of the floor, and print the row on one line."""
    times = {n: row[f"{n}_us"] for n in names if f"{n}_us" in row}
    row["fastest"] = min(times, key=times.get) if times else None
    for n, us in times.items():
        row[f"{n}_over_floor"] = us / row["floor_us"]
    shown = "  ".join(f"{n} {us:9.1f}" for n, us in times.items())
    errors = " ".join(f"{n}=ERR" for n in names if f"{n}_error" in row)
    print(f"attn {row['mode']:7s} b={row['batch']:<4d} ctx={row['context']:<6d} T={row['T']:<5d} {shown} us  "
          f"floor {row['floor_us']:8.1f} us  fastest {row['fastest']} {errors}", flush=True)
    return row


def bench_attention(ceil: dict, median_ms: Callable[..., float], quick: bool) -> list[dict]:
    """Decode / verify at batch 1, 32, 128 x contexts 512, 4K, 32K, and one 4K-token prefill on a 4K prefix:
    each variant's time (us) beside the bytes floor, the fastest, and errors of variants that failed."""
    rows: list[dict] = []
    for T, mode in ((1, "decode"), (4, "verify")):
        for batch in BATCHES:
            for context in CONTEXTS:
                kv_bytes = 2 * batch * (context + T) * HKV * DH * 2
                if kv_bytes > MAX_KV_BYTES:
                    print(f"attn {mode} b={batch} ctx={context}: skipped ({kv_bytes / 1e9:.1f} GB of KV)", flush=True)
                    continue
                inp = make_inputs(batch, T, context + T, seed=batch + context + T)
                kv, qo = io_bytes(inp)
                row: dict[str, Any] = {"mode": mode, "batch": batch, "context": context, "T": T, "kv_bytes": kv,
                                       "qo_bytes": qo, "floor_us": (kv + qo) / ceil["copy_GBps"] / 1e3}
                ref = sdpa_fn(inp)()
                _time_variants(inp, row, median_ms, quick, graphs=True, ref=ref)
                rows.append(_finish(row, VARIANTS))
                del inp, ref
                torch.cuda.empty_cache()
    rows.append(bench_prefill(ceil, median_ms, quick))
    return rows


def bench_prefill(ceil: dict, median_ms: Callable[..., float], quick: bool) -> dict:
    """One PREFILL_NEW-token sequence on a PREFILL_PREFIX-token cached prefix: ours vs SDPA on gathered KV
    (and on contiguous KV); the floor is the larger of the bytes floor and the causal matmul floor."""
    T, L = PREFILL_NEW, PREFILL_PREFIX + PREFILL_NEW
    inp = make_inputs(1, T, L, seed=7)
    kv, qo = io_bytes(inp)
    flops = 4 * HQ * DH * T * (PREFILL_PREFIX + (T + 1) / 2)  # QK^T and PV over the visible keys only
    row: dict[str, Any] = {"mode": "prefill", "batch": 1, "context": PREFILL_PREFIX, "T": T, "kv_bytes": kv,
                           "qo_bytes": qo, "flops": flops, "bytes_floor_us": (kv + qo) / ceil["copy_GBps"] / 1e3}
    row["flops_floor_us"] = flops / ceil["bf16_matmul_TFLOPs"] / 1e6 if "bf16_matmul_TFLOPs" in ceil else 0.0
    row["floor_us"] = max(row["bytes_floor_us"], row["flops_floor_us"])
    ref = sdpa_fn(inp)()
    builders = {"ours": lambda: ours_fn(inp), "gather_sdpa": lambda: gather_sdpa_fn(inp), "sdpa": lambda: sdpa_fn(inp)}
    for name, build in builders.items():
        try:
            fn = build()
            row[f"{name}_max_diff_vs_sdpa"] = float((fn().float() - ref.float()).abs().max())
            row[f"{name}_us"] = median_ms(fn, quick) * 1e3  # eager: the prefill path syncs with the host
        except Exception as exc:  # noqa: BLE001 - record and keep going
            row[f"{name}_error"] = f"{exc!r}"[:800]
    del inp, ref
    torch.cuda.empty_cache()
    return _finish(row, tuple(builders))
