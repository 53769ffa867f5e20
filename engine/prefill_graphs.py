"""CUDA graphs for prefill steps: the forward of up to SEQS - 1 prefill chunks (fresh or resumed) of at most a
bucket of tokens in all, captured once per token bucket and replayed with the batch copied into static buffers.

An eager prefill step of a 9B hybrid is bound by the host's ~400 kernel launches (~25 ms on the H200 whatever the
chunk size up to 1024 tokens: bench/results/h200/serving/); a replay costs one graph launch
plus a dozen small copies. Everything a captured forward reads is fixed at capture: token count, sequence count,
SSD chunk count, checkpoint count, attention work list. A batch is fitted to them by padding:
- the tokens past the real ones form one *padding sequence* (fresh, state slot -1, KV slots -1: every kernel
  skips its state and KV writes; its attention is not computed, its outputs are discarded);
- the sequences after it have no tokens; each owns one empty SSD chunk (the state walk needs one per sequence),
  the last one also the empty chunks that fill the chunk count;
- checkpoint rows past the batch's are -1 (not kept), attention work items past the batch's are no-ops.
The per-batch index metadata the layers share (`ForwardBatch._derived`: SSD chunks, conv windows, attention
blocks) is built on the host from these padded lists and travels in one int64 and one int32 copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from hybridserve.kernels.ops import (
    INT32_FIELDS,
    PREFILL_BLOCK_M,
    WHOLE_SEQUENCE,
    ChunkMeta,
    ConvVarlenMeta,
    QueryBlocks,
    chunk_lists,
    query_block_lists,
)
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.state_cache import StateCache

logger = logging.getLogger(__name__)

# Token buckets, up to 1024: past that a prefill step is bound by the GPU, not by its launches (on the H200 a lone
# 1100-token prompt took 39.0 ms padded to 1280 in a graph vs 35.2 ms eagerly, 2048 tokens 60.0 vs 59.3 ms; 128
# tokens 10.9 vs 29.2 ms: bench/results/h200/serving/).
DEFAULT_TOKEN_BUCKETS = (64, 128, 256, 384, 512, 640, 768, 896, 1024)
SEQS = 8  # sequences per captured prefill by default: up to 7 real ones, then the padding sequence (and empty ones)
ALIGN = 16  # bytes: every static index array starts 16-byte aligned (Triton specializes on pointer alignment)


@dataclass(frozen=True)
class PrefillShape:
    """The fixed sizes of one captured prefill forward."""

    tokens: int
    seqs: int
    chunks: int  # SSD chunks: every real sequence adds at most 2 partial ones, the padding ones 1 each
    kept: int  # state_block boundaries (checkpoints) of the real sequences
    blocks: int  # attention work items (PREFILL_BLOCK_M queries of one sequence)

    @classmethod
    def for_bucket(cls, tokens: int, seqs: int, chunk_size: int, state_block: int) -> PrefillShape:
        """The bounds for `tokens` tokens in `seqs` sequences: a real sequence of n tokens spans fewer than
        n / chunk_size + 2 chunks (partial ones at both ends), the padding one fewer than its tokens / chunk_size + 1,
        an empty one 1; n / state_block + 1 boundaries; n / PREFILL_BLOCK_M + 1 attention blocks."""
        return cls(tokens, seqs, tokens // chunk_size + 2 * seqs, tokens // state_block + seqs + 1,
                   tokens // PREFILL_BLOCK_M + seqs + 1)


def _int64_fields(shape: PrefillShape) -> dict[str, int]:
    """Sizes of the int64 index arrays of a shape (cu_seqlens, positions, conv token owners, boundaries)."""
    s, n, k = shape.seqs, shape.tokens, shape.kept
    return {"cu": s + 1, "context": s, "kv": s, "token_seq": n, "boundary_seq": k, "boundary_pos": k}


def _int32_fields(shape: PrefillShape) -> dict[str, int]:
    """Sizes of the int32 index arrays of a shape (SSD chunks, conv windows, attention blocks)."""
    s, c, k, b = shape.seqs, shape.chunks, shape.kept, shape.blocks
    chunk = {"chunk_start": c, "chunk_len": c, "seq_chunk_ptr": s + 1, "keep_idx": c, "seg_chunk_ptr": s + 1,
             "seg_seq": s, "seg_first": s, "seq_seg_ptr": s + 1, "chunk_seg": c}
    assert tuple(chunk) == INT32_FIELDS  # the same arrays ChunkMeta holds
    return {**chunk, "final_seq": s, "final_len": s, "boundary_seq32": k, "boundary_len": k, "gather_seq": s + k,
            "gather_len": s + k, "block_seq": b, "block_row": b}


def padded_lists(
    shape: PrefillShape, query_lens: list[int], starts: list[int], chunk_size: int, state_block: int
) -> tuple[dict[str, list[int]], dict[str, list[int]], int] | None:
    """(int64 arrays, int32 arrays, real checkpoint count) of a prefill batch fitted to `shape` (module docstring),
    or None when it does not fit (too many sequences, tokens, chunks, checkpoints or attention blocks)."""
    real, n = len(query_lens), sum(query_lens)
    seqs, tokens = shape.seqs, shape.tokens
    if real >= seqs or n > tokens:
        return None
    pad = tokens - n
    lens = [*query_lens, pad, *[0] * (seqs - real - 1)]
    begins = [*starts, *[0] * (seqs - real)]
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    lists = chunk_lists(cu[: real + 1], list(starts), chunk_size, state_block)
    chunk_start, chunk_len, seq_ptr = lists.chunk_start, lists.chunk_len, lists.seq_chunk_ptr  # extended below
    for seq in range(real, seqs):
        if seq == real and pad:  # the padding sequence, fresh: chunks at multiples of chunk_size from its start
            for token in range(n, tokens, chunk_size):
                chunk_start.append(token)
                chunk_len.append(min(chunk_size, tokens - token))
        else:
            chunk_start.append(tokens)
            chunk_len.append(0)
        if seq == seqs - 1:
            fill = shape.chunks - len(chunk_start)
            chunk_start.extend([tokens] * max(fill, 0))
            chunk_len.extend([0] * max(fill, 0))
        seq_ptr.append(len(chunk_start))
    kept = len(lists.kept_seq)
    # the conv's windows are kept at the same boundaries as the scan's states, in the same order
    b_seq, b_pos = list(lists.kept_seq), list(lists.kept_pos)
    b_len = [pos - starts[seq] for seq, pos in zip(b_seq, b_pos)]
    block_seq, block_row = query_block_lists(query_lens)
    if len(chunk_start) > shape.chunks or kept > shape.kept or len(block_seq) > shape.blocks:
        return None
    # the padding sequence's queries get real work items: with no keys (kv_len 0) they store zeros, so no row of
    # the attention output is left uninitialized (garbage there could reach an MoE router's top-k)
    pad_blocks = list(range(0, pad, PREFILL_BLOCK_M))
    block_seq += [real] * len(pad_blocks)
    block_row += pad_blocks
    if len(block_seq) > shape.blocks:
        return None
    more_kept, more_blocks = shape.kept - kept, shape.blocks - len(block_seq)
    b_seq += [real] * more_kept  # the padding sequence's, with no row to write (boundary rows -1)
    b_pos += [0] * more_kept
    b_len += [0] * more_kept
    int64 = {
        "cu": cu, "context": begins, "kv": [s + q for s, q in zip(starts, query_lens)] + [0] * (seqs - real),
        "token_seq": [seq for seq, length in enumerate(lens) for _ in range(length)],
        "boundary_seq": b_seq, "boundary_pos": b_pos,
    }
    int32 = {
        "chunk_start": chunk_start, "chunk_len": chunk_len, "seq_chunk_ptr": seq_ptr,
        "keep_idx": lists.keep_idx + [-1] * (len(chunk_start) - len(lists.keep_idx)),
        "seg_chunk_ptr": seq_ptr, "seg_seq": list(range(seqs)), "seg_first": [1] * seqs,
        "seq_seg_ptr": list(range(seqs + 1)), "chunk_seg": [-1] * shape.chunks,
        "final_seq": list(range(seqs)), "final_len": lens, "boundary_seq32": b_seq, "boundary_len": b_len,
        "gather_seq": list(range(seqs)) + b_seq, "gather_len": lens + b_len,
        # past the real work items: the padding sequence at row `tokens`, past its queries: nothing runs
        "block_seq": block_seq + [real] * more_blocks, "block_row": block_row + [tokens] * more_blocks,
    }
    return int64, int32, kept


class _PackedIndex:
    """Named index arrays of fixed sizes, each a 16-byte-aligned view of one device buffer, loaded in one copy."""

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device) -> None:
        per_block = ALIGN // torch.empty((), dtype=dtype).element_size()
        self.sizes = sizes
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = total
            total += -(-size // per_block) * per_block
        self.dtype = dtype
        self.total = total
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        self.views = {name: self.buffer[off : off + sizes[name]] for name, off in self.offsets.items()}

    def load(self, values: dict[str, list[int]]) -> None:
        """Copy `values` (every array, each of its fixed size) into the buffer: one host -> device copy."""
        packed = [0] * self.total
        for name, size in self.sizes.items():
            array = values[name]
            if len(array) != size:
                raise RuntimeError(f"static index array {name} takes {size} entries, got {len(array)}")
            offset = self.offsets[name]
            packed[offset : offset + size] = array
        self.buffer.copy_(torch.tensor(packed, dtype=self.dtype), non_blocking=True)


class PrefillBuffers:
    """What one captured prefill forward reads: the token ids, the batch's placement (slots, pages, checkpoint rows)
    and the shared index metadata, all at fixed addresses (`new_batch` is a ForwardBatch over them)."""

    def __init__(self, shape: PrefillShape, max_pages: int, chunk_size: int, state_block: int,
                 device: torch.device) -> None:
        self.shape = shape
        self.chunk_size = chunk_size
        self.state_block = state_block
        s, n = shape.seqs, shape.tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.state_slots = torch.full((s,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(s, max_pages, dtype=torch.int64, device=device)
        self.boundary_rows = torch.full((shape.kept,), -1, dtype=torch.int64, device=device)
        self.int64 = _PackedIndex(_int64_fields(shape), torch.int64, device)
        self.int32 = _PackedIndex(_int32_fields(shape), torch.int32, device)

    def new_batch(self) -> ForwardBatch:
        """A ForwardBatch over the buffers. A fresh one per forward: a batch memoizes what its layers derive from
        its tensors (the SSD scan's initial-state rows), which must be recomputed inside each captured forward."""
        shape, v64, v32 = self.shape, self.int64.views, self.int32.views
        s, n, k = shape.seqs, shape.tokens, shape.kept
        query_lens = (n,) + (0,) * (s - 1)  # host values are only read for the token count and the attention path
        batch = ForwardBatch(
            num_decode=0, query_lens=query_lens, cu_seqlens=v64["cu"], context_lens=v64["context"],
            kv_lens=v64["kv"], state_slots=self.state_slots, block_tables=self.block_tables,
            slot_mapping=self.slot_mapping, state_block=self.state_block, num_checkpoint_boundaries=k,
            boundary_rows=self.boundary_rows, context_lens_host=(0,) * s,
        )
        batch._derived[("chunks", self.chunk_size, self.state_block)] = ChunkMeta(
            num_seqs=s, num_chunks=shape.chunks, num_kept=k, kept_seq=v64["boundary_seq"],
            kept_pos=v64["boundary_pos"], num_segments=s, segment_chunks=WHOLE_SEQUENCE,
            **{name: v32[name] for name in INT32_FIELDS},
        )
        batch._derived[("conv", self.state_block)] = ConvVarlenMeta(
            seq_lens=list(query_lens), boundary_seq=[0] * k, boundary_pos=[0] * k, boundary_len=[0] * k,
            token_seq=v64["token_seq"], gather_seq=v32["gather_seq"], gather_len=v32["gather_len"],
            final_seq=v32["final_seq"], final_len=v32["final_len"], boundary_seq_i32=v32["boundary_seq32"],
            boundary_len_i32=v32["boundary_len"], boundary_seq_t=v64["boundary_seq"],
            boundary_pos_t=v64["boundary_pos"],
        )
        batch._derived[("attention",)] = QueryBlocks(query_lens, v32["block_seq"], v32["block_row"])
        batch._derived[("rows",)] = (self.state_slots, v64["context"])  # both own 16-byte-aligned arrays
        batch._derived[("prefill_cu",)] = v64["cu"]  # no decode rows: the offsets start at 0
        return batch

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether a prefill-only batch can be loaded (a cheap check; `load` may still find it too wide)."""
        return (batch.num_decode == 0 and batch.layer_done is None and batch.context_lens_host is not None
                and 0 < batch.num_tokens <= self.shape.tokens and batch.num_seqs < self.shape.seqs
                and batch.block_tables.shape[1] <= self.block_tables.shape[1]
                and (batch.boundary_rows is None or batch.state_block == self.state_block))

    def load(self, input_ids: torch.Tensor, batch: ForwardBatch) -> bool:
        """Copy a prefill-only batch (`fits`) into the buffers, padded; False when it has more chunks, checkpoints
        or attention blocks than the shape holds (then nothing was written)."""
        assert batch.context_lens_host is not None  # fits()
        lists = padded_lists(self.shape, list(batch.query_lens), list(batch.context_lens_host), self.chunk_size,
                             self.state_block)
        if lists is None:
            return False
        int64, int32, kept = lists
        rows = batch.boundary_rows
        if rows is not None and rows.numel() != kept:
            return False  # not this step's boundaries: the eager forward says what is wrong
        n, s, pages = batch.num_tokens, batch.num_seqs, batch.block_tables.shape[1]
        self.int64.load(int64)
        self.int32.load(int32)
        self.input_ids[:n].copy_(input_ids)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:].fill_(-1)
        self.state_slots[:s].copy_(batch.state_slots)
        self.state_slots[s:].fill_(-1)
        self.block_tables[:s, :pages].copy_(batch.block_tables)
        if rows is not None and kept:
            self.boundary_rows[:kept].copy_(rows)
            self.boundary_rows[kept:].fill_(-1)
        else:
            self.boundary_rows.fill_(-1)
        return True

    def load_empty(self) -> None:
        """Every token in the padding sequence: a forward that writes no state, no KV and no checkpoint (capture)."""
        lists = padded_lists(self.shape, [], [], self.chunk_size, self.state_block)
        assert lists is not None
        self.int64.load(lists[0])
        self.int32.load(lists[1])
        self.slot_mapping.fill_(-1)
        self.state_slots.fill_(-1)
        self.boundary_rows.fill_(-1)


class PrefillGraphs:
    """Captured prefill forwards of `model` over `cache`, one per token bucket up to `max_tokens`."""

    def __init__(self, model: HybridLM, cache: StateCache, max_pages: int, chunk_size: int, state_block: int,
                 max_tokens: int, buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS, seqs: int = SEQS) -> None:
        if state_block % chunk_size:
            raise ValueError(f"state_block ({state_block}) must be a multiple of chunk_size ({chunk_size})")
        self.model = model
        self.cache = cache
        if max_tokens <= 0 or not buckets:
            raise ValueError(f"prefill graphs need token buckets and max_tokens > 0, got {buckets}, {max_tokens}")
        # up to the step's prefill budget (itself a bucket); past the largest bucket a prefill runs eagerly (a step
        # that large is bound by the GPU, not by its launches)
        top = min(max_tokens, max(buckets))
        self.buckets = tuple(sorted({b for b in buckets if b < top} | {top}))
        device = next(model.parameters()).device
        self.buffers = {b: PrefillBuffers(PrefillShape.for_bucket(b, seqs, chunk_size, state_block),
                                          max_pages, chunk_size, state_block, device) for b in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream | None = None) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool; on `stream` when given (an
        SM partition's: the graphs' kernels then run on its SMs), else on side streams."""
        lane = stream
        stream = lane if lane is not None else torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):  # compiles / autotunes every kernel at this shape eagerly
                buffers = self.buffers[size]
                buffers.load_empty()
                self.model(buffers.input_ids, buffers.new_batch(), self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.buckets):
            buffers = self.buffers[size]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=lane):
                hidden = self.model(buffers.input_ids, buffers.new_batch(), self.cache)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, hidden)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The smallest bucket whose buffers take this batch, or None (it runs eagerly)."""
        if not self.graphs or batch.num_decode:
            return None
        size = next((b for b in self.buckets if b >= batch.num_tokens), None)
        return size if size is not None and self.buffers[size].fits(batch) else None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden] of a prefill-only batch by graph replay (a view of the graph's output,
        valid until its next replay), or None: the caller runs the model eagerly."""
        size = self.bucket_for(batch)
        if size is None or not self.buffers[size].load(input_ids, batch):
            return None
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[: batch.num_tokens]


def capture_prefill_graphs(model: HybridLM, cache: StateCache, max_pages: int, state_block: int,
                           max_tokens: int) -> PrefillGraphs | None:
    """Prefill graphs of `model` over `cache` on CUDA, or None: a model whose prefill cannot be captured keeps
    running it eagerly."""
    mamba = model.config.mamba
    graphs = PrefillGraphs(model, cache, max_pages, mamba.chunk_size if mamba else state_block, state_block, max_tokens)
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - a capture failure of any kind leaves the eager prefill, which works
        logger.warning("prefill step not capturable as a CUDA graph, running it eagerly: %s", exc)
        torch.cuda.synchronize()
        return None
    logger.info("captured prefill CUDA graphs for %s-token buckets", ", ".join(map(str, graphs.buckets)))
    return graphs
