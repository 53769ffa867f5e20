"""Incremental detokenization: token ids in, text out, in time proportional to the new tokens.

Decoding all of a request's ids again for every delta costs O(n) per token, O(n^2) per generation. Here
only a short window is decoded: the window starts at the first token of the last chunk of text that was
confirmed (so decoders that treat the first token specially, like SentencePiece's leading-space strip or a
Metaspace prefix, see the same context in both decodes), and a token's text is its window's text minus the
window prefix's text. Text is *confirmed* once the window's text does not end in U+FFFD, i.e. no character
is still waiting for its remaining bytes (byte-level BPE and byte-fallback tokens split characters).

Two engines, one state:

* `tokenizers.decoders.DecodeStream` (tokenizers >= 0.21) runs exactly that prefix/read-offset algorithm in
  Rust, one call per token (~1 us, against ~2.5 us for a Python-driven window decode on the demo
  tokenizer). It is chosen whenever the tokenizer is a fast (tokenizers-backed) one whose `decode` adds no
  Python-side post-processing (`clean_up_tokenization_spaces` off), because only then is its text the
  tokenizer's own `decode`.
* Otherwise (a slow tokenizer, clean-up on, an older tokenizers, a stub with only `decode`), the same
  scheme runs here over the tokenizer's `decode`. It also takes over for the rest of a stream if
  DecodeStream refuses a token: it raises when a later decode is not an extension of the earlier one
  (byte-fallback runs that are not valid UTF-8 turn already-released bytes into U+FFFD), which must not
  kill a request.

Both engines keep the window's ids here, so text that is not yet confirmed (a token ending in half a
character, whose complete characters the old full-decode stream released at once) and the final flush are
computed the same way for both. The window grows only while no character completes (a run of tokens that
are all invalid bytes); real text confirms every few tokens at most.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder yields for bytes that do not (yet) form a character


def _backend_of(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind `tokenizer` when its `decode(ids)` is exactly the backend's
    `decode(ids, skip_special_tokens=True)`; None when that cannot be established.

    `hybridserve.common.tokenizer.Tokenizer` keeps the transformers tokenizer in `_tokenizer` and decodes with
    `skip_special_tokens=True`; a transformers fast tokenizer exposes `backend_tokenizer` and post-processes
    only when `clean_up_tokenization_spaces` is on."""
    try:
        from tokenizers import Tokenizer as BackendTokenizer
    except ImportError:
        return None
    hf = getattr(tokenizer, "_tokenizer", None)
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, BackendTokenizer) or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Text of a growing list of token ids, confirmed chunk by chunk, equal in sum to one full decode.

    `push(ids)` returns `(confirmed, tentative)`: `confirmed` is final text to append; `tentative` is the
    decodable text of the tokens after it (trailing U+FFFD removed), which the next push may extend or
    confirm. `flush()` returns the text of the unconfirmed tokens as a full decode would show it."""

    def __init__(self, tokenizer: Any, use_decode_stream: bool = True) -> None:
        backend = _backend_of(tokenizer)
        self._stream: Any | None = None
        self._decode: Callable[[list[int]], str]
        if backend is not None:
            self._backend = backend
            self._decode = self._backend_decode
            if use_decode_stream:
                try:
                    from tokenizers.decoders import DecodeStream
                except ImportError:  # tokenizers < 0.21
                    pass
                else:
                    self._stream = DecodeStream(skip_special_tokens=True)
        else:
            self._decode = tokenizer.decode
        self._ids: list[int] = []  # the window: ids from the first token of the last confirmed chunk on
        self._read = 0  # self._ids[:self._read] are confirmed, the rest are not
        self._prefix_text: str | None = ""  # decode(self._ids[:self._read]); None: not decoded yet

    @property
    def uses_decode_stream(self) -> bool:
        """Whether tokenizers' DecodeStream confirms the text (False: the Python window scheme)."""
        return self._stream is not None

    def _backend_decode(self, ids: list[int]) -> str:
        return str(self._backend.decode(ids, skip_special_tokens=True))

    def push(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """Add ids; the newly confirmed text and the tentative text after it.

        Both engines go token by token, so text is confirmed at the same token boundaries whatever the
        grouping (a group ending in half a character does not hold back the complete ones before it)."""
        confirmed: list[str] = []
        for token_id in token_ids:
            self._ids.append(token_id)
            chunk = self._step(token_id)
            if chunk:
                confirmed.append(chunk)
        if self._read == len(self._ids):
            return "".join(confirmed), ""
        return "".join(confirmed), self._unconfirmed_text().rstrip(REPLACEMENT)

    def flush(self) -> str:
        """The text of the unconfirmed tokens (may end in U+FFFD, as a full decode of invalid bytes does).
        Later pushes go on from there with the window scheme (DecodeStream cannot be told of the flush)."""
        self._stream = None
        if self._read == len(self._ids):
            return ""
        text = self._unconfirmed_text()
        self._advance()
        return text

    def _step(self, token_id: int) -> str | None:
        """Confirm the text of the unconfirmed ids (the last one just appended) when no character in it is
        incomplete; None while one is."""
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - DecodeStream raises a bare Exception; see the module doc
                self._stream = None  # the window scheme takes over from the same state
            else:
                if chunk is not None:
                    self._advance()
                return chunk
        text = self._unconfirmed_text()
        if not text or text.endswith(REPLACEMENT):
            return None
        self._advance()
        return text

    def _unconfirmed_text(self) -> str:
        """The window's text minus its confirmed prefix's text: what the unconfirmed ids add."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[:self._read])
        return self._decode(self._ids)[len(self._prefix_text):]

    def _advance(self) -> None:
        """Everything in the window is confirmed: the last chunk starts the next window."""
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._prefix_text = None  # decoded when next needed (never, while DecodeStream confirms every token)
