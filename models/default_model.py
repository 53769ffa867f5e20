"""The embedded default model, and writers of small random checkpoints.

`default_model_dir()` is `demo_model/` beside this file: a small NemotronH with one MTP step, trained on the
Python standard library by `tools/demo_model/train_demo.py` (its README.md is the model card). The random-checkpoint
writers below (`write_random_nemotron_h`, `write_byte_tokenizer`, `random_model_dir`) serve the tests."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
RANDOM_MODEL_NAME = "nemotron-h-tiny-random-v1"
_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2

RANDOM_CONFIG: dict = {
    "vocab_size": 320,
    "hidden_size": 64,
    "hybrid_override_pattern": "M-M*M-M*",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 32,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDSERVE_CACHE", Path.home() / ".cache" / "hybridserve"))


def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for every byte value (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer (3 special tokens + 256 bytes, no merges) in transformers' layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = len(_SPECIAL_TOKENS) + b
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))


def write_random_nemotron_h(directory: Path, config: dict, seed: int) -> None:
    """A random NemotronH checkpoint written by transformers' own `save_pretrained`."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**config))
    model.save_pretrained(str(directory))


def default_model_dir() -> Path:
    """The embedded demo checkpoint (package data of `hybridserve.models`)."""
    if not (DEMO_MODEL_DIR / "config.json").is_file() or not (DEMO_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded default model is missing from {DEMO_MODEL_DIR} (config.json / model.safetensors); "
            "reinstall hybridserve, pass a checkpoint directory explicitly, or recreate it with "
            "`python tools/demo_model/train_demo.py --out-dir models/demo_model` (needs a GPU)"
        )
    return DEMO_MODEL_DIR


def random_model_dir() -> Path:
    """A small random NemotronH with a byte-level tokenizer, written under `cache_root()` on first use
    (deterministic, seed 0; atomic, safe under concurrent callers)."""
    target = cache_root() / RANDOM_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        logger.info("writing the random model to %s", target)
        write_random_nemotron_h(staging, RANDOM_CONFIG, seed=0)
        write_byte_tokenizer(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
