"""Dense fp8 linears: a tiny NemotronH checkpoint quantized in the test as ModelOpt (per-tensor weights, calibrated
static input scales) and compressed-tensors (per-channel weights, per-token activations) write it keeps its
linears in fp8 and gives the logits of transformers on the dequantized weights within a stated bound; the ignore
lists, the dummy weights of an fp8 quantization_config, and the errors of what is not supported."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoints import BASE_NEMOTRON_H, hf_logits, nemotron_h, nemotron_h_mtp, random_prompts
from fp8_checkpoint import FORMATS, _bare, fp8_checkpoint, quantization_config
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from hybridserve.common.model_config import ModelConfig
from hybridserve.models.layers import Linear
from hybridserve.models.weights import dummy_model, load_model

FP8 = torch.float8_e4m3fn
CPU = torch.device("cpu")
PATTERN = "M*-M*M*-"
PROMPTS = random_prompts([12, 30, 5], BASE_NEMOTRON_H["vocab_size"], seed=3)
# largest |logit| difference against transformers on the dequantized weights: the activations' e4m3 rounding
# (measured 0.017 for both formats, logits up to 0.42 on this random model)
LOGIT_BOUND = 0.05


def _linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def _dequantized_reference(hf: torch.nn.Module, dequantized: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' model with the checkpoint's fp8 weights dequantized (its own weights elsewhere)."""
    reference = type(hf)(hf.config).eval()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for name, value in dequantized.items():
        state[next(k for k in state if _bare(k) == _bare(name))] = value
    reference.load_state_dict(state)
    return reference


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_keeps_fp8_and_matches_dequantized_logits(fmt: str) -> None:
    source, hf = nemotron_h(PATTERN)
    model_dir, dequantized = fp8_checkpoint(source, fmt, hf, prompts=PROMPTS)
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, CPU)
    linears = _linears(model)
    kept = {n for n, m in linears.items() if m.weight.dtype == FP8}
    assert kept == set(linears) - {"lm_head"}  # Mamba in/out, q/k/v/o, MLP up/down
    assert linears["lm_head"].weight.dtype == torch.float32
    in_proj = linears["layers.0.mixer.in_proj"]
    assert in_proj.weight_scale is not None
    if fmt == "modelopt":  # per-tensor weight scale, calibrated static activation scale
        assert in_proj.weight_scale.shape == (1,) and in_proj.input_scale is not None
    else:  # per-channel weight scales, per-token activation scales at run time
        assert in_proj.weight_scale.shape == (in_proj.out_features,) and in_proj.input_scale is None
    plain = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, CPU, dense_fp8=False)
    assert all(m.weight.dtype == torch.float32 and not m.is_fp8 for m in _linears(plain).values())

    llm = LLM(model_dir, prefill_chunk_size=16)
    assert llm.engine.model.layers[0].mixer.in_proj.weight.dtype == FP8
    reference = _dequantized_reference(hf, dequantized)
    for prompt in PROMPTS:
        error = float((llm.prompt_logits(prompt) - hf_logits(reference, prompt)).abs().max())
        assert error < LOGIT_BOUND, (fmt, error)


def test_ignored_modules_stay_in_the_model_dtype() -> None:
    """Modules the checkpoint leaves unquantized (its ignore list) load as stored; q/k/v run as one GEMM, so an
    attention layer with one of them unquantized runs all three in the model dtype."""
    source, hf = nemotron_h(PATTERN)
    model_dir, _ = fp8_checkpoint(source, "compressed-tensors", ignore=("layers.3.mixer.in_proj",
                                                                       "layers.1.mixer.k_proj"))
    linears = _linears(load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, CPU))
    assert linears["layers.3.mixer.in_proj"].weight.dtype == torch.float32
    assert linears["layers.3.mixer.out_proj"].weight.dtype == FP8
    assert {linears[f"layers.1.mixer.{p}"].weight.dtype for p in ("q_proj", "k_proj", "v_proj")} == {torch.float32}
    assert linears["layers.1.mixer.o_proj"].weight.dtype == FP8
    assert linears["layers.4.mixer.q_proj"].weight.dtype == FP8


