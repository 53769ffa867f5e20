"""NemotronH MoE models (Nemotron 3 shapes in miniature: grouped sigmoid router with correction bias and scaling,
shared expert, latent MoE, MTP with a MoE layer, fp8 experts) against transformers, through the torch reference
and through the fused Triton experts (under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import BASE_NEMOTRON_H, hf_greedy, hf_logits, nemotron_h_moe, nemotron_h_mtp, random_prompts
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from hybridserve.common.model_config import ModelConfig
from hybridserve.kernels import ops
from hybridserve.models.moe import MoE
from hybridserve.models.weights import load_model

RTOL, ATOL = 1e-4, 1e-5
VOCAB = BASE_NEMOTRON_H["vocab_size"]
CASES = {
    "grouped": dict(pattern="ME*E"),
    "one-group": dict(pattern="EM*E", n_group=1, topk_group=1),
    "latent": dict(pattern="ME*E", moe_latent_size=8),
}


@pytest.fixture(params=["reference", "triton"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the router and experts through the torch reference, or through the Triton kernels (interpreted on
    CPU)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors need the interpreter; the CUDA path has its own test
            pytest.skip("the Triton kernels run on these CPU tensors only under TRITON_INTERPRET=1")
        from hybridserve.kernels.moe_router_triton import route_topk_triton
        from hybridserve.kernels.moe_small_triton import moe_layer_triton
        from hybridserve.kernels.moe_triton import moe_experts_triton

        def triton_only(kernel: Callable[..., Any]) -> Callable[..., Any]:  # whatever the layers' kernel mode
            return lambda *args, kernels=None, **kwargs: kernel(*args, **kwargs)

        monkeypatch.setattr(ops, "moe_experts", triton_only(moe_experts_triton))
        monkeypatch.setattr(ops, "moe_route", triton_only(route_topk_triton))
        monkeypatch.setattr(ops, "moe_layer", triton_only(moe_layer_triton))  # decode: small-M path; prefill: grouped
    return str(request.param)


def _model(case: str):
    kwargs = dict(CASES[case])
    return nemotron_h_moe(kwargs.pop("pattern"), **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, kernels: str) -> None:
    model_dir, hf = _model(case)
    llm = LLM(model_dir, prefill_chunk_size=64)
    for prompt in random_prompts([1, 6, 19], vocab=VOCAB, seed=1):
        torch.testing.assert_close(llm.prompt_logits(prompt), hf_logits(hf, prompt), rtol=RTOL, atol=ATOL)


# the latent case on the Triton experts is test_whole_engine_on_interpreted_triton_kernels's first half
@pytest.mark.parametrize(("case", "kernels"), [("grouped", "reference"), ("grouped", "triton"), ("latent", "reference")],
                         indirect=["kernels"])
def test_greedy_matches_transformers(case: str, kernels: str) -> None:
    model_dir, hf = _model(case)
    prompts = random_prompts([3, 11], vocab=VOCAB, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = LLM(model_dir, prefill_chunk_size=8).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


@pytest.mark.parametrize("case", ["grouped", "latent"])  # shared expert fused into the GEMMs / apart
def test_moe_forward_never_reads_device_data(case: str) -> None:
    """The whole MoE block runs on meta tensors, which refuse .item() / .tolist() / nonzero / unique: no host sync
    and no data-dependent shape, so it captures in a CUDA graph."""
    config = ModelConfig.from_dir(_model(case)[0])
    assert config.moe is not None
    with torch.device("meta"), torch.no_grad():
        out = MoE(config.hidden_size, config.moe, bias=False)(torch.empty(5, config.hidden_size))
    assert out.shape == (5, config.hidden_size) and out.is_meta


def _fp8_checkpoint(source: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """source rewritten as NVIDIA's FP8 checkpoints store it: per-expert float8_e4m3fn weights with a per-tensor
    `weight_scale` and an `input_scale` (ModelOpt; layer 1), or per-channel [out, 1] scales (compressed-tensors;
    layer 3). Dense linears stay as stored: an fp8 one runs W8A8, not exactly transformers' (tests/models/
    test_fp8_dense.py). -> (dir, the dequantized weights under the source's names)."""
    directory = Path(tempfile.mkdtemp(prefix="hybridserve-fp8-"))
    shutil.copytree(source, directory, dirs_exist_ok=True)
    tensors = load_file(str(directory / "model.safetensors"))
    dequantized: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if ".experts." in n]:
        weight = tensors[name]
        per_channel = ".layers.3." in name
        amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().max().reshape(1)
        scale = amax / 448.0
        fp8 = (weight / (scale if per_channel else scale[0])).to(torch.float8_e4m3fn)
        tensors[name] = fp8
        tensors[name + "_scale"] = scale.float()
        tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
        dequantized[name] = fp8.float() * (scale if per_channel else scale[0])
    for name in [n for n in tensors if n.endswith(("k_proj.weight", "v_proj.weight"))]:  # an fp8 KV cache's scales
        tensors[name.replace(".weight", "." + name.split(".")[-2][0] + "_scale")] = torch.ones(1)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, dequantized


