"""Reading config.json and safetensors as transformers writes them; clear errors that name the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import hf_logits, nemotron_h, random_prompts

from hybridserve import LLM
from hybridserve.common.model_config import ModelConfig

NANO_9B = Path(__file__).resolve().parents[3] / "shared" / "configs" / "nemotron-nano-9b-v2.json"

NANO_9B_FIELDS = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
    "hidden_size": 4480, "intermediate_size": 15680, "num_hidden_layers": 56,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
    "mamba_head_dim": 80, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
}


def test_hybrid_override_pattern_of_nemotron_nano_9b() -> None:
    data = json.loads(NANO_9B.read_text()) if NANO_9B.is_file() else NANO_9B_FIELDS
    config = ModelConfig.from_hf_dict(data)
    assert config.num_layers == 56
    assert config.layer_types.count("mamba") == 27 and config.layer_types.count("attention") == 4
    assert config.layer_types.count("mlp") == 25
    assert config.pattern == data["hybrid_override_pattern"]
    assert config.mamba.conv_dim == 128 * 80 + 2 * 8 * 128
    assert config.attention.num_kv_heads == 8


def test_layers_block_type_in_new_and_legacy_names() -> None:
    base = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 32, "mamba_num_heads": 4, "n_groups": 2,
            "intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2}
    new = ModelConfig.from_hf_dict({**base, "layers_block_type": ["linear_attention", "full_attention", "mlp"]})
    legacy = ModelConfig.from_hf_dict({**base, "layers_block_type": ["mamba", "attention", "mlp"]})
    assert new.layer_types == legacy.layer_types == ("mamba", "attention", "mlp")


@pytest.mark.parametrize(
    "data, field",
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "architectures"),
        ({"model_type": "nemotron_h", "hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
        ({"model_type": "nemotron_h", "hybrid_override_pattern": "M*", "num_hidden_layers": 3}, "num_hidden_layers"),
        ({"model_type": "nemotron_h", "layers_block_type": ["mamba", "conv"]}, "layers_block_type"),
        ({"model_type": "nemotron_h", "hybrid_override_pattern": "M", "mamba_num_heads": 6, "n_groups": 4}, "n_groups"),
        ({"model_type": "nemotron_h", "hybrid_override_pattern": "*", "num_attention_heads": 6,
          "num_key_value_heads": 4}, "num_key_value_heads"),
        ({"model_type": "nemotron_h", "hybrid_override_pattern": "M", "hidden_size": 0}, "hidden_size"),
        ({"model_type": "mamba2", "hidden_size": 32, "num_heads": 3, "head_dim": 16}, "hidden_size"),
        ({"model_type": "mamba2", "hidden_size": 32, "num_heads": 4, "head_dim": 16,
          "time_step_limit": [0.0]}, "time_step_limit"),
    ],
)
def test_inconsistent_configs_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(data)


def test_sharded_checkpoint_loads_the_same(tmp_path: Path) -> None:
    model_dir, hf = nemotron_h("M*-M")
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    prompt = random_prompts([10], vocab=128, seed=30)[0]
    torch.testing.assert_close(LLM(tmp_path).prompt_logits(prompt), hf_logits(hf, prompt), rtol=1e-4, atol=1e-5)


def test_missing_tensor_and_missing_files_are_named(tmp_path: Path) -> None:
    model_dir, _ = nemotron_h("M*-M")
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    dropped = next(k for k in state if k.endswith("A_log"))
    del state[dropped]
    (tmp_path / "broken").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "broken" / "config.json")
    save_file(state, str(tmp_path / "broken" / "model.safetensors"))
    with pytest.raises(ValueError, match="A_log"):
        LLM(tmp_path / "broken")
    (tmp_path / "empty").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(tmp_path / "empty")
    with pytest.raises(ValueError, match="config.json"):
        LLM(tmp_path)


def test_dummy_load_format_needs_only_the_config(tmp_path) -> None:
    """load_format="dummy": random weights from config.json alone (benchmarks of real shapes)."""
    import shutil

    from checkpoints import nemotron_h

    from hybridserve import LLM, SamplingParams

    shutil.copy(nemotron_h("M*-M")[0] / "config.json", tmp_path / "config.json")
    out = LLM(tmp_path, load_format="dummy").generate(
        prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="load_format"):
        LLM(tmp_path, load_format="npz")


def test_mamba_decay_rates_follow_a_log() -> None:
    """A = -exp(A_log) is computed once per loaded A_log, not per step, and a reload (in place or a new tensor)
    is seen at the next call."""
    from hybridserve.common.model_config import MambaConfig
    from hybridserve.models.mamba_mixer import Mamba2Mixer

    mixer = Mamba2Mixer(16, MambaConfig(num_heads=4, head_dim=8, state_size=4, n_groups=1, conv_kernel=4,
                                        chunk_size=8, use_conv_bias=True, proj_bias=False, dt_limit=(0.0, 1e9)), 1e-5)
    with torch.no_grad():
        mixer.A_log.copy_(torch.tensor([0.0, 0.5, 1.0, 2.0]))
    first = mixer.decay_rates()
    assert torch.equal(first, -torch.exp(mixer.A_log.float()))
    assert mixer.decay_rates() is first  # cached
    with torch.no_grad():
        mixer.A_log.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))  # reloaded in place
    assert torch.equal(mixer.decay_rates(), torch.full((4,), -torch.e))
    mixer.A_log = torch.nn.Parameter(torch.zeros(4), requires_grad=False)  # replaced (a tensor-parallel shard)
    assert torch.equal(mixer.decay_rates(), -torch.ones(4))
