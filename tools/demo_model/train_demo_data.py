"""Data of the demo model's training (tools/demo_model/train_demo.py): the corpus (the stdlib, or the archive that
tools/demo_model/train_demo_fetch.py packs) split by file, the byte-level BPE tokenizer, token streams and training
windows."""

from __future__ import annotations

import hashlib
import json
import random
import re
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

EOS = "<|endoftext|>"
SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    root: Path
    train: list[tuple[str, str]]  # (relative path, text)
    heldout: list[tuple[str, str]]
    validation: list[tuple[str, str]]  # picks the best step; never reported as held-out
    skipped: int
    manifest: dict | None = None  # the archive's MANIFEST.json (packages, versions, licences)


def split_bucket(rel: str) -> int:
    """Deterministic file-level split: a hash of the relative path, 0..99."""
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100


def split_key(name: str) -> str:
    """The name a file's split bucket hashes: stdlib files keep their stdlib-relative path (the split of the
    earlier stdlib-only runs and of tests/engine/test_demo_mtp.py), package files `<package>/<path>`."""
    return name.removeprefix("stdlib/")


def archive_files(archive: Path) -> tuple[list[tuple[str, bytes]], dict]:
    """([(name, source)] in archive order, MANIFEST.json) of a corpus archive."""
    files, manifest = [], {}
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == "MANIFEST.json":
                manifest = json.loads(data)
            else:
                files.append((member.name, data))
    return files, manifest


def load_corpus(
    heldout_percent: int, validation_percent: int, max_files: int | None, archive: Path | None = None
) -> Corpus:
    """Every *.py file of the archive, or of this interpreter's stdlib (sorted; site-packages excluded;
    non-UTF-8 files skipped)."""
    manifest = None
    if archive is not None:
        root = archive.resolve()
        named, manifest = archive_files(archive)
    else:
        root = Path(sysconfig.get_paths()["stdlib"]).resolve()
        paths = sorted(p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts))
        named = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in paths]
    if max_files is not None:
        named = named[:max_files]
    train, heldout, validation, skipped = [], [], [], 0
    for name, data in named:
        rel = split_key(name)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        bucket = split_bucket(rel)
        if bucket < heldout_percent:
            heldout.append((rel, text))
        elif bucket < heldout_percent + validation_percent:
            validation.append((rel, text))
        else:
            train.append((rel, text))
    return Corpus(root, train, heldout, validation, skipped, manifest)


def duplicate_line_fraction(text: str, min_chars: int = 8) -> float:
    """Share of a file's lines (stripped, >= min_chars) that occur more than once in it; 0 below 10 lines.
    Gopher's (Rae et al. 2021) repetition filter, with a code-sized threshold: a file that is mostly copies
    of its own lines (generated tables, parametrised tests, boilerplate docstrings) teaches a small model the
    line loops it falls into under greedy decoding."""
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) >= min_chars]
    if len(lines) < 10:
        return 0.0
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return sum(n for n in counts.values() if n > 1) / len(lines)


def drop_repetitive(files: list[tuple[str, str]], max_fraction: float) -> tuple[list[tuple[str, str]], int]:
    """(files whose duplicate-line fraction is <= max_fraction, how many were dropped); 1.0 keeps all."""
    if max_fraction >= 1.0:
        return files, 0
    kept = [(name, text) for name, text in files if duplicate_line_fraction(text) <= max_fraction]
    return kept, len(files) - len(kept)


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):  # noqa: ANN201 - PreTrainedTokenizerFast
    """Byte-level BPE (GPT-2 style pre-tokenization) saved in transformers' layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS, unk_token=None, model_max_length=4096
    )
    return save_with_bos(fast, out_dir)


def save_with_bos(fast, out_dir: Path):  # noqa: ANN001, ANN201 - PreTrainedTokenizerFast
    """Give the tokenizer a BOS (the document separator EOS, GPT-2 style) on encode with special tokens, and save
    it in transformers' layout. Training documents follow an EOS, so a prompt that starts with one reads as
    the start of a file: without it the model cannot tell a prompt's first line from the middle of a file
    and indents top-level code as if it were a method body."""
    from tokenizers import processors

    eos_id = fast.convert_tokens_to_ids(EOS)
    fast._tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)]),
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # the class name transformers 4.x and 5.x both resolve (5.x writes its own `TokenizersBackend`)
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    special = out_dir / "special_tokens_map.json"
    if not special.is_file():
        special.write_text(json.dumps({"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)


def line_pieces(text: str, rate: float, rng: random.Random) -> list[str]:
    """`text` split right after a random `rate` share of its newlines (all pieces joined give `text` back)."""
    if rate <= 0.0:
        return [text]
    pieces, start = [], 0
    for match in re.finditer("\n", text):
        end = match.end()
        if end < len(text) and rng.random() < rate:
            pieces.append(text[start:end])
            start = end
    pieces.append(text[start:])
    return pieces


def encode_stream(tokenizer, texts: list[str], line_break_rate: float = 0.0, seed: int = 0) -> torch.Tensor:  # noqa: ANN001
    """All documents concatenated, each followed by EOS.

    With `line_break_rate` > 0 a random share of line ends is encoded as a piece boundary: BPE then ends the
    line with a lone newline token and starts the next one with its indentation, which is exactly how a
    prompt that ends in a newline is tokenized. Without it the model only ever sees newline+indent merged
    and, given a prompt ending in a bare newline, continues at column 0 (the prompt-boundary problem).
    """
    eos = tokenizer.convert_tokens_to_ids(EOS)
    rng = random.Random(seed)
    split = [line_pieces(text, line_break_rate, rng) for text in texts]
    encoded = iter(tokenizer._tokenizer.encode_batch([p for pieces in split for p in pieces], add_special_tokens=False))
    ids: list[int] = []
    for pieces in split:
        for _ in pieces:
            ids.extend(next(encoded).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def windows_of(stream: torch.Tensor, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """Non-overlapping [seq_len + 1] windows (consecutive windows share one boundary token)."""
    count = max(0, (stream.numel() - 1) // seq_len)
    if max_windows is not None:
        count = min(count, max_windows)
    idx = torch.arange(count)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]
