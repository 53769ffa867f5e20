"""A request that repeats, extends or branches from an earlier one reuses the deepest aligned checkpoint
and gives exactly the tokens of a cold run (NemotronH and Mamba2)."""

from __future__ import annotations

import pytest
from checkpoints import random_prompts
from prefix_cases import STATE_BLOCK, cold_tokens, greedy, warm_llm

from hybridserve import LLM

MODELS = ["nemotron_h", "mamba2"]
FIRST_LEN = 40  # first prompt: prefill leaves checkpoints at 16 and 32
FIRST_MAX_TOKENS = 4  # decode stops at 43 tokens computed: no checkpoint at 48


def _run(llm: LLM, kind: str, prompt: list[int], max_tokens: int = 6):
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(max_tokens))[0]
    assert out.token_ids == cold_tokens(kind, tuple(prompt), max_tokens)
    llm.engine.pool.check()
    return out


def _expected_hit(shared: int, second_len: int, first_computed: int) -> int:
    usable = min(shared, second_len - 1, first_computed)
    return usable // STATE_BLOCK * STATE_BLOCK


# (name, shared prefix length, second prompt length)
CASES = [
    ("repeat", FIRST_LEN, FIRST_LEN),
    ("extend", FIRST_LEN, FIRST_LEN + 11),
    ("branch_mid_block", 24, 37),
    ("branch_on_boundary", 32, 45),
    ("branch_just_before_boundary", 31, 45),
    ("branch_just_after_boundary", 33, 45),
    ("prefix_ends_on_boundary", 32, 32),  # whole prompt cached: backs off to the previous checkpoint
    ("prefix_ends_just_before", 31, 31),
    ("prefix_ends_just_after", 33, 33),
    ("miss", 0, 30),
]


@pytest.mark.parametrize("kind", MODELS)
def test_second_request_hits_the_deepest_aligned_checkpoint(kind: str) -> None:
    llm = warm_llm(kind)
    first, other = random_prompts([FIRST_LEN, 60], vocab=128, seed=11)
    out = _run(llm, kind, first, FIRST_MAX_TOKENS)
    assert out.num_cached_tokens == 0
    first_computed = FIRST_LEN + FIRST_MAX_TOKENS - 1
    for name, shared, length in CASES:
        prompt = first[:shared] + other[: length - shared]
        if shared < len(first) and length > shared:
            assert prompt[shared] != first[shared]  # a real branch point
        out = _run(llm, kind, prompt)
        expected = _expected_hit(shared, length, first_computed)
        if name == "prefix_ends_on_boundary":
            assert expected == STATE_BLOCK
        assert out.num_cached_tokens == expected, name
        llm.engine.reset_prefix_cache()  # each case sees only the first request's checkpoints
        _run(llm, kind, first, FIRST_MAX_TOKENS)


@pytest.mark.parametrize("kind", MODELS)
def test_multi_turn_hits_past_the_original_prompt(kind: str) -> None:
    llm = warm_llm(kind)
    system, user1, user2 = random_prompts([21, 4, 5], vocab=128, seed=12)
    turn1 = _run(llm, kind, system + user1, max_tokens=30)  # decode crosses 32 and 48 (54 computed)
    turn2 = system + user1 + turn1.token_ids + user2
    out = _run(llm, kind, turn2, max_tokens=5)
    assert out.num_cached_tokens == 48 > len(system + user1)
    turn3 = turn2 + out.token_ids + user1
    assert _run(llm, kind, turn3, max_tokens=3).num_cached_tokens == 64


@pytest.mark.parametrize("kind", MODELS)
def test_concurrent_requests_share_a_prefix_and_match_cold(kind: str) -> None:
    """Requests admitted together compute the shared blocks side by side; later waves hit them."""
    llm = warm_llm(kind, max_num_seqs=3, prefill_chunk_size=24)
    system, *tails = random_prompts([35, 3, 9, 17, 1, 6, 12], vocab=128, seed=13)
    prompts = [system + t for t in tails]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(7))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == cold_tokens(kind, tuple(prompt), 7)
    assert max(o.num_cached_tokens for o in outs) == 32
    pool = llm.engine.pool
    pool.check()
    assert pool.num_queries == len(prompts) and pool.num_hit_tokens == sum(o.num_cached_tokens for o in outs)
    assert pool.num_hits == sum(o.num_cached_tokens > 0 for o in outs)


def test_cache_events_describe_stored_and_removed_blocks() -> None:
    llm = warm_llm("nemotron_h")
    prompt = random_prompts([33], vocab=128, seed=14)[0]
    _run(llm, "nemotron_h", prompt, max_tokens=2)
    events = llm.engine.drain_cache_events()
    assert [e.sequence for e in events] == list(range(len(events)))
    stored = [e for e in events if e.kind.value == "block_stored"]
    assert [e.num_tokens for e in stored] == [8, 16, 24, 32]
    assert [e.num_tokens for e in events if e.kind.value == "checkpoint_stored"] == [16, 32]
    assert stored[1].parent_hash == stored[0].block_hash and stored[0].parent_hash is None
    llm.engine.reset_prefix_cache()
    removed = llm.engine.drain_cache_events()
    assert removed[0].sequence == len(events)
    assert {e.block_hash for e in removed if e.kind.value == "block_removed"} == {e.block_hash for e in stored}
    pool = llm.engine.pool
    assert pool.pages.num_free == pool.num_pages and pool.checkpoints.num_free == pool.checkpoints.capacity


def test_state_block_must_be_a_multiple_of_chunk_and_page() -> None:
    with pytest.raises(ValueError, match="multiple of the model's SSD chunk_size"):
        warm_llm("nemotron_h", state_block=12)
    with pytest.raises(ValueError, match="multiple of page_size"):
        warm_llm("nemotron_h", state_block=8, page_size=16)
    with pytest.raises(ValueError, match="state_block must be a positive integer"):
        warm_llm("mamba2", state_block=0)
    assert warm_llm("nemotron_h", state_block=None, page_size=16).engine.state_block == 32


def test_recomputed_boundary_keeps_the_cached_checkpoint() -> None:
    """A prompt ending on a checkpoint backs off one block and recomputes it: no second copy is stored."""
    llm = warm_llm("nemotron_h")
    prompt = random_prompts([32], vocab=128, seed=15)[0]
    _run(llm, "nemotron_h", prompt, max_tokens=1)
    llm.engine.drain_cache_events()
    used = llm.engine.pool.checkpoints.num_used
    assert _run(llm, "nemotron_h", prompt, max_tokens=1).num_cached_tokens == 16
    assert llm.engine.drain_cache_events() == [] and llm.engine.pool.checkpoints.num_used == used == 2
