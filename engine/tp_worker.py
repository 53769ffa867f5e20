"""A tensor-parallel worker: rank 0 runs the whole engine (scheduler, prefix cache, sampling) over its shard;
ranks 1..N-1 are follower processes that hold their shards and state pools and replay rank 0's device work
(engine/tp_launch.py starts them).

Rank 0 broadcasts every command before running it itself, as one int64 header (the command and its sizes)
then its tensors: a forward's packed input ids + ForwardBatch metadata (an MTP drafter pass: also its
previous hidden rows), a logits call's hidden rows, a state copy's slots, the pool layout. Followers never
schedule; every rank's pools have the same layout and the same indices, so the prefix cache and its events
stay one logical cache on rank 0. gloo on CPU, NCCL on CUDA.

CUDA graphs: on CAPTURE every rank captures the same decode buckets in lockstep, so each graph holds the
block's NCCL all-reduces; a FORWARD is still broadcast eagerly (its header and inputs), and every rank then
picks the same bucket from the same batch and replays its own graph (engine/cuda_graphs.py); rank 0's
`ModelRunner.forward` sends the forward, then takes the path every follower takes in `follow`.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.config import DTYPES, EngineConfig
from hybridserve.engine.cuda_graphs import DecodeGraphs
from hybridserve.engine.spec_decode import rollback_states, snapshot_state
from hybridserve.engine.tp_handoff import follow_state_command
from hybridserve.engine.tp_watch import RankError, RankWatch
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.models.parallel import TPGroup, VocabParallelLMHead
from hybridserve.statepool.state_cache import CacheLayout, StateCache

logger = logging.getLogger(__name__)

HEADER = 16  # int64 fields of a command header
STOP, LAYOUT, FORWARD, LOGITS, COPY_STATE, ROLLBACK, SNAPSHOT, STATE, MTP_FORWARD, CAPTURE = range(10)
ROLLBACKS = (None, "intermediate", "replay")
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a dead rank surfaces as an error on the others, not a hang


def pack_forward(input_ids: torch.Tensor, batch: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """(header, int64 payload) of one forward: everything a follower needs to rebuild the ForwardBatch."""
    boundaries = batch.boundary_rows
    replay = batch.num_replay
    parts = [input_ids, batch.cu_seqlens, batch.context_lens, batch.kv_lens, batch.state_slots,
             batch.block_tables.reshape(-1), batch.slot_mapping]
    parts += [p.to(torch.int64) for p in (boundaries, replay) if p is not None]
    header = [FORWARD, input_ids.numel(), batch.num_seqs, batch.block_tables.shape[1],
              -1 if boundaries is None else boundaries.numel(), batch.num_decode, batch.decode_len,
              -1 if batch.state_block is None else batch.state_block, ROLLBACKS.index(batch.spec_rollback),
              -1 if replay is None else replay.numel(), batch.num_checkpoint_boundaries]
    return header, torch.cat([p.reshape(-1).to(torch.int64) for p in parts])


def unpack_forward(header: list[int], payload: torch.Tensor) -> tuple[torch.Tensor, ForwardBatch]:
    """The inverse of `pack_forward` on a follower."""
    n, seqs, pages, boundaries, num_decode, decode_len, block, rollback, replay, crossings = header[1:11]
    sizes = [n, seqs + 1, seqs, seqs, seqs, seqs * pages, n, max(boundaries, 0), max(replay, 0)]
    ids, cu, context, kv, slots, tables, mapping, rows, num_replay = payload.split(sizes)
    context_host = tuple(context.tolist())
    cu_host = cu.tolist()
    batch = ForwardBatch(
        num_decode=num_decode,
        query_lens=tuple(b - a for a, b in zip(cu_host, cu_host[1:])),
        cu_seqlens=cu, context_lens=context, kv_lens=kv, state_slots=slots,
        block_tables=tables.reshape(seqs, pages), slot_mapping=mapping,
        state_block=None if block < 0 else block,
        num_checkpoint_boundaries=crossings,
        boundary_rows=None if boundaries < 0 else rows,
        decode_len=decode_len, spec_rollback=ROLLBACKS[rollback],
        num_replay=None if replay < 0 else num_replay.to(torch.int32),
        context_lens_host=context_host,
    )
    return ids, batch


class Leader:
    """Rank 0's end of the group: sends each command to the followers (and owns their processes, which a
    RankWatch watches: a collective that fails because a follower died raises RankError naming it)."""

    def __init__(self, tp: TPGroup, device: torch.device, processes: list[Any], owns_group: bool,
                 global_config: ModelConfig, watch: RankWatch | None = None) -> None:
        self.tp = tp
        self.global_config = global_config  # the unsharded model (without MTP): the P/D wire layout
        self.device = device
        self.processes = processes
        self.owns_group = owns_group
        self.closed = False
        self.watch = watch

    @property
    def failure(self) -> RankError | None:
        """Why a follower rank is gone (None while every rank lives): the engine cannot step any more."""
        return self.watch.failure if self.watch is not None else None

    def checked(self) -> contextlib.AbstractContextManager[None]:
        """Around rank 0's collectives: an error caused by a dead follower raises as that follower's RankError."""
        return self.watch.checked() if self.watch is not None else contextlib.nullcontext()

    def send(self, fields: list[int], *tensors: torch.Tensor) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.device)
        header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        with self.checked():
            self.tp.broadcast(header)
            for tensor in tensors:
                self.tp.broadcast(tensor.contiguous())

    def capture_graphs(self, model: HybridLM, cache: StateCache, max_batch: int, max_pages: int) -> DecodeGraphs:
        """Capture rank 0's decode graphs with the followers capturing theirs (the all-reduces pair up); mixed
        steps stay whole under TP (every rank must take the same path). A capture error raises: ranks must not
        disagree on graphs."""
        self.send([CAPTURE, max_batch, max_pages])
        with self.checked():
            return capture_rank_graphs(model, cache, max_batch, max_pages)

    def send_forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """The followers run this forward on their shards (rank 0 then runs its own)."""
        header, payload = pack_forward(input_ids, batch)
        self.send(header, payload)

    @torch.inference_mode()
    def compute_logits(self, model: HybridLM, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] fp32: every rank computes its vocabulary shard, rank 0 gathers them."""
        hidden = hidden.to(model.lm_head.weight.dtype)
        self.send([LOGITS, hidden.shape[0], hidden.shape[1]], hidden)
        with self.checked():
            logits = cast(VocabParallelLMHead, model.lm_head).gathered_logits(hidden)
        assert logits is not None  # rank 0 receives the gather
        return logits

    def send_mtp_forward(self, model: HybridLM, input_ids: torch.Tensor, prev_hidden: torch.Tensor,
                         batch: ForwardBatch) -> None:
        """The followers run this pass of the sharded MTP drafter (its attention KV lives in each rank's pages)."""
        header, payload = pack_forward(input_ids, batch)
        prev_hidden = prev_hidden.to(model.lm_head.weight.dtype)
        self.send([MTP_FORWARD, *header[1:], prev_hidden.shape[1]], payload, prev_hidden)

    def send_layout(self, layout: CacheLayout) -> None:
        self.send([LAYOUT, layout.num_pages, layout.page_size, layout.num_slots, layout.conv_width,
                   layout.num_checkpoints])

    def send_state_command(self, export: bool, page_ids: list[int], slot: int | None, num_tokens: int) -> None:
        """A request's state leaves (export) or enters (commit) every rank's pools (engine/tp_handoff.py)."""
        pages = torch.tensor(page_ids or [0], dtype=torch.int64, device=self.device)
        self.send([STATE, int(export), -1 if slot is None else slot, num_tokens, len(page_ids)], pages)

    def shutdown(self) -> None:
        """Stop the followers and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.stop()
        try:
            self.send([STOP])
        except (RuntimeError, ValueError) as exc:  # a follower already died: its process is reaped below
            logger.warning("tensor-parallel stop not delivered: %s", exc)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


class MirroredStateCache(StateCache):
    """Rank 0's state cache: a slot copy (prefix-cache hit, checkpoint) runs on every rank's shard."""

    def __init__(self, leader: Leader, *args: Any) -> None:
        super().__init__(*args)
        self.leader = leader

    def copy_state(self, source: int, target: int) -> None:
        self.leader.send([COPY_STATE, source, target])
        super().copy_state(source, target)

    def mirror(self, op: str, *args: Any) -> None:
        """Speculative state edits: ("rollback", rollback, T, slots, computed) or ("snapshot", rollback, T,
        slot, row, done, decode_row), replayed by `spec_decode`'s functions on every follower."""
        rollback, tokens, *rest = args
        code = ROLLBACKS.index(rollback)
        if op == "rollback":
            slots, computed = rest
            payload = torch.tensor([*slots, *computed], dtype=torch.int64, device=self.leader.device)
            self.leader.send([ROLLBACK, code, tokens, len(slots)], payload)
        elif op == "snapshot":
            self.leader.send([SNAPSHOT, code, tokens, *rest])
        else:
            raise ValueError(f"unknown mirrored state op {op!r}")


