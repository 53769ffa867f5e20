"""The embedded demo checkpoint (`models/demo_model/`, trained by tools/demo_model/train_demo.py): its files, its MTP
tensors, and greedy generation through `hybridserve.LLM()` equal to transformers' on it."""

from __future__ import annotations

import json
import re
from functools import lru_cache

import pytest
import torch
from checkpoints import hf_greedy
from safetensors import safe_open

from hybridserve import LLM, SamplingParams
from hybridserve.models import default_model
from hybridserve.models.default_model import DEMO_MODEL_DIR, default_model_dir

PROMPTS = ("def fib(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):")


@lru_cache(maxsize=1)
def _hf_model():  # noqa: ANN202 - NemotronHForCausalLM
    from transformers import NemotronHForCausalLM

    return NemotronHForCausalLM.from_pretrained(str(DEMO_MODEL_DIR), dtype=torch.float32).eval()


@lru_cache(maxsize=1)
def _hf_tokenizer():  # noqa: ANN202 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR), local_files_only=True)


def _config() -> dict:
    return json.loads((DEMO_MODEL_DIR / "config.json").read_text())


def test_the_default_model_is_the_demo_checkpoint() -> None:
    assert default_model_dir() == DEMO_MODEL_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "README.md", "training_report.json"):
        assert (DEMO_MODEL_DIR / name).is_file(), name
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= 50 * 10**6  # the package stays installable


def test_a_missing_demo_checkpoint_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(default_model, "DEMO_MODEL_DIR", tmp_path / "demo_model")
    with pytest.raises(FileNotFoundError, match="embedded default model is missing"):
        default_model.default_model_dir()


def test_config_declares_one_mtp_step() -> None:
    config = _config()
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1
    assert config["mtp_layers_block_type"] == ["full_attention", "mlp"]


def test_mtp_tensors_have_the_nemotron_h_mtp_layout() -> None:
    config = _config()
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = config["head_dim"], config["intermediate_size"]
    expected = {
        "mtp.layers.0.enorm.weight": [hidden],
        "mtp.layers.0.hnorm.weight": [hidden],
        "mtp.layers.0.eh_proj.weight": [hidden, 2 * hidden],
        "mtp.layers.0.norm.weight": [hidden],
        "mtp.layers.0.mixer.q_proj.weight": [heads * head_dim, hidden],
        "mtp.layers.0.mixer.k_proj.weight": [kv_heads * head_dim, hidden],
        "mtp.layers.0.mixer.v_proj.weight": [kv_heads * head_dim, hidden],
        "mtp.layers.0.mixer.o_proj.weight": [hidden, heads * head_dim],
        "mtp.layers.1.norm.weight": [hidden],
        "mtp.layers.1.mixer.up_proj.weight": [inter, hidden],
        "mtp.layers.1.mixer.down_proj.weight": [hidden, inter],
        "mtp.layers.1.final_layernorm.weight": [hidden],
    }
    with safe_open(str(DEMO_MODEL_DIR / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        mtp = {name: list(f.get_slice(name).get_shape()) for name in names if name.startswith("mtp.")}
        assert mtp == expected  # embedding and lm_head are shared with the trunk: no copies under mtp.*
        assert {f.get_slice(name).get_dtype() for name in names} == {"BF16"}
        # the trunk (saved by transformers as `backbone.*`, NVIDIA's layout) has mixers of the same names and shapes
        prefix = "backbone" if "backbone.embeddings.weight" in names else "model"
        attn = config["layers_block_type"].index("full_attention")
        mlp = config["layers_block_type"].index("mlp")
        for i, kind, projs in ((attn, 0, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, 1, ("up_proj", "down_proj"))):
            for proj in projs:
                trunk = list(f.get_slice(f"{prefix}.layers.{i}.mixer.{proj}.weight").get_shape())
                assert trunk == expected[f"mtp.layers.{kind}.mixer.{proj}.weight"]
    assert "lm_head.weight" in names and f"{prefix}.embeddings.weight" in names


def test_tokenizer_loads_offline_and_round_trips_python() -> None:
    tokenizer = _hf_tokenizer()
    assert len(tokenizer) == _config()["vocab_size"] == 4096
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == _config()["eos_token_id"]
    source = 'def area(r: float) -> float:\n    """Disk area."""\n    return 3.14159 * r ** 2  # é\n'
    ids = tokenizer.encode(source, add_special_tokens=False)
    assert tokenizer.decode(ids) == source
    assert len(ids) < len(source) / 2  # BPE merges, not bytes


def test_transformers_loads_every_trunk_weight() -> None:
    from transformers import NemotronHForCausalLM

    _, info = NemotronHForCausalLM.from_pretrained(
        str(DEMO_MODEL_DIR), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info.get("mismatched_keys")


def test_default_llm_greedy_equals_transformers_and_looks_like_python() -> None:
    llm = LLM()  # the embedded default, CPU float32
    tokenizer = _hf_tokenizer()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(list(PROMPTS), params)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer.encode(prompt)  # a prompt gets the tokenizer's BOS, as vLLM encodes it
        assert ids[0] == tokenizer.bos_token_id and ids[1:] == tokenizer.encode(prompt, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(_hf_model(), ids, 24), prompt
        text = out.text
        assert text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert "\ufffd" not in text and text.strip()
        assert all(ch.isprintable() or ch in "\n\t" for ch in text), repr(text)
        assert re.search(r"[A-Za-z_]\w*", text), repr(text)  # identifiers, not noise
