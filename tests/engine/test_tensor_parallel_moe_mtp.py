"""Tensor parallelism for the MoE block and the MTP drafter (TP=2, gloo on CPU, one spawned follower rank):
MoE layers (shared expert fused into the expert GEMMs, or apart behind a latent projection) give transformers'
logits and the TP=1 engine's greedy tokens; the sharded MTP drafter verifies with both rollbacks and gives the
TP=1 drafter's drafts and plain greedy decoding's tokens."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoints import hf_greedy, hf_logits, nemotron_h_moe, nemotron_h_mtp, random_prompts
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from hybridserve.common.model_config import ModelConfig
from hybridserve.models.default_model import default_model_dir
from hybridserve.models.parallel import ExpertParallelMoE, TPGroup
from hybridserve.models.tp_shard import local_config, local_moe, shard_tensor

RTOL, ATOL = 1e-4, 1e-5
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize(("latent", "expert_parallel"), [(None, False), (8, False), (8, True)],
                         ids=["fused-shared", "latent", "latent-expert-parallel"])
def test_moe_tp2_matches_tp1_and_transformers(latent: int | None, expert_parallel: bool) -> None:
    """Every expert's intermediate dim split over the ranks (or, expert parallel, 4 whole experts per rank),
    router replicated, one all-reduce per block."""
    model_dir, hf = nemotron_h_moe("ME*E", moe_latent_size=latent)
    prompts = random_prompts([7, 21], vocab=128, seed=5)
    llm = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8, enable_expert_parallel=expert_parallel)
    try:
        expected = _tokens(LLM(model_dir, prefill_chunk_size=8), prompts)
        torch.testing.assert_close(llm.prompt_logits(prompts[1]), hf_logits(hf, prompts[1]), rtol=RTOL, atol=ATOL)
        assert _tokens(llm, prompts) == expected
        assert expected[0] == hf_greedy(hf, prompts[0], GREEDY.max_tokens)
    finally:
        llm.engine.close()


def test_moe_shards_reassemble_the_experts() -> None:
    """Rank slices of up_proj [E, I, D] / down_proj [E, D, I] tile the intermediate dim; the shared expert's
    down-projection bias is kept once (rank 0)."""
    config = ModelConfig.from_dir(nemotron_h_moe("ME*E")[0])
    assert config.moe is not None
    e, i, d = config.moe.num_experts, config.moe.intermediate_size, config.hidden_size
    up, down = torch.randn(e, i, d), torch.randn(e, d, i)
    ranks = [TPGroup(r, 2) for r in range(2)]
    ups = [shard_tensor("layers.1.mixer.experts.up_proj", up, config, tp) for tp in ranks]
    downs = [shard_tensor("layers.1.mixer.experts.down_proj", down, config, tp) for tp in ranks]
    torch.testing.assert_close(torch.cat(ups, dim=1), up)
    torch.testing.assert_close(torch.cat(downs, dim=2), down)
    local = local_config(config, ranks[1]).moe
    assert local is not None and local.intermediate_size == i // 2 and local.num_experts == e
    bias = torch.randn(d)
    name = "layers.1.mixer.shared_experts.down_proj.bias"
    assert torch.equal(shard_tensor(name, bias, config, ranks[0]), bias)
    assert not shard_tensor(name, bias, config, ranks[1]).any()
    with pytest.raises(ValueError, match="moe_intermediate_size \\(16\\) must be divisible by tensor_parallel_size=3"):
        local_config(config, TPGroup(0, 3))


def test_expert_parallel_routes_and_shards() -> None:
    """Rank 1 of 2 holds experts 4..7: a token's choices there keep their weights (local ids 0..3), the others
    get weight 0 on local expert 0; the block over rank 1's experts alone equals the full block restricted to
    them (each pair a row of its own; the zero-weight pairs add nothing); experts that do not divide over the
    ranks are a clear error."""
    config = ModelConfig.from_dir(nemotron_h_moe("ME*E")[0])
    assert config.moe is not None
    tp = TPGroup(1, 2, expert_parallel=True)
    moe = ExpertParallelMoE(config.hidden_size, config.moe, False, tp)
    assert moe.experts.up_proj.shape[0] == 4 and moe.gate.weight.shape[0] == 8
    ids = torch.tensor([[5, 0, 1], [4, 6, 7], [0, 1, 2]])
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.3], [0.4, 0.4, 0.4]])
    local_w, local_ids = moe.local_routes(weights, ids)
    torch.testing.assert_close(local_w, torch.tensor([[0.5, 0.0, 0.0], [0.1, 0.2, 0.3], [0.0, 0.0, 0.0]]))
    assert local_ids.tolist() == [[1, 0, 0], [0, 2, 3], [0, 0, 0]]
    generator = torch.Generator().manual_seed(0)
    for param in (moe.experts.up_proj, moe.experts.down_proj):
        param.data = torch.randn(param.shape, generator=generator) * 0.3
    x = torch.randn(3, config.hidden_size, generator=generator)
    got = moe.routed(x, local_w, local_ids)
    want = torch.zeros_like(got)
    for j in range(3):
        hidden = torch.relu(torch.einsum("nd,nid->ni", x, moe.experts.up_proj[local_ids[:, j]])).square()
        want += local_w[:, j, None] * torch.einsum("ni,ndi->nd", hidden, moe.experts.down_proj[local_ids[:, j]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    up = torch.randn(8, 16, config.hidden_size)
    torch.testing.assert_close(shard_tensor("layers.1.mixer.experts.up_proj", up, config, tp), up[4:])
    with pytest.raises(ValueError, match="n_routed_experts \\(8\\) must be divisible by tensor_parallel_size=3"):
        local_config(config, TPGroup(0, 3, expert_parallel=True))
    one_each = local_moe(config.moe, TPGroup(0, 8, expert_parallel=True))  # 1 expert per rank under top-3 routing
    assert one_each.intermediate_size == config.moe.intermediate_size and one_each.shared_intermediate_size == 4


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mtp_with_moe_layer_tp2_drafts_as_tp1(expert_parallel: bool) -> None:
    """A drafter with an attention and a MoE layer (per-expert checkpoint tensors): TP=2 drafts and tokens equal
    TP=1's, and the tokens equal plain greedy decoding."""
    model_dir, _ = nemotron_h_mtp("M*-M", ("attention", "moe"), moe=True)
    options = dict(max_model_len=128, page_size=8, max_num_seqs=4)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = random_prompts([6, 19], vocab=128, seed=12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model_dir, tensor_parallel_size=2, speculative_config=spec, enable_expert_parallel=expert_parallel,
              **options)
    try:
        one = LLM(model_dir, speculative_config=spec, **options)
        expected = _tokens(one, prompts, params)
        assert expected == _tokens(LLM(model_dir, **options), prompts, params)
        assert _tokens(llm, prompts, params) == expected
        assert llm.engine.spec is not None and one.engine.spec is not None
        two_metrics, one_metrics = llm.engine.spec.metrics, one.engine.spec.metrics
        assert two_metrics.num_draft_tokens == one_metrics.num_draft_tokens > 0
        assert two_metrics.num_accepted_tokens == one_metrics.num_accepted_tokens  # the same drafts
    finally:
        llm.engine.close()


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_demo_mtp_verify_tp2_accepts_and_rejects(rollback: str) -> None:
    """The trained demo drafter at TP=2: verify steps that accept every draft and steps that reject some, each
    rolling both ranks' Mamba state back; the tokens equal TP=1 greedy decoding without a drafter."""
    prompts = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "import os\nimport sys\n\n\ndef main("]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(default_model_dir(), tensor_parallel_size=2, speculative_config=spec, max_num_seqs=2)
    try:
        plain = [o.token_ids for o in LLM(default_model_dir(), max_num_seqs=2).generate(prompts, params)]
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == plain
        assert llm.engine.spec is not None
        metrics = llm.engine.spec.metrics
        assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens  # accepted drafts and rejected ones
        assert metrics.acceptance_length > 1.5  # steps with every draft accepted
    finally:
        llm.engine.close()