def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(kernels: str) -> None:
    source, hf = _model("grouped")
    fp8_dir, dequantized = _fp8_checkpoint(source)
    model = load_model(fp8_dir, ModelConfig.from_dir(fp8_dir), torch.float32, torch.device("cpu"))
    assert model.layers[1].mixer.experts.up_proj.dtype == torch.float8_e4m3fn
    assert model.layers[1].mixer.experts.down_proj_scale.shape == (8, BASE_NEMOTRON_H["hidden_size"])
    reference = type(hf)(hf.config).eval()
    state = {k: v.clone() for k, v in hf.state_dict().items()}

    def key(suffix: str) -> str:  # in-memory names differ from the checkpoint's in their prefix
        return next(k for k in state if k.endswith(suffix))

    for name, value in dequantized.items():  # per-expert checkpoint names -> transformers' fused [E, out, in]
        parts = name.split(".")
        if "experts" in parts and "shared_experts" not in parts:
            state[key(".".join(parts[1:5]) + "." + parts[6])][int(parts[5])] = value
        else:
            state[key(".".join(parts[1:]))] = value
    reference.load_state_dict(state)
    llm = LLM(fp8_dir, prefill_chunk_size=64, moe_fp8_activations=False)  # weight-only: exact dequantized math
    assert llm.engine.model.layers[1].mixer.experts.up_proj.dtype == torch.float8_e4m3fn
    for prompt in random_prompts([4, 13], vocab=VOCAB, seed=5):
        torch.testing.assert_close(llm.prompt_logits(prompt), hf_logits(reference, prompt), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("w8a8", [True, False])
def test_fp8_expert_activations_agree_with_the_unquantized_model(w8a8: bool) -> None:
    """`moe_fp8_activations` (W8A8 experts) and weight-only fp8 experts against the fp32 source checkpoint:
    greedy agreement and the worst teacher-forced logprob error (tests/models/precision_case.py), prefill chunks
    and decode rows through the grouped GEMMs. The random model's next-token logits are nearly flat, so greedy
    paths part at near ties (weight-only fp8 keeps 12.5 % of greedy tokens, W8A8 17 %) and the bound is on the
    logprobs: measured worst error 0.097 (W8A8) and 0.031 (weight-only)."""
    from precision_case import compare

    source, _ = _model("grouped")
    fp8_dir, _ = _fp8_checkpoint(source)
    prompts = random_prompts([12, 30, 5, 20], vocab=VOCAB, seed=3)
    got = compare(source, prompts, {"moe_fp8_activations": w8a8}, max_tokens=16, option_model_dir=fp8_dir,
                  prefill_chunk_size=16, max_num_seqs=4)
    assert got.greedy_match > 0.0, got
    assert got.max_logprob_error < (0.2 if w8a8 else 0.06), got


def test_w8a8_needs_fp8_expert_weights_and_a_grouped_call() -> None:
    from hybridserve.kernels.moe import SMALL_M_MAX_PAIRS, uses_fp8_activations

    fp8, bf16 = torch.zeros(8, 4, 4, dtype=torch.float8_e4m3fn), torch.zeros(8, 4, 4)
    above = SMALL_M_MAX_PAIRS + 1
    assert uses_fp8_activations(True, fp8, above) and not uses_fp8_activations(True, fp8, SMALL_M_MAX_PAIRS)
    assert not uses_fp8_activations(False, fp8, above) and not uses_fp8_activations(True, bf16, above)


def test_quantize_and_dequantize_experts_at_load() -> None:
    model_dir, _ = _model("grouped")
    config = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    plain = load_model(model_dir, config, torch.float32, cpu)
    fp8 = load_model(model_dir, config, torch.float32, cpu, moe_fp8=True)
    experts, plain_experts = fp8.layers[1].mixer.experts, plain.layers[1].mixer.experts
    assert experts.up_proj.dtype == torch.float8_e4m3fn and experts.up_proj_scale is not None
    dequant = experts.up_proj.float() * experts.up_proj_scale[..., None]
    assert float((dequant - plain_experts.up_proj).norm() / plain_experts.up_proj.norm()) < 0.05
    fp8_dir, _ = _fp8_checkpoint(model_dir)
    back = load_model(fp8_dir, ModelConfig.from_dir(fp8_dir), torch.float32, cpu, moe_fp8=False)
    assert back.layers[1].mixer.experts.up_proj.dtype == torch.float32
    assert back.layers[1].mixer.experts.up_proj_scale is None


def test_dummy_weights_follow_the_fp8_quantization_config() -> None:
    from hybridserve.models.weights import dummy_model

    data = json.loads((_model("grouped")[0] / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "compressed-tensors",
                                   "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8}}}}
    model = dummy_model(ModelConfig.from_hf_dict(data), torch.float32, torch.device("cpu"))
    experts = model.layers[1].mixer.experts
    assert experts.up_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale is not None
    with torch.no_grad():
        assert torch.isfinite(model.layers[1].mixer(torch.randn(3, BASE_NEMOTRON_H["hidden_size"]))).all()
    data["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_hf_dict(data)


def test_nvfp4_checkpoint_is_refused() -> None:
    model_dir, _ = _model("grouped")
    directory = Path(tempfile.mkdtemp(prefix="hybridserve-nvfp4-"))
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["backbone.layers.0.mixer.in_proj.weight_scale_2"] = torch.ones(1)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="NVFP4"):
        load_model(directory, ModelConfig.from_dir(directory), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kernels", ["reference"], indirect=True)  # on the Triton kernels: the whole-engine test below
def test_mtp_with_a_moe_layer_drafts_and_verifies(kernels: str) -> None:
    """Nemotron 3's MTP module (attention + MoE) on a MoE trunk: speculative greedy output is transformers'
    greedy output of the trunk, with drafts proposed and verified through the fused experts."""
    model_dir, hf = nemotron_h_mtp("ME*E", ("attention", "moe"), moe=True)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["mtp_layers_block_type"] == ["attention", "moe"]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": "intermediate"}
    llm = LLM(model_dir, speculative_config=spec, max_model_len=96, state_block=16, page_size=8, max_num_seqs=4)
    assert isinstance(llm.engine.model.mtp.layers[1].mixer, MoE)
    prompts = random_prompts([5, 12], vocab=VOCAB, seed=7)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                                 ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]
    assert sum(o.num_draft_tokens for o in outs) > 0
    llm.engine.pool.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["grouped", "latent"])
def test_cuda_decode_graph_of_a_moe_model(case: str) -> None:
    """On CUDA the MoE layers take the Triton path and the decode step is captured as a graph (it used to fall
    back to eager on the host sync of the expert loop); greedy tokens stay transformers'."""
    model_dir, hf = _model(case)
    llm = LLM(model_dir, device="cuda", dtype="float32")
    assert llm.engine.runner.decode_graphs is not None
    prompts = random_prompts([3, 11, 30], vocab=VOCAB, seed=3)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                                 ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.slow  # ~40 s: every kernel interpreted
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test above covers the Triton path on a GPU")
def test_whole_engine_on_interpreted_triton_kernels() -> None:
    """kernel_mode="interpret": every op (Mamba, attention, norms, router, experts) on its Triton kernel, latent
    MoE and MTP-with-MoE speculative decoding give transformers' greedy tokens."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    prompts = random_prompts([3, 11], vocab=VOCAB, seed=3)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    latent_dir, latent_hf = nemotron_h_moe("ME*E", moe_latent_size=8)
    latent = LLM(latent_dir, prefill_chunk_size=8, kernel_mode="interpret")
    assert [o.token_ids for o in latent.generate(prompt_token_ids=prompts, sampling_params=greedy)] == [
        hf_greedy(latent_hf, p, 5) for p in prompts]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": "intermediate"}
    mtp_dir, mtp_hf = nemotron_h_mtp("ME*E", ("attention", "moe"), moe=True)
    mtp = LLM(mtp_dir, speculative_config=spec, max_model_len=96, state_block=16, page_size=8, max_num_seqs=4,
              kernel_mode="interpret")
    assert [o.token_ids for o in mtp.generate(prompt_token_ids=prompts, sampling_params=greedy)] == [
        hf_greedy(mtp_hf, p, 5) for p in prompts]
