"""The memory plan on Nemotron-Nano-9B-v2's real shapes (40 GiB, max_model_len 8192): raising max_num_seqs
never shrinks what the running batch gets, a value that cannot be met is lowered with a WARNING that says why,
prefix-cache checkpoints take no memory running requests could use, standby slots share the plan, and the
start-up line says what fits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.statepool.sizing import PoolRequest, plan_cache_layout
from hybridserve.statepool.state_cache import CacheLayout

NANO_9B = Path(__file__).parent / "nemotron-nano-9b-v2.json"  # config.json of Nemotron-Nano-9B-v2 (shapes only)
BUDGET = 40 * 2**30
MAX_MODEL_LEN = 8192
PAGE = 16
STATE_BLOCK = 512  # the engine's default: 4 SSD chunks of 128 tokens


@pytest.fixture(scope="module")
def nano(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    folder = tmp_path_factory.mktemp("nano9b")
    shutil.copy(NANO_9B, folder / "config.json")
    return ModelConfig.from_dir(folder)


def _want(max_num_seqs: int, **overrides: object) -> PoolRequest:
    options: dict = dict(max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN, page_size=PAGE, conv_width=3,
                         dtype=torch.bfloat16, ssm_dtype=torch.float32, prefix_caching=True, state_block=STATE_BLOCK)
    return PoolRequest(**{**options, **overrides})


def _sizes(config: ModelConfig) -> tuple[int, int]:
    return (CacheLayout.bytes_per_slot(config, 3, torch.bfloat16, torch.float32),
            CacheLayout.bytes_per_page(config, PAGE, torch.bfloat16))


def _concurrency(layout: CacheLayout, running: int, length: int) -> int:
    return min(running, layout.num_pages // -(-length // PAGE))


def test_raising_max_num_seqs_never_shrinks_the_running_batch_or_collapses_kv(nano: ModelConfig) -> None:
    slot, page = _sizes(nano)
    assert round(slot / 2**20, 1) == 136.9  # one fp32 SSM state + conv window over 27 Mamba layers
    layouts = {n: plan_cache_layout(nano, BUDGET, _want(n)) for n in (64, 256, 512, 1024)}
    previous = 0
    for n, layout in layouts.items():
        running = min(n, layout.num_slots)
        total = (layout.num_slots + layout.num_checkpoints) * slot + layout.num_pages * page
        assert total <= BUDGET
        tokens = layout.num_pages * PAGE
        # every running request keeps KV for 2,048 tokens (before: 28,032 KV tokens in all at 256, 10,512 at 512)
        assert tokens >= running * 2048, (n, layout)
        at_2k = _concurrency(layout, running, 2048)
        assert at_2k >= previous, f"max_num_seqs={n} runs fewer 2K-token requests than a smaller value"
        previous = at_2k
    assert layouts[64].num_slots == 64
    assert layouts[1024].num_slots == layouts[256].num_slots == 242  # what 40 GiB hold at 2K tokens each
    assert layouts[1024].num_pages * PAGE >= 500_000  # not 28K
    assert _concurrency(layouts[1024], 242, 8192) >= 60


def test_checkpoint_rows_only_take_what_running_requests_cannot_use(nano: ModelConfig) -> None:
    for n in (64, 128, 256, 1024):
        layout = plan_cache_layout(nano, BUDGET, _want(n))
        if layout.num_checkpoints:  # rows of their own only past KV for every slot at max_model_len
            assert layout.num_pages >= layout.num_slots * (MAX_MODEL_LEN // PAGE), (n, layout)
    # 64 slots: every running request can hold 8,192 tokens, and the rest is cache (before: 175 checkpoint
    # slots and 527K KV tokens; now at least as much KV for the running batch)
    small = plan_cache_layout(nano, BUDGET, _want(64))
    assert small.num_pages * PAGE >= 64 * MAX_MODEL_LEN and small.num_checkpoints > 100
    no_cache = plan_cache_layout(nano, BUDGET, _want(1024, prefix_caching=False))
    assert no_cache.num_checkpoints == 0 and no_cache.num_slots == 242


def test_a_lowered_max_num_seqs_warns_why_and_what_fits_is_logged(nano: ModelConfig,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="hybridserve.statepool.sizing"):
        plan_cache_layout(nano, BUDGET, _want(512))
    warning = next(r for r in caplog.records if r.levelname == "WARNING").getMessage()
    assert "max_num_seqs=512" in warning and "lowered to 242" in warning and "136.9 MiB" in warning
    assert "2,048 tokens" in warning and "gpu_memory_utilization" in warning
    info = caplog.records[-1]
    assert info.levelname == "INFO"
    text = info.getMessage()
    assert text.startswith("state cache 40.0 GiB: 242 Mamba slots") and "KV tokens" in text
    assert "maximum concurrency 242 requests of 2,048 tokens, 61 of 8,192" in text


def test_standby_slots_share_the_plan_after_the_running_batch(nano: ModelConfig) -> None:
    decode = plan_cache_layout(nano, BUDGET, _want(128, standby_slots=128))  # a P/D decode worker
    assert 128 < decode.num_slots < 256  # the running batch whole, standby from what is left
    slot, page = _sizes(nano)
    assert decode.num_slots * (slot + 2048 // PAGE * page) <= BUDGET
    full = plan_cache_layout(nano, BUDGET, _want(256, standby_slots=256))
    assert full.num_slots == 242  # running first: no standby slot beyond what the running batch leaves


def test_smaller_plan_seq_len_runs_more_shorter_requests(nano: ModelConfig) -> None:
    default = plan_cache_layout(nano, BUDGET, _want(1024))
    short = plan_cache_layout(nano, BUDGET, _want(1024, plan_seq_len=512))
    assert short.num_slots > default.num_slots and short.num_pages * PAGE >= short.num_slots * 512


def test_budget_too_small_for_one_request_is_a_clear_error(nano: ModelConfig) -> None:
    with pytest.raises(ValueError, match="one request of max_model_len=8192"):
        plan_cache_layout(nano, 2**27, _want(8))


def test_gpu_budget_is_the_utilization_share_less_what_is_used_and_profiled(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridserve.statepool import sizing

    total, free = 140 * 2**30, 120 * 2**30  # 20 GiB used: weights and the CUDA context
    monkeypatch.setattr(sizing.torch.cuda, "mem_get_info", lambda device=None: (free, total))
    budget = sizing.gpu_budget_bytes(torch.device("cuda"), 0.9, reserved_bytes=3 * 2**30)
    assert budget == int(total * 0.9) - 20 * 2**30 - 3 * 2**30
    assert sizing.gpu_budget_bytes(torch.device("cuda"), 0.1, reserved_bytes=0) == 0  # never negative


def test_useful_bytes_cap_a_small_model_on_a_large_gpu(nano: ModelConfig) -> None:
    """The GPU budget is the utilization share capped at what the plan can use (every row at max_model_len,
    twice with prefix caching): a second engine in the process still fits, the 9B at 1,024 rows is uncapped."""
    from hybridserve.statepool import sizing

    slot, page = _sizes(nano)
    per_request = slot + -(-MAX_MODEL_LEN // PAGE) * page
    assert sizing.request_bytes(nano, _want(4)) == per_request
    assert sizing.useful_bytes(nano, _want(4)) == 4 * per_request * 2
    assert sizing.useful_bytes(nano, _want(4, prefix_caching=False)) == 4 * per_request
    assert sizing.useful_bytes(nano, _want(1024)) > 140 * 2**30  # more than an H200 holds: the share decides