def test_disaggregated_mtp_prefill_tp1_to_decode_tp2() -> None:
    """P/D with MTP across TP sizes over gRPC: a TP=1 prefill worker ships the drafter's KV and the last hidden
    state in the unsharded layout, a TP=2 decode worker slices it and drafts from its first step; the tokens
    equal plain in-process decoding."""
    import dataclasses

    from hybridserve.decode_worker.worker import DecodeWorker
    from hybridserve.engine.config import EngineConfig
    from hybridserve.prefill_worker.worker import PrefillWorker
    from hybridserve.router.orchestrator import Orchestrator
    from hybridserve.transfer.planes import TransferConfig

    model_dir, _ = nemotron_h_mtp()
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    config = EngineConfig(prefill_chunk_size=16, max_num_seqs=4, page_size=8, speculative_config=spec)
    prompts = random_prompts([6, 29], vocab=128, seed=62)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = _tokens(LLM(model_dir, page_size=8), prompts, params)
    decode = DecodeWorker(model_dir, dataclasses.replace(config, tensor_parallel_size=2))
    prefill = PrefillWorker(model_dir, config, transfer=TransferConfig(grpc_chunk_bytes=512))
    orchestrator = None
    try:
        for worker in (prefill, decode):
            worker.start()
        orchestrator = Orchestrator([prefill.address], [decode.address])
        got = [[t for event in orchestrator.generate(p, params) for t in event.token_ids] for p in prompts]
        assert got == expected
        metrics = decode.loop.call(lambda: decode.engine.spec.metrics)
        assert metrics.num_draft_tokens > 0
    finally:
        if orchestrator is not None:
            orchestrator.close()
        prefill.stop()
        decode.stop()
        decode.engine.close()