def test_mtp_layer_runs_fp8_and_keeps_greedy_output() -> None:
    """The MTP drafter's linears (fusion projection, attention, MLP) load fp8 too; speculative greedy decoding
    with it gives the fp8 model's own greedy tokens."""
    model_dir, _ = fp8_checkpoint(nemotron_h_mtp("M*-M")[0], "compressed-tensors")
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": "intermediate"}
    engine = dict(max_model_len=96, state_block=16, page_size=8, max_num_seqs=4)
    mtp = LLM(model_dir, speculative_config=spec, **engine)
    drafter = mtp.engine.model.mtp
    assert drafter is not None and drafter.layers[0].eh_proj.weight.dtype == FP8
    assert drafter.layers[0].mixer.q_proj.weight.dtype == FP8 and drafter.layers[1].mixer.up_proj.weight.dtype == FP8
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([5, 12], BASE_NEMOTRON_H["vocab_size"], seed=7)
    outs = mtp.generate(prompt_token_ids=prompts, sampling_params=greedy)
    plain = LLM(model_dir, **engine).generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_dummy_weights_of_an_fp8_config_are_fp8(fmt: str) -> None:
    data = json.loads((nemotron_h(PATTERN)[0] / "config.json").read_text())
    data["quantization_config"] = quantization_config(fmt, ignore=("backbone.layers.2.mixer*",))
    config = ModelConfig.from_hf_dict(data)
    model = dummy_model(config, torch.float32, CPU)
    linears = _linears(model)
    assert linears["layers.0.mixer.in_proj"].weight.dtype == FP8
    assert linears["layers.1.mixer.q_proj"].weight.dtype == FP8
    assert linears["layers.2.mixer.up_proj"].weight.dtype == torch.float32  # excluded by its pattern
    assert linears["lm_head"].weight.dtype == torch.float32
    mlp = linears["layers.7.mixer.up_proj"]
    assert (mlp.input_scale is not None) == (fmt == "modelopt")
    assert mlp.weight_scale is not None and mlp.weight_scale.shape == ((1,) if fmt == "modelopt" else (48,))
    with torch.no_grad():
        assert torch.isfinite(model.layers[7].mixer(torch.randn(3, BASE_NEMOTRON_H["hidden_size"]))).all()
    plain = dummy_model(ModelConfig.from_hf_dict({k: v for k, v in data.items() if k != "quantization_config"}),
                        torch.float32, CPU)
    fp8_weight = mlp.weight.float() * mlp.weight_scale[:, None]  # the same random draw, quantized
    drawn = plain.layers[7].mixer.up_proj.weight
    assert float((fp8_weight - drawn).norm() / drawn.norm()) < 0.05


def test_dummy_engine_runs_with_fp8_dense_layers(tmp_path: Path) -> None:
    source = nemotron_h(PATTERN)[0]
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = quantization_config("modelopt")
    (tmp_path / "config.json").write_text(json.dumps(data))
    llm = LLM(tmp_path, load_format="dummy", prefill_chunk_size=16)
    assert llm.engine.model.layers[3].mixer.out_proj.weight.dtype == FP8
    assert torch.isfinite(llm.prompt_logits(PROMPTS[0])).all()


def test_quantization_config_spellings() -> None:
    from hybridserve.common.fp8_scheme import parse_fp8_scheme

    newer = parse_fp8_scheme({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                      "ignore": ["lm_head", "*.layers.5.*"]}})
    assert newer is not None and newer.activation == "static" and not newer.quantizes("layers.5.mixer.q_proj")
    assert newer.quantizes("layers.4.mixer.in_proj")
    per_token = parse_fp8_scheme({"quantization_config": {"quant_method": "modelopt",
                                                          "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}})
    assert per_token is not None and (per_token.activation, per_token.per_channel) == ("dynamic", True)
    regex = parse_fp8_scheme({"quantization_config": quantization_config("compressed-tensors", ("re:.*mixer\\.o_proj$",))})
    assert regex is not None and not regex.quantizes("layers.1.mixer.o_proj") and regex.quantizes("layers.1.mixer.q_proj")
    assert parse_fp8_scheme({}) is None


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}},
     "8-bit float"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "block"}}}}, "strategy"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4"),
    ({"quant_method": "awq"}, "not supported"),
])
def test_unsupported_quantization_configs_are_value_errors(quant: dict, match: str) -> None:
    data = json.loads((nemotron_h(PATTERN)[0] / "config.json").read_text())
    data["quantization_config"] = quant
    with pytest.raises(ValueError, match="quantization_config") as info:
        ModelConfig.from_hf_dict(data)
    assert match in str(info.value)


def _edited_checkpoint(edit: str) -> Path:
    model_dir, _ = fp8_checkpoint(nemotron_h(PATTERN)[0], "modelopt", nemotron_h(PATTERN)[1], prompts=PROMPTS)
    directory = Path(tempfile.mkdtemp(prefix="hybridserve-fp8-bad-"))
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    tensors = load_file(str(directory / "model.safetensors"))
    if edit == "no weight_scale":
        del tensors["backbone.layers.0.mixer.in_proj.weight_scale"]
    else:
        tensors["backbone.layers.0.mixer.in_proj.input_scale"] = torch.ones(4)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("edit,match", [("no weight_scale", "no layers.0.mixer.in_proj.weight_scale"),
                                        ("per-channel input scale", "per-tensor static")])
def test_missing_or_malformed_scales_are_value_errors(edit: str, match: str) -> None:
    directory = _edited_checkpoint(edit)
    with pytest.raises(ValueError, match=match):
        load_model(directory, ModelConfig.from_dir(directory), torch.float32, CPU)
