"""Tensor-parallel engines (TP=2, gloo on CPU, one spawned follower rank) give transformers' logits and the
TP=1 engine's greedy tokens, through chunked prefill and prefix-cache hits; the shard plan keeps the Mamba
group and KV-head structure when TP exceeds n_groups / num_kv_heads."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from checkpoints import hf_greedy, hf_logits, mamba2, nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.config import EngineConfig
from hybridserve.models.parallel import TPGroup
from hybridserve.models.tp_shard import local_config, mamba_shards, shard_tensor
from hybridserve.transfer.state_layout import state_views

RTOL, ATOL = 1e-4, 1e-5
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def _check_engine(model_dir, hf, prompt_lengths: list[int], **options: object) -> None:
    """TP=2 logits = transformers', TP=2 greedy = TP=1 greedy = transformers' argmax, with prefill chunks
    of 8 tokens and a second round that hits the prefix cache; `options` go to the TP=2 engine."""
    prompts = random_prompts(prompt_lengths, vocab=128, seed=3)
    shared = random_prompts([70], vocab=128, seed=4)[0]
    repeat = [shared + [5, 6], shared + [7]]  # 64-token prefix: two state_block checkpoints to hit
    llm = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8, **options)  # first: it gives the CPU ranks 1 core each
    try:
        one = LLM(model_dir, prefill_chunk_size=8)
        expected = _tokens(one, prompts)
        expected_repeat = _tokens(one, [shared]) + _tokens(one, repeat)
        for prompt in prompts[:2]:
            torch.testing.assert_close(llm.prompt_logits(prompt), hf_logits(hf, prompt), rtol=RTOL, atol=ATOL)
        assert _tokens(llm, prompts) == expected
        assert expected[0] == hf_greedy(hf, prompts[0], GREEDY.max_tokens)
        assert _tokens(llm, [shared]) == expected_repeat[:1]
        outs = llm.generate(prompt_token_ids=repeat, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == expected_repeat[1:]
        assert all(o.num_cached_tokens >= 32 for o in outs)  # prefix-cache hits, state copied on both ranks
    finally:
        llm.engine.close()


def test_nemotron_h_tp2_matches_tp1_and_transformers() -> None:
    """Two groups, two KV heads: everything sharded."""
    _check_engine(*nemotron_h("M*-M"), [5, 19, 33])


def test_nemotron_h_tp2_with_one_group_and_one_kv_head() -> None:
    """n_groups=1 < TP: the group is replicated and the gated norm's group spans both ranks (all-reduced
    sums of squares); num_kv_heads=1 < TP: the KV head is replicated."""
    _check_engine(*nemotron_h("M*-M", n_groups=1, num_key_value_heads=1), [11, 26])


def test_mamba2_tp2_with_one_group() -> None:
    model_dir, hf = mamba2(n_groups=1)
    prompts = random_prompts([9, 30], vocab=128, seed=2)
    llm = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8)
    try:
        for prompt in prompts:
            torch.testing.assert_close(llm.prompt_logits(prompt), hf_logits(hf, prompt), rtol=RTOL, atol=ATOL)
        assert _tokens(llm, prompts) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    finally:
        llm.engine.close()


# ---- the shard plan, no processes ------------------------------------------------------------------------
def _config(**overrides: object) -> ModelConfig:
    return ModelConfig.from_dir(nemotron_h("M*-M", **overrides)[0])


@pytest.mark.parametrize(
    ("heads", "groups", "size", "local_groups"),
    [(8, 4, 2, [[0, 1], [2, 3]]),  # TP divides n_groups: sharded
     (8, 2, 4, [[0], [0], [1], [1]]),  # n_groups divides TP: each rank's heads read one group
     (8, 1, 2, [[0], [0]]),
     (6, 3, 2, [[0, 0, 1], [1, 2, 2]])],  # heads straddle groups: one group copy per local head
)
def test_mamba_group_shards(heads: int, groups: int, size: int, local_groups: list[list[int]]) -> None:
    config = _config(mamba_num_heads=heads, n_groups=groups)
    shards = mamba_shards(config, size)
    assert [list(s.groups) for s in shards] == local_groups
    assert all(s.num_heads == heads // size and s.head_start == r * (heads // size) for r, s in enumerate(shards))


def test_shards_reassemble_the_checkpoint_tensors() -> None:
    config = _config()
    m = config.mamba
    assert m is not None
    full = torch.randn(m.in_proj_size, config.hidden_size)
    parts = [shard_tensor("layers.0.mixer.in_proj.weight", full, config, TPGroup(r, 2)) for r in range(2)]
    local = local_config(config, TPGroup(0, 2)).mamba
    assert local is not None and parts[0].shape == (local.in_proj_size, config.hidden_size)
    z = torch.cat([p[: local.intermediate_size] for p in parts])
    torch.testing.assert_close(z, full[: m.intermediate_size])  # gate rows of heads 0-1 then 2-3
    vocab = torch.randn(config.vocab_size, config.hidden_size)
    rows = torch.cat([shard_tensor("lm_head.weight", vocab, config, TPGroup(r, 2)) for r in range(2)])
    torch.testing.assert_close(rows, vocab)


def test_tensor_parallel_config_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    model_dir, _ = nemotron_h("M*-M")
    with pytest.raises(ValueError, match="divisible by tensor_parallel_size=3"):
        LLM(model_dir, tensor_parallel_size=3)  # fails before any process starts


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_speculative_verify_tp2_rolls_back_on_every_rank(rollback: str) -> None:
    """Drafts half right (oracle drafts corrupted at random): each verify rolls the Mamba state of both ranks
    back (conv windows, per-token SSM states or replay) and snapshots it at 16-token state blocks; the tokens
    equal plain TP=1 greedy decoding."""
    model_dir, _ = nemotron_h("M*-M")
    options = dict(max_model_len=160, state_block=16, page_size=8, max_num_seqs=4)
    prompts = random_prompts([5, 17, 30], vocab=128, seed=11)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(model_dir, tensor_parallel_size=2, speculative_config=spec, **options)
    try:
        expected = [o.token_ids for o in LLM(model_dir, **options).generate(prompt_token_ids=prompts,
                                                                           sampling_params=params)]
        truth = [p + e for p, e in zip(prompts, expected)]
        rng = random.Random(0)

        def draft(request) -> list[int]:
            prompt, n = request.prompt_token_ids, request.num_tokens
            full = next(t for t in truth if t[: len(prompt)] == prompt)
            return [t if rng.random() < 0.5 else (t + 1) % 128 for t in full[n : n + 3]]

        assert llm.engine.spec is not None
        llm.engine.spec.set_drafter(draft)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == expected
        metrics = llm.engine.spec.metrics
        assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
        # prompt + 20 generated tokens: the cached states at 16 / 32 / 48 were snapshots taken inside a verify
        longer = [p + e[:20] for p, e in zip(prompts, expected)]
        again = llm.generate(prompt_token_ids=longer, sampling_params=SamplingParams(max_tokens=10, temperature=0.0,
                                                                                     ignore_eos=True))
        assert [o.token_ids for o in again] == [e[20:] for e in expected]
        assert [o.num_cached_tokens for o in again] == [16, 32, 48]
    finally:
        llm.engine.close()


def _prefill_then_decode(prefill, decode, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:
    """P/D in process: prefill exports the held state as bytes, decode reserves, lands them and decodes."""
    prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id, hold_state=True)
    first = None
    while prefill.has_unfinished():
        for out in prefill.step():
            first = out.token_ids[0] if out.token_ids else first
    exported = prefill.export_state(request_id)
    assert exported.specs == decode.state_specs(len(prompt))  # one wire layout, whatever the TP sizes
    wire = torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in exported.parts])
    tensors = state_views(wire, exported.specs)
    decode.reserve(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens = decode.commit_reservation(request_id, tensors, first, 0).token_ids
    while decode.has_unfinished():
        for out in decode.step():
            if out.request_id == request_id:
                tokens = out.token_ids
    return tokens


@pytest.mark.parametrize("case", ["sharded", "replicated"])
def test_prefill_decode_across_tp_sizes(case: str) -> None:
    """Prefill TP=1 -> decode TP=2 and TP=2 -> TP=1 give the tokens of one TP=1 engine (the wire layout is
    the unsharded one: the TP side gathers / slices KV heads, conv channels and SSM heads)."""
    overrides = {} if case == "sharded" else {"n_groups": 1, "num_key_value_heads": 1}
    model_dir, _ = nemotron_h("M*-M", **overrides)
    prompts = random_prompts([21, 40], vocab=128, seed=9)
    two = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=16).engine
    try:
        one = LLM(model_dir, prefill_chunk_size=16).engine
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        expected = [o.token_ids for o in LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=params)]
        assert _prefill_then_decode(one, two, prompts[0], 16, "a") == expected[0]
        assert _prefill_then_decode(two, one, prompts[1], 16, "b") == expected[1]
        if case == "sharded":  # an early-sent layout (KV split around the Mamba states) into TP=2
            assert _prefill_then_decode(one, two, prompts[1], 16, "c") == expected[1]
    finally:
        two.close()


def test_cli_generate_with_tensor_parallel_size() -> None:
    """`hybridserve generate --tensor-parallel-size 2` as a user runs it: same tokens as TP=1, clean exit."""
    model_dir, _ = nemotron_h("M*-M")
    argv = [sys.executable, "-m", "hybridserve", "generate", "--model", str(model_dir), "--prompt-ids", "5,6,7,8",
            "--max-tokens", "5", "--ignore-eos", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run(argv + extra, capture_output=True, text=True, timeout=300, env=env)
            for extra in ([], ["--tensor-parallel-size", "2"])]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr[-2000:]
    one, two = (json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in runs)
    assert one == two and len(two) == 5


def test_follower_exits_when_rank0_is_killed() -> None:
    """A SIGKILLed rank 0 sends no STOP (and NCCL, unlike gloo, would not notice for the collective timeout): a
    spawned follower's watcher sees its parent gone and exits within seconds."""
    import signal
    import time

    child = ("from hybridserve.engine.tp_launch import exit_with_parent; import time; "
             "exit_with_parent(0.1); print('watching', flush=True); time.sleep(600)")
    parent = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True); "
              "p.stdout.readline(); print(p.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    try:
        assert proc.stdout is not None
        follower = int(proc.stdout.readline())
        assert alive(follower)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and alive(follower):
            time.sleep(0.2)
        assert not alive(follower), f"follower {follower} outlived its killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
