"""Small pools: requests queue instead of being capped, eviction and preemption keep the tokens of cold
runs, and a request that can never fit is refused when it is added."""

from __future__ import annotations

import pytest
import torch
from checkpoints import random_prompts
from prefix_cases import cold_tokens, greedy, model_dir, warm_llm

from hybridserve import SamplingParams
from hybridserve.common.model_config import ModelConfig
from hybridserve.statepool.sizing import PoolRequest, plan_cache_layout
from hybridserve.statepool.state_cache import CacheLayout


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_more_requests_than_slots_queue_and_finish(kind: str) -> None:
    llm = warm_llm(kind, max_num_seqs=2, num_checkpoint_slots=2)
    system, *tails = random_prompts([20, 5, 13, 2, 30, 8, 17, 1], vocab=128, seed=21)
    prompts = [system + t for t in tails]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(5))
    assert [o.token_ids for o in outs] == [cold_tokens(kind, tuple(p), 5) for p in prompts]
    assert all(o.finished for o in outs)
    pool = llm.engine.pool
    pool.check()
    assert pool.slots.num_free == 2 and pool.checkpoints.num_used <= 2


def test_page_pressure_evicts_cache_and_preempts_without_changing_tokens() -> None:
    # 9 pages of 8 tokens: two 52-token requests that share 3 pages do not fit together
    llm = warm_llm("nemotron_h", num_kv_pages=9, num_checkpoint_slots=3, prefill_chunk_size=32)
    system, *tails = random_prompts([24, 16, 16, 16, 9], vocab=128, seed=22)
    prompts = [system + t for t in tails]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(12))
    assert [o.token_ids for o in outs] == [cold_tokens("nemotron_h", tuple(p), 12) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0
    pool = llm.engine.pool
    pool.check()
    llm.engine.reset_prefix_cache()
    assert pool.pages.num_free == 9 and pool.checkpoints.num_free == pool.checkpoints.capacity == 3 + 4


def test_request_larger_than_the_pool_is_refused_at_add_time() -> None:
    llm = warm_llm("nemotron_h", num_kv_pages=4)  # 32 tokens of KV in all
    prompt = random_prompts([30], vocab=128, seed=23)[0]
    with pytest.raises(ValueError, match="KV pool holds 32 tokens"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(6))
    assert not llm.engine.has_unfinished()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(2))[0]
    assert out.token_ids == cold_tokens("nemotron_h", tuple(prompt), 2)
    llm.engine.pool.check()


def test_budget_sizing_logs_what_fits(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="hybridserve.statepool.sizing"):
        llm = warm_llm("nemotron_h", cpu_memory_gb=0.01)
    layout = llm.engine.cache.layout
    assert layout.num_checkpoints > 0 and layout.num_pages >= 160 // 8
    message = caplog.records[-1].getMessage()
    assert "maximum concurrency" in message and "checkpoints (every 16 tokens)" in message
    assert llm.engine.cache.total_bytes() <= 0.01 * 2**30


def test_caching_off_keeps_no_state_after_requests() -> None:
    llm = warm_llm("nemotron_h", enable_prefix_caching=False)
    prompt = random_prompts([50], vocab=128, seed=24)[0]
    for _ in range(2):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=3, temperature=0.0))[0]
        assert out.num_cached_tokens == 0
    pool = llm.engine.pool
    pool.check()
    assert pool.pages.num_free == pool.num_pages and pool.radix is None


def test_standby_slots_do_not_take_the_kv_of_the_requests_they_hold() -> None:
    """A budget that holds every slot, KV for every slot's request and two more rows: the planner gives the
    slots their KV first; only what is past that becomes checkpoint rows (idle slots hold checkpoints too)."""
    config = ModelConfig.from_dir(model_dir("nemotron_h"))
    want = PoolRequest(max_num_seqs=2, standby_slots=6, max_model_len=64, page_size=8, conv_width=3,
                       dtype=torch.float32, ssm_dtype=torch.float32, prefix_caching=True, state_block=16)
    slot = CacheLayout.bytes_per_slot(config, 3, torch.float32, torch.float32)
    page = CacheLayout.bytes_per_page(config, 8, torch.float32)
    budget = 8 * slot + 2 * slot + 8 * (64 // 8) * page
    layout = plan_cache_layout(config, budget, want)
    assert layout.num_slots == 8
    assert layout.num_pages >= 8 * (64 // 8)  # KV for all 8 slots' requests
    assert 1 <= layout.num_checkpoints <= 2  # from the surplus only
    with pytest.raises(ValueError, match="standby_slots"):
        PoolRequest(max_num_seqs=2, standby_slots=-1, max_model_len=64, page_size=8, conv_width=3,
                    dtype=torch.float32, ssm_dtype=torch.float32)
