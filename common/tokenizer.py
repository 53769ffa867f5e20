"""Tokenizer of a checkpoint directory (transformers' files, loaded offline), or none."""

from __future__ import annotations

from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer:
    """Thin wrapper over a transformers tokenizer: text <-> token ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    @staticmethod
    def available(model_dir: str | Path) -> bool:
        return any((Path(model_dir) / name).is_file() for name in _TOKENIZER_FILES)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        return self._tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. As in vLLM, a plain prompt gets the tokenizer's own special tokens (its
        post-processor's BOS, where it has one); text rendered by a chat template passes False, since the
        template writes them itself."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The directory's tokenizer, or None when it ships none (then prompts must be token ids)."""
    return Tokenizer(model_dir) if Tokenizer.available(model_dir) else None
