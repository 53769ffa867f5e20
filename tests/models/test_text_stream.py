"""The incremental text stream against full decoding, on random token streams fed in random-sized groups.

Four tokenizers, all built here or shipped in the repository (nothing is downloaded): the byte-level one of
the tiny random checkpoints (every id is one byte: characters split across tokens, invalid UTF-8), the demo
model's byte-level BPE (merged tokens holding parts of characters, a leading-space pre-tokenizer), and two
SentencePiece-style ones with byte-fallback tokens (a Replace/ByteFallback/Fuse/Strip decoder that drops the
first leading space, and a Metaspace decoder). Each runs through both engines of the detokenizer:
tokenizers' DecodeStream, and the Python window scheme behind a decode-only wrapper.

The oracle for stop strings is the implementation this one replaced (`_FullDecodeStream`, kept below): it
decoded every id on every delta, so its output is the specification: the new stream must release the same
deltas at the same calls and stop at the same place. With byte-fallback tokenizers the reference runs with
one flaw mended (see `whole_chars`): the new stream releases a character as soon as its last token arrives,
where the old one could wait for the next character.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.common.detokenizer import IncrementalDetokenizer
from hybridserve.common.text_stream import TextStream
from hybridserve.common.tokenizer import Tokenizer
from hybridserve.models.default_model import DEMO_MODEL_DIR, write_byte_tokenizer

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_PIECES = ["▁", "▁▁", "▁a", "b", "ab", "▁hello", "▁wörld", "é", "中", "x", ".", "▁."]
_CHARS = "aé中😀 \n"  # 1, 2, 3 and 4 UTF-8 bytes, and whitespace


class _FullDecodeStream:
    """The replaced implementation (all ids decoded on every delta): the reference for stop strings.

    `whole_chars` mends its one flaw with byte-fallback tokenizers: such a decoder turns a whole run of byte
    tokens into U+FFFD while the run's last character is incomplete ("é" + half of "中" decodes to U+FFFD x5),
    so the old stream hid "é" until "中" completed, and a stop string could be seen later or in another place
    than it appears token by token. With it, the visible text is that of the longest prefix of the ids that
    does not end in U+FFFD (for these tokenizers every token is a whole piece or one byte)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], whole_chars: bool = False) -> None:
        self._tokenizer, self._stops, self._whole_chars = tokenizer, list(stops), whole_chars
        self.token_ids: list[int] = []
        self.text, self.stopped = "", False

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        visible = self._tokenizer.decode(self.token_ids).rstrip("\ufffd")
        k = len(self.token_ids)
        while self._whole_chars and k and self._tokenizer.decode(self.token_ids[:k]).endswith("\ufffd"):
            k -= 1
            visible = self._tokenizer.decode(self.token_ids[:k])
        start = max(0, len(self.text) - max((len(s) for s in self._stops), default=0))
        found = [i for i in (visible.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self.stopped, end = True, min(found)
        else:
            end = len(visible) - self._holdback(visible)
        delta = visible[len(self.text):max(end, len(self.text))]
        self.text += delta
        return delta

    def finish(self) -> str:
        if self.stopped:
            return ""
        delta = self._tokenizer.decode(self.token_ids)[len(self.text):]
        self.text += delta
        return delta

    def _holdback(self, visible: str) -> int:
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(visible)), best, -1):
                if visible.endswith(stop[:k]):
                    best = k
                    break
        return best


class _DecodeOnly:
    """A tokenizer seen only through `decode`: the detokenizer falls back to its Python window scheme."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._inner = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self._inner.decode(token_ids)


def _sentencepiece(directory: Path, metaspace: bool) -> Tokenizer:
    """A byte-fallback BPE in the shape of Llama's (or with a Metaspace decoder), saved by transformers."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({piece: 259 + i for i, piece in enumerate(_PIECES)})
    backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = (decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()]) if metaspace else
                       decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                          decoders.Strip(" ", 1, 0)]))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(directory))
    return Tokenizer(directory)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    byte_dir = tmp_path_factory.mktemp("byte")
    write_byte_tokenizer(byte_dir)
    return {"byte": Tokenizer(byte_dir), "demo": Tokenizer(DEMO_MODEL_DIR),
            "strip": _sentencepiece(tmp_path_factory.mktemp("strip"), metaspace=False),
            "metaspace": _sentencepiece(tmp_path_factory.mktemp("metaspace"), metaspace=True)}