def _fp8_experts_checkpoint(source: Path) -> Path:
    """source with its routed experts stored as ModelOpt FP8 does (per-expert float8_e4m3fn, per-tensor
    weight_scale, input_scale), dense fp8 linears (W8A8 with a static input scale): the Mamba in_proj (column
    parallel) with per-channel [out, 1] scales, out_proj (row parallel) per tensor; and the attention q_proj alone
    in fp8 (k/v are not: the fused q/k/v runs dequantized)."""
    directory = Path(tempfile.mkdtemp(prefix="hybridserve-tp-fp8-"))
    shutil.copytree(source, directory, dirs_exist_ok=True)
    tensors = load_file(str(directory / "model.safetensors"))
    dense = ("q_proj.weight", "in_proj.weight", "out_proj.weight")
    for name in [n for n in tensors if (".experts." in n and "shared" not in n) or n.endswith(dense)]:
        weight = tensors[name]
        per_channel = name.endswith(("q_proj.weight", "in_proj.weight"))
        scale = weight.abs().amax(dim=1, keepdim=True) / 448.0 if per_channel else weight.abs().max().reshape(1) / 448.0
        tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[name + "_scale"] = scale.float()
        tensors[name.replace(".weight", ".input_scale")] = torch.full((1,), 1 / 64)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("expert_parallel,w8a8", [(False, False), (True, False), (True, True)])
def test_fp8_moe_tp2_matches_tp1(expert_parallel: bool, w8a8: bool) -> None:
    """fp8 experts at TP=2: each rank's slice of every expert (or its whole experts) with the matching rows of
    the per-channel scales; dense fp8 linears sharded with their scales (per-channel rows sliced with the weight's,
    per-tensor and static input scales replicated); logits and greedy tokens equal TP=1's. W8A8 experts under
    expert parallelism quantize the same whole rows as TP=1 (equal); under TP slices see the next test."""
    model_dir = _fp8_experts_checkpoint(nemotron_h_moe("ME*E")[0])
    prompts = random_prompts([9, 20], vocab=128, seed=7)
    llm = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8, enable_expert_parallel=expert_parallel,
              moe_fp8_activations=w8a8)
    try:
        one = LLM(model_dir, prefill_chunk_size=8, moe_fp8_activations=w8a8)
        assert one.engine.model.layers[1].mixer.experts.up_proj.dtype == torch.float8_e4m3fn
        assert llm.engine.model.layers[1].mixer.experts.up_proj.dtype == torch.float8_e4m3fn
        assert llm.engine.model.layers[0].mixer.out_proj.weight.dtype == torch.float8_e4m3fn
        in_proj = one.engine.model.layers[0].mixer.in_proj
        assert in_proj.weight_scale.shape == (in_proj.out_features,)
        torch.testing.assert_close(llm.prompt_logits(prompts[1]), one.prompt_logits(prompts[1]), rtol=RTOL, atol=ATOL)
        assert _tokens(llm, prompts) == _tokens(one, prompts)
    finally:
        llm.engine.close()


def test_w8a8_moe_tp2_slices_stay_close_to_tp1() -> None:
    """W8A8 experts sliced over TP=2 ranks: each rank quantizes its slice of a relu2 row with that slice's own
    scale (finer than TP=1's whole-row scale), so logits are close to TP=1's, not equal."""
    model_dir = _fp8_experts_checkpoint(nemotron_h_moe("ME*E")[0])
    prompt = random_prompts([20], vocab=128, seed=7)[0]
    llm = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8)
    try:
        one = LLM(model_dir, prefill_chunk_size=8)
        assert llm.engine.config.moe_fp8_activations and one.engine.config.moe_fp8_activations
        got, want = llm.prompt_logits(prompt), one.prompt_logits(prompt)
        error = float((got - want).norm() / want.norm())
        assert 0 < error < 0.05, error  # measured 0.023 (e4m3 rows on unit-gain random experts)
    finally:
        llm.engine.close()
