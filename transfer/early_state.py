"""A state sent while its prompt still prefills (gRPC plane): the KV of each finished chunk leaves early.

The state's `kv` comes first and token-major (`state_layout`), so the bytes final after t computed prompt
tokens are a prefix of the flat state. At the end of each step that computed a chunk of the prompt (the
engine's `on_progress` hook, on the loop thread) the prefill worker copies the new KV rows into one arena
block and records an event; the block is taken at the first chunk boundary, never while the request is
queued (a queued holder could starve finished requests that hold the engine's slots). The PushState streams
open then; their producer hands out each staged range once its event completed, so the device->host copy of
chunk i and its send overlap the compute of chunk i+1. The step the prompt finishes in stages the rest (last
KV rows, conv, SSM, hidden); first token, cached tokens and the device digest, unknown when the manifest
left, go in the trailers (`StateTail`). In the forward of the last chunk (`transfer.layer_staging`) each Mamba
layer's SSM state / conv window is staged once that layer ran and the rest of the KV once the last attention
layer ran, so those bytes leave while later layers still compute; the step's end stages what is left (hidden).
With that path the layout splits the KV (`split_kv_specs`: kv, ssm, conv, kv_tail, hidden) so the Mamba states
need not wait for the last chunk's KV rows. Staged ranges join the sent prefix once every byte before them is.

States: waiting (no block yet) -> streaming (block taken) -> staged (all bytes) -> finished (tail known);
or declined (no block at the first boundary, or the prompt finished in one step: the worker sends the
usual way) or failed (the prefill failed or was aborted: the streams are cancelled, so the decode worker
frees the reservation).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import torch

from hybridserve.proto import worker_pb2
from hybridserve.statepool.state_cache import StateCache
from hybridserve.transfer.arena import ArenaRange
from hybridserve.transfer.digest import device_digest
from hybridserve.transfer.grpc_sender import ReadyPart
from hybridserve.transfer.state_layout import StateTensorSpec, stage_kv_rows, state_nbytes, state_views

PIECE_BYTES = 4 << 20  # staged ranges are handed out in pieces this big: the copy of one overlaps the send of another


class EarlyState:
    """One request's state, staged into an arena block chunk by chunk and read by its PushState producer."""

    def __init__(self, specs: list[StateTensorSpec], digest_on_device: bool) -> None:
        if not specs or specs[0].name != "kv":
            raise ValueError("an early-sent state needs KV first in its layout")
        self.specs = specs
        self.head_rows = specs[0].shape[0]  # rows in `kv`; the rest, if split, in `kv_tail` (`split_kv_specs`)
        tail = next((spec for spec in specs if spec.name == "kv_tail"), None)
        self.num_tokens = self.head_rows + (tail.shape[0] if tail is not None else 0)
        self.row_bytes = specs[0].nbytes // max(self.head_rows, 1)
        self.total_bytes = state_nbytes(specs)
        self.block: ArenaRange | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.staged_tokens = 0  # kv rows staged so far
        self._offsets: dict[str, int] = {}  # tensor name -> its first byte in the block
        offset = 0
        for spec in specs:
            self._offsets[spec.name] = offset
            offset += spec.nbytes
        self.staged_layers: set[int] = set()  # Mamba layers (pool index) whose ssm and conv were staged
        self._frontier = 0  # bytes [0, frontier) are staged
        self._pending: dict[int, tuple[int, torch.cuda.Event | None]] = {}  # staged ranges past the frontier
        self._last_ready: torch.cuda.Event | None = None  # follows every staging copy (set by `staged`)
        self._digest_on_device = digest_on_device
        self._staged: list[tuple[int, torch.cuda.Event | None]] = []  # (end byte, event it is final after)
        self._state = "waiting"
        self._error: BaseException | None = None
        self._tail: tuple[int, int] | None = None  # (first token, cached tokens)
        self._calls: list[grpc.Future] = []
        self._cond = threading.Condition()
        self.handed_bytes = 0  # handed to the streams' host copy so far (producer thread)
        self.handed_before_last: int | None = None  # ... when the last step staged the rest
        self.handed_before_tail: int | None = None  # ... when the first token became known

    # ---- the engine loop's side -----------------------------------------------------------------
    def begin(self, block: ArenaRange) -> None:
        """The block this state is staged in (taken at the first chunk boundary); the streams may open."""
        with self._cond:
            self.block = block
            self.views = state_views(block.data, self.specs)
            self._state = "streaming"
            self._cond.notify_all()

    def decline(self) -> None:
        """No early send for this request (the worker sends it the usual way); a no-op once streaming."""
        with self._cond:
            if self._state == "waiting":
                self._state = "declined"
                self._cond.notify_all()

    @property
    def streaming(self) -> bool:
        """Whether the block was taken (the state goes this way, or fails)."""
        return self.block is not None

    def _kv_rows(self, start: int, end: int) -> list[tuple[str, int, int]]:
        """(tensor, first row, end row) in the block of prompt rows [start, end): in `kv`, then `kv_tail`."""
        out = []
        if start < min(end, self.head_rows):
            out.append(("kv", start, min(end, self.head_rows)))
        if end > max(start, self.head_rows):
            out.append(("kv_tail", max(start, self.head_rows) - self.head_rows, end - self.head_rows))
        return out

    def stage_kv(self, cache: StateCache, page_ids: list[int], end: int) -> None:
        """Queue the copies of the KV rows not staged yet, up to prompt row `end` (then `advance(end, ...)`)."""
        for name, first, last in self._kv_rows(self.staged_tokens, end):
            shift = 0 if name == "kv" else self.head_rows  # the tensor's row 0 is this prompt row
            stage_kv_rows(cache, page_ids, first + shift, last + shift, self.views[name][first:last])

    def advance(self, tokens: int, ready: torch.cuda.Event | None) -> None:
        """KV rows up to `tokens` were staged (queued copies that `ready` follows)."""
        start, self.staged_tokens = self.staged_tokens, tokens
        for name, first, last in self._kv_rows(start, tokens):
            self._range_staged(self._offsets[name] + first * self.row_bytes, self._offsets[name] + last * self.row_bytes,
                               ready)

    def layer_views(self, layer: int) -> dict[str, torch.Tensor]:
        """Views of Mamba layer `layer`'s SSM state and conv window in the block (pool index)."""
        return {name: self.views[name][layer] for name in ("ssm", "conv")}

    def layer_staged(self, layer: int, ready: torch.cuda.Event | None) -> None:
        """Mamba layer `layer`'s SSM state and conv window were staged (queued copies that `ready` follows)."""
        self.staged_layers.add(layer)
        for name in ("ssm", "conv"):
            per_layer = self.views[name][0].numel() * self.views[name].element_size()
            start = self._offsets[name] + layer * per_layer
            self._range_staged(start, start + per_layer, ready)

    def _range_staged(self, start: int, end: int, ready: torch.cuda.Event | None) -> None:
        """Bytes [start, end) were staged; the producer gets them once every byte before them is staged."""
        with self._cond:
            self._pending[start] = (end, ready)
            while self._frontier in self._pending:
                end, ready = self._pending.pop(self._frontier)
                if end > self._frontier:
                    self._staged.append((end, ready))
                self._frontier = max(self._frontier, end)
            self._cond.notify_all()

    def rest_views(self) -> dict[str, torch.Tensor]:
        """Views of what the last step stages at its end: the kv rows not staged yet, SSM and conv unless the
        forward staged every layer's, hidden."""
        layers_done = "ssm" in self.views and len(self.staged_layers) == self.views["ssm"].shape[0]
        rest = {"kv": min(self.staged_tokens, self.head_rows), "kv_tail": max(self.staged_tokens - self.head_rows, 0)}
        return {name: view[rest[name]:] if name in rest else view for name, view in self.views.items()
                if not (layers_done and name in ("ssm", "conv"))}

    def staged(self, ready: torch.cuda.Event | None) -> None:
        """Every byte of the state was staged (queued copies that `ready` follows: it follows every earlier
        staging copy too)."""
        with self._cond:
            self.staged_tokens = self.num_tokens
            self.handed_before_last = self.handed_bytes
            self._pending.clear()
            if self._frontier < self.total_bytes or not self._staged:
                self._staged.append((self.total_bytes, ready))
            self._frontier = self.total_bytes
            self._last_ready = ready
            self._state = "staged"
            self._cond.notify_all()

    # ---- the handler's side ---------------------------------------------------------------------
    def finish(self, first_token: int, num_cached_tokens: int) -> None:
        """The prompt's first token and cached tokens: the trailers can be written."""
        with self._cond:
            self._tail = (first_token, num_cached_tokens)
            self.handed_before_tail = self.handed_bytes
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The prefill failed: wake the producer with `error` and cancel the streams (the decode worker then
        frees the reservation). A no-op once the trailers were written."""
        with self._cond:
            if self._state in ("failed", "declined") or self._tail is not None and self._state == "staged":
                return
            self._state, self._error = "failed", error
            calls = list(self._calls)
            self._cond.notify_all()
        for call in calls:
            call.cancel()

    def watch(self, calls: list[grpc.Future]) -> None:
        """The PushState calls of this state: cancelled if it fails."""
        with self._cond:
            self._calls = list(calls)
            failed = self._state == "failed"
        if failed:
            for call in calls:
                call.cancel()

    # ---- the producer's side --------------------------------------------------------------------
    def wait_streaming(self) -> bool:
        """Block until the block was taken (True) or the early send was declined or failed (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state != "waiting")
            return self.block is not None and self._state != "failed"

    def parts(self) -> Iterator[ReadyPart]:
        """The block's bytes in order, each range once staged, with the event it is final after."""
        block = self.block
        if block is None:
            raise RuntimeError("the early state has no block")
        sent = index = 0
        while sent < self.total_bytes:
            with self._cond:
                self._cond.wait_for(lambda: index < len(self._staged) or self._state == "failed")
                self._raise_if_failed()
                end, ready = self._staged[index]
            index += 1
            for start in range(sent, end, PIECE_BYTES):
                yield ReadyPart(block.data[start : min(end, start + PIECE_BYTES)], ready)
                self.handed_bytes = min(end, start + PIECE_BYTES)
            sent = max(sent, end)

    def tail(self) -> worker_pb2.StateTail:
        """The trailers' tail; waits for the first token (and on CUDA digests the staged bytes)."""
        with self._cond:
            self._cond.wait_for(lambda: (self._tail is not None and self._state == "staged") or self._state == "failed")
            self._raise_if_failed()
            first_token, cached = self._tail  # type: ignore[misc]  # set: waited for above
            ready = self._last_ready
        digest = 0
        block = self.block
        if self._digest_on_device and block is not None and block.data.device.type == "cuda":
            # a side stream that follows the last staging copies only (not the loop's later steps)
            stream = torch.cuda.Stream(device=block.data.device)
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                digest = device_digest(block.data)
        return worker_pb2.StateTail(first_token=first_token, num_cached_tokens=cached, device_digest=digest)

    def _raise_if_failed(self) -> None:
        if self._state == "failed":
            raise self._error if self._error is not None else RuntimeError("the early state failed")
