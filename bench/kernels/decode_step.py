"""Whole-model decode step with Nemotron-Nano-9B-v2 shapes and random bf16 weights, eager and as a CUDA graph.

The step is the forward of one new token per sequence (512 tokens of context each) plus the lm_head; its floor
is the weight bytes read once (embedding rows aside) over copy bandwidth, plus the Mamba state read + write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.state_cache import CacheLayout, StateCache

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "nemotron-nano-9b-v2.json"
CONTEXT = 512
PAGE = 16


def random_model(config: ModelConfig) -> HybridLM:
    """HybridLM on the GPU in bf16 with random weights in sane ranges (decays in (0, 1), unit norms)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = HybridLM(config)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, device="cuda", generator=gen) * 15 + 1))
        elif name.endswith("dt_bias"):
            p.copy_(torch.rand(p.shape, device="cuda", generator=gen) - 4)
        elif name.endswith(("D", "norm.weight")) or "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0, 0.02, generator=gen)
    return model


def decode_batch(batch: int, pages_per_seq: int) -> ForwardBatch:
    """`batch` sequences with CONTEXT cached tokens each, one new token each (decode rows only)."""
    dev = torch.device("cuda")
    tables = torch.arange(batch * pages_per_seq, device=dev).view(batch, pages_per_seq)
    return ForwardBatch(
        num_decode=batch,
        query_lens=(1,) * batch,
        cu_seqlens=torch.arange(batch + 1, device=dev),
        context_lens=torch.full((batch,), CONTEXT, device=dev),
        kv_lens=torch.full((batch,), CONTEXT + 1, device=dev),
        state_slots=torch.arange(batch, device=dev),
        block_tables=tables,
        slot_mapping=tables[:, CONTEXT // PAGE] * PAGE + CONTEXT % PAGE,
    )


def bench_decode_step(ceil: dict, median_ms: Callable[[Callable[[], Any]], float], quick: bool) -> list[dict]:
    """Per batch size: eager and CUDA-graph step times beside the weight-read (+ state) floor."""
    config = ModelConfig.from_hf_dict(json.loads(CONFIG.read_text()))
    model = random_model(config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embeddings.weight.numel() * model.embeddings.weight.element_size()
    rows = []
    for batch in (1, 32):
        pages_per_seq = CONTEXT // PAGE + 1
        layout = CacheLayout(num_pages=batch * pages_per_seq, page_size=PAGE, num_slots=batch,
                             conv_width=config.mamba.conv_kernel - 1)
        cache = StateCache(config, layout, torch.bfloat16, torch.float32, torch.device("cuda"))
        for t in (cache.k_pages, cache.v_pages, cache.conv_states, cache.ssm_states):
            t.normal_(0, 0.1)
        fb = decode_batch(batch, pages_per_seq)
        ids = torch.randint(0, config.vocab_size, (batch,), device="cuda")

        def step() -> torch.Tensor:
            return model.compute_logits(model(ids, fb, cache))

        state_bytes = 2 * batch * (cache.ssm_states[0].numel() * 4 + cache.conv_states[0].numel() * 2)
        floor_ms = weight_bytes / ceil["copy_GBps"] / 1e6
        row: dict[str, Any] = {"batch": batch, "weight_GB": weight_bytes / 1e9, "weight_floor_ms": floor_ms,
                               "state_GB": state_bytes / 1e9,
                               "floor_ms": (weight_bytes + state_bytes) / ceil["copy_GBps"] / 1e6}
        row["eager_ms"] = median_ms(step, quick)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            row["graph_ms"] = median_ms(graph.replay, quick)
            row["graph_over_floor"] = row["graph_ms"] / row["floor_ms"]
        except Exception as exc:  # noqa: BLE001 - report why the step could not be captured
            row["graph_error"] = repr(exc)[:500]
        row["eager_over_floor"] = row["eager_ms"] / row["floor_ms"]
        if batch == 1:  # where the time goes: per-kernel GPU time of one eager step
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50)
            row["profile_eager_step"] = table
            print(table, flush=True)
        rows.append(row)
        print("decode " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        del cache
    return rows