def capture_rank_graphs(model: HybridLM, cache: StateCache, max_batch: int, max_pages: int) -> DecodeGraphs:
    """This rank's decode graphs (every rank captures the same buckets in the same order)."""
    graphs = DecodeGraphs(model, cache, max_batch, max_pages)
    graphs.capture()
    return graphs


@torch.inference_mode()
def follow(model: HybridLM, tp: TPGroup, device: torch.device, config: EngineConfig,
           global_config: ModelConfig) -> None:
    """Run rank 0's commands on this rank's shard until STOP."""
    cache: StateCache | None = None
    states: dict[int, torch.Tensor] = {}  # the last verify's per-token SSM states (rollback "intermediate")
    spec = config.speculative
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    ssm_dtype = DTYPES[model.config.ssm_state_dtype]
    graphs: DecodeGraphs | None = None  # once rank 0 asked for CUDA graphs
    while True:
        fields = tp.broadcast(header).tolist()
        command = fields[0]
        if command == STOP:
            return
        if command == LAYOUT:
            layout = CacheLayout(*fields[1:6])
            cache = StateCache(model.config, layout, config.torch_dtype, ssm_dtype, device)
            if spec is not None and spec.rollback == "replay":
                cache.enable_replay(spec.num_verify_tokens)
        elif command in (FORWARD, MTP_FORWARD):
            size = sum(max(f, 0) for f in (fields[1], fields[2] + 1, 3 * fields[2], fields[2] * fields[3],
                                           fields[1], fields[4], fields[9]))
            payload = tp.broadcast(torch.empty(size, dtype=torch.int64, device=device))
            input_ids, batch = unpack_forward(fields, payload)
            assert cache is not None, "rank 0 sends the layout before any forward"
            if command == FORWARD:  # rank 0's path (`ModelRunner.forward`): a decode graph's bucket, or eager
                size = graphs.bucket_for(batch) if graphs is not None else None
                if graphs is not None and size is not None:
                    graphs.replay(size, input_ids, batch)
                else:
                    model(input_ids, batch, cache)
                states = batch.intermediate_states
            else:
                prev = torch.empty(fields[1], fields[11], dtype=model.lm_head.weight.dtype, device=device)
                model.mtp_forward(input_ids, tp.broadcast(prev), batch, cache)
        elif command == CAPTURE:
            assert cache is not None
            graphs = capture_rank_graphs(model, cache, fields[1], fields[2])
        elif command == LOGITS:
            hidden = tp.broadcast(torch.empty(fields[1], fields[2], dtype=model.lm_head.weight.dtype, device=device))
            cast(VocabParallelLMHead, model.lm_head).gathered_logits(hidden)
        elif command == COPY_STATE:
            assert cache is not None
            cache.copy_state(fields[1], fields[2])
        elif command == ROLLBACK:
            assert cache is not None
            count = fields[3]
            index = tp.broadcast(torch.empty(2 * count, dtype=torch.int64, device=device)).tolist()
            rollback_states(cache, cast(str, ROLLBACKS[fields[1]]), fields[2], index[:count], index[count:], states)
        elif command == SNAPSHOT:
            assert cache is not None
            tokens, slot, row, done, decode_row = fields[2:7]
            snapshot_state(cache, model, cast(str, ROLLBACKS[fields[1]]), tokens, slot, row, done, decode_row, states)
        elif command == STATE:
            assert cache is not None
            export, slot, num_tokens, num_pages = fields[1:5]
            pages = tp.broadcast(torch.empty(max(num_pages, 1), dtype=torch.int64, device=device)).tolist()
            follow_state_command(tp, global_config, cache, bool(export), pages[:num_pages],
                                 None if slot < 0 else slot, num_tokens, config.torch_dtype)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command}")