@st.composite
def _ids(draw, name: str) -> list[int]:
    """A token stream: any ids for the byte-level tokenizers (invalid UTF-8 included); for byte-fallback
    ones, pieces, special tokens and characters spelled as their UTF-8 byte tokens (byte-fallback decoding
    of an invalid byte run is not prefix-stable, so no incremental decoder can match it; see below)."""
    if name in ("byte", "demo"):
        vocab = 259 if name == "byte" else 4096
        return draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    units = st.one_of(st.sampled_from([[0], [1], [2]]),
                      st.integers(0, len(_PIECES) - 1).map(lambda i: [259 + i]),
                      st.sampled_from(_CHARS).map(lambda c: [3 + b for b in c.encode()]))
    return [i for unit in draw(st.lists(units, min_size=1, max_size=25)) for i in unit]


def _groups(draw, ids: list[int]) -> list[list[int]]:
    """`ids` cut into consecutive groups of 1-4 (a decode step or a speculative burst)."""
    out, at = [], 0
    while at < len(ids):
        n = draw(st.integers(1, 4))
        out.append(ids[at:at + n])
        at += n
    return out


def _front(tokenizer: Tokenizer, engine: str) -> Tokenizer:
    return tokenizer if engine == "decode_stream" else _DecodeOnly(tokenizer)  # type: ignore[return-value]


@pytest.mark.parametrize("engine", ["decode_stream", "window"])
@pytest.mark.parametrize("name", ["byte", "demo", "strip", "metaspace"])
@_SETTINGS
@given(data=st.data())
def test_deltas_add_up_to_the_full_decode(tokenizers, name: str, engine: str, data) -> None:
    tokenizer = tokenizers[name]
    ids = data.draw(_ids(name))
    stream = TextStream(_front(tokenizer, engine))
    assert stream._detok is not None and stream._detok.uses_decode_stream == (engine == "decode_stream")
    deltas = [stream.add(group) for group in _groups(data.draw, ids)]
    assert "".join(deltas) + stream.finish() == tokenizer.decode(ids)
    assert stream.text == tokenizer.decode(ids) and stream.token_ids == ids


@pytest.mark.parametrize("engine", ["decode_stream", "window"])
@pytest.mark.parametrize("name", ["byte", "demo", "strip", "metaspace"])
@_SETTINGS
@given(data=st.data())
def test_stop_strings_match_the_full_decode_implementation(tokenizers, name: str, engine: str, data) -> None:
    tokenizer = tokenizers[name]
    ids = data.draw(_ids(name))
    full = tokenizer.decode(ids)
    some_text = st.text(alphabet=sorted(set(full + "ab ")), min_size=1, max_size=4)
    substrings = st.integers(0, max(len(full) - 1, 0)).flatmap(
        lambda i: st.integers(i + 1, i + 4).map(lambda j: full[i:j] or "a"))
    stops = data.draw(st.lists(st.one_of(some_text, substrings), min_size=1, max_size=3))
    new = TextStream(_front(tokenizer, engine), stops)
    old = _FullDecodeStream(tokenizer, stops, whole_chars=name not in ("byte", "demo"))
    for group in _groups(data.draw, ids):
        assert new.add(group) == old.add(group)
        assert new.stopped == old.stopped
    assert new.finish() == old.finish() and new.text == old.text and new.stopped == old.stopped


@pytest.mark.parametrize("engine", ["decode_stream", "window"])
def test_invalid_byte_fallback_runs_do_not_break_the_stream(tokenizers, engine: str) -> None:
    """A byte-fallback run that is not UTF-8 decodes to one U+FFFD per byte, even bytes already released
    as text: DecodeStream raises on that; the stream carries on, as the full-decode stream did."""
    tokenizer = tokenizers["strip"]
    ids = [3 + 0x3F, 3 + 0xBA, 3 + 0xEF, 3 + 0x1E, 259 + _PIECES.index("▁hello"), 3 + 0xC3, 3 + 0xA9]
    new, old = TextStream(_front(tokenizer, engine)), _FullDecodeStream(tokenizer, ())
    assert [new.add([i]) for i in ids] == [old.add([i]) for i in ids]
    assert new.finish() == old.finish() and new.text == old.text


def test_the_detokenizer_keeps_a_short_window(tokenizers) -> None:
    """The window holds the last confirmed chunk and what follows, not the whole output."""
    tokenizer = tokenizers["demo"]
    ids = tokenizer.encode("def main():\n    return sorted(set(range(10)))\n" * 50)
    for use_stream in (True, False):
        detok = IncrementalDetokenizer(tokenizer, use_decode_stream=use_stream)
        confirmed = [detok.push([i])[0] for i in ids]
        assert "".join(confirmed) + detok.flush() == tokenizer.decode(ids)
        assert len(detok._ids) <= 2


def test_no_tokenizer_releases_no_text() -> None:
    stream = TextStream(None)
    assert stream.add([1, 2, 3]) == "" and stream.finish() == "" and stream.token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        TextStream(None, stops=["x"])
