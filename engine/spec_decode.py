"""Speculative decoding inside the engine step: drafts in, one verify pass, acceptance, state rollback.

Per step, every decoding request feeds T = K+1 tokens (its last token and K drafts, padded when fewer were
proposed) through the target in one pass. After acceptance of `a` drafts the request has computed j = a+1
new tokens (fewer when a stop rule cut them), and its state rolls back to the last of them:
  KV:   by length (the rejected positions are overwritten by the next step);
  conv: the window slides back by T - j columns (the window is K columns wider than the kernel needs);
  SSM:  "intermediate": the state after token j-1 is copied from the per-token states of the pass;
        "replay": the slot keeps the state before the pass and the next verify folds in its j tokens.
A state_block boundary crossed inside the accepted tokens gets its prefix-cache checkpoint from the same
per-token states (or a partial replay), so speculation and prefix caching work together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from hybridserve.common.outputs import TokenLogprob
from hybridserve.engine.logits_processors import needs_processing, process_row
from hybridserve.engine.logprobs import sampled_logprobs
from hybridserve.engine.model_runner import VerifyInputs
from hybridserve.engine.mtp_drafter import CatchUp, MTPDrafter
from hybridserve.engine.ngram_drafter import NgramIndex
from hybridserve.engine.rejection import Acceptance, accept_greedy, accept_sampled
from hybridserve.engine.request import Request
from hybridserve.engine.spec_config import SpeculativeConfig
from hybridserve.engine.step_output import StepOutput
from hybridserve.engine.structured_output import GrammarBackend, fill_verify_masks
from hybridserve.kernels.host_index import pack_to_device
from hybridserve.kernels.ops import advance_states
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.models.mamba_mixer import Mamba2Mixer
from hybridserve.statepool.state_cache import StateCache


@dataclass
class SpecMetrics:
    """Counters of one engine: verify rows that carried drafts, drafted / accepted tokens, and how often
    the draft at each position was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify pass: 1 + accepted drafts per pass (1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def shift_windows(windows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """windows [R, ..., W] slid right by shift[r] columns (zeros enter on the left): the window as it was
    shift[r] tokens earlier, valid in its last W - shift[r] columns."""
    width = windows.shape[-1]
    source = torch.arange(width, device=windows.device)[None, :] - shift.to(windows.device)[:, None]  # [R, W]
    shape = (source.shape[0],) + (1,) * (windows.dim() - 2) + (width,)
    moved = torch.gather(windows, -1, source.clamp(min=0).view(shape).expand_as(windows))
    return moved.masked_fill((source < 0).view(shape), 0)


def snapshot_state(cache: StateCache, model: HybridLM, rollback: str, tokens: int, slot: int, row: int, done: int,
                   decode_row: int, intermediate_states: dict[int, torch.Tensor]) -> None:
    """Write slot's Mamba state after `done` of its T verify tokens into row `row` (conv windows slid back;
    SSM state from the per-token states or a partial replay). Every tensor-parallel rank runs it on its shard."""
    device = cache.conv_states.device
    source, target = torch.tensor([slot], device=device), torch.tensor([row], device=device)
    cache.conv_states[target] = shift_windows(cache.conv_states[source], torch.tensor([tokens - done]))
    for layer in model.config.layers_of("mamba"):
        ssm_pool = cache.mamba(layer)[1]
        if rollback == "intermediate":
            ssm_pool[row] = intermediate_states[layer][decode_row, done - 1]
        else:
            A = cast(Mamba2Mixer, model.layers[layer].mixer).decay_rates()  # a Mamba layer's mixer
            advance_states(ssm_pool, cache.replay_cache(layer), source, target, torch.tensor([done]), A)


def rollback_states(cache: StateCache, rollback: str, tokens: int, slots: list[int], computed: list[int],
                    intermediate_states: dict[int, torch.Tensor]) -> None:
    """Leave each slot's state after its `computed[i]` of T verify tokens (the replay rollback folds them in
    at the next verify: only the conv windows move now). Every tensor-parallel rank runs it on its shard."""
    device = cache.conv_states.device
    index, kept = pack_to_device([slots, computed], torch.int64, device)  # no stream sync (torch.tensor(device=))
    cache.conv_states[index] = shift_windows(cache.conv_states[index], tokens - kept)
    if rollback == "intermediate":
        rows = torch.arange(len(slots), device=device)
        for layer, states in intermediate_states.items():
            cache.mamba(layer)[1][index] = states[rows, kept - 1]


@dataclass
class _VerifyStep:
    """What the snapshot and rollback of one step need to know."""

    output: StepOutput
    rows: dict[int, int]  # id(request) -> decode row
    before: dict[int, int]  # id(request) -> computed tokens before the step


class SpecDecoder:
    """Owns the drafter, builds the verify inputs, accepts, rolls back and counts."""

    def __init__(self, config: SpeculativeConfig, model: HybridLM, cache: StateCache, page_size: int) -> None:
        self.config = config
        self.model = model
        self.cache = cache
        self.num_drafts = config.num_speculative_tokens
        self.tokens = config.num_verify_tokens
        self.metrics = SpecMetrics(accepted_per_position=[0] * self.num_drafts)
        self.mtp: MTPDrafter | None = None
        if config.method == "mtp":
            if model.mtp is None:
                raise ValueError(
                    "speculative_config method 'mtp' needs a checkpoint with an MTP module (config "
                    "`num_nextn_predict_layers` and `mtp.*` weights); use method 'ngram' for this model"
                )
            self.mtp = MTPDrafter(model, cache, page_size, self.num_drafts)
        self._step: _VerifyStep | None = None
        self._output: StepOutput | None = None
        self.grammar: GrammarBackend | None = None  # set by the engine on its first structured request
        self._external: Callable[[Request], list[int]] | None = None

    def set_drafter(self, drafter: Callable[[Request], list[int]] | None) -> None:
        """Replace the drafts of every verify by `drafter(request)` (oracle drafts for benchmarks and tests;
        the MTP drafter, if any, still runs so its plumbing and cost stay in the step). None restores."""
        self._external = drafter

    # ---- before the forward ---------------------------------------------------------------------
    def verify_inputs(self, decodes: list[Request]) -> VerifyInputs | None:
        """T tokens per decode row: the last token, the drafts, padding (never accepted) up to K."""
        if not decodes:
            return None
        cfg = self.config
        rows = []
        for request in decodes:
            if self._external is not None:
                request.draft_tokens, request.draft_probs = list(self._external(request))[: self.num_drafts], None
            elif self.mtp is None:
                if request.ngram_index is None:
                    request.ngram_index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                request.draft_tokens = request.ngram_index.propose(request.all_token_ids, self.num_drafts)
                request.draft_probs = None
            drafts = request.draft_tokens[: self.num_drafts]
            last = request.all_token_ids[-1]
            rows.append([last, *drafts] + [last] * (self.num_drafts - len(drafts)))
        return VerifyInputs(rows, cfg.rollback, [r.replay_pending for r in decodes])

    # ---- after the forward ----------------------------------------------------------------------
    def accept(self, decodes: list[Request], output: StepOutput) -> StepOutput:
        """The step's output with each verify row's new tokens: its accepted drafts + one target token; counts
        them. The output is kept for this step's commit (snapshot, rollback)."""
        raw_verify = output.verify_logits  # before the processors: what logprobs report
        output = self._processed(decodes, output)
        results = self._acceptances(decodes, output)
        new_token_ids = [r.tokens for r in results] + output.new_token_ids[len(results):]
        logprobs = self._logprobs(decodes, results, output, raw_verify)
        output = dataclasses.replace(output, new_token_ids=new_token_ids, logprobs=logprobs)
        self._output = output
        return output

    def _processed(self, decodes: list[Request], output: StepOutput) -> StepOutput:
        """Verify logits with each request's logits processors, position j seeing the drafts before it as output."""
        logits = output.verify_logits
        if logits is None or not any(needs_processing(r.params) or r.grammar is not None for r in decodes):
            return output
        logits = logits.float().clone()
        eos = self.model.config.eos_token_ids
        for row, request in enumerate(decodes):
            drafts = request.draft_tokens[: self.num_drafts]
            if needs_processing(request.params):
                for j in range(len(drafts) + 1):
                    process_row(logits[row, j], request.params, request.prompt_token_ids,
                                request.output_token_ids + drafts[:j], eos)
            if request.grammar is not None and self.grammar is not None:
                fill_verify_masks(self.grammar, logits[row], request.grammar, drafts)
        return dataclasses.replace(output, verify_logits=logits)

    def _logprobs(self, decodes: list[Request], results: list[Acceptance], output: StepOutput,
                  raw_verify: torch.Tensor | None) -> list[list[TokenLogprob]] | None:
        """The step's logprobs with those of the kept verify tokens, from the verify logits at their positions
        (the same function plain decoding applies to its one position)."""
        wanted = [row for row, r in enumerate(decodes) if r.params.logprobs is not None and row < len(results)]
        if not wanted:
            return output.logprobs
        merged = list(output.logprobs) if output.logprobs is not None else [[] for _ in output.new_token_ids]
        logits = raw_verify
        assert logits is not None  # results exist only with verify logits
        rows = [logits[row, : len(results[row].tokens)] for row in wanted]  # [j, V] each
        params = [decodes[row].params for row in wanted for _ in range(len(results[row].tokens))]
        tokens = [t for row in wanted for t in results[row].tokens]
        found = sampled_logprobs(torch.cat(rows), params, tokens)
        offset = 0
        for row in wanted:
            n = len(results[row].tokens)
            merged[row] = found[offset : offset + n]
            offset += n
        return merged

    def _acceptances(self, decodes: list[Request], output: StepOutput) -> list[Acceptance]:
        logits = output.verify_logits
        if not decodes or logits is None:
            return []
        argmax = logits.argmax(dim=-1).tolist()  # [nd, T], one host sync for the greedy rows
        results = []
        for row, request in enumerate(decodes):
            drafts = request.draft_tokens[: self.num_drafts]
            if request.params.greedy:
                result = accept_greedy(argmax[row], drafts)
            else:
                result = accept_sampled(logits[row], drafts, request.draft_probs, request.params, request.generator)
            self.metrics.observe(len(drafts), result.num_accepted)
            request.num_draft_tokens += len(drafts)
            request.num_accepted_tokens += result.num_accepted
            results.append(result)
        return results

    def begin_commit(self, decodes: list[Request], before: list[int]) -> None:
        """The verify rows of the step `accept` saw, with their computed counts before it."""
        assert self._output is not None  # accept ran this step
        self._step = _VerifyStep(
            self._output, {id(r): i for i, r in enumerate(decodes)}, {id(r): b for r, b in zip(decodes, before)}
        )
        self._output = None

    def snapshot(self, request: Request, num_tokens: int, row: int) -> None:
        """Write the request's state after `num_tokens` tokens (inside this step's verify) into checkpoint
        row `row`: conv window slid back, SSM state from the per-token states or a partial replay, and the
        carried hidden state for the drafter."""
        step, cache = self._step, self.cache
        assert step is not None and request.state_slot is not None  # begin_commit ran; decodes hold slots
        decode_row = step.rows[id(request)]
        done = num_tokens - step.before[id(request)]  # tokens of this step before the boundary, 1..T
        args = (self.config.rollback, self.tokens, request.state_slot, row, done, decode_row)
        cache.mirror("snapshot", *args)
        snapshot_state(cache, self.model, *args, step.output.batch.intermediate_states)
        if cache.hidden_states.shape[0]:
            cache.hidden_states[row] = step.output.hidden[decode_row * self.tokens + done - 1]

    def rollback(self, decodes: list[Request], computed: list[int]) -> None:
        """Leave each decode row's state after its `computed[i]` new tokens (1..T)."""
        if not decodes:
            return
        slots = [r.state_slot for r in decodes]
        assert None not in slots  # decode rows hold their slots
        if self.config.rollback == "intermediate":
            assert self._step is not None
        states = self._step.output.batch.intermediate_states if self._step is not None else {}
        self.cache.mirror("rollback", self.config.rollback, self.tokens, slots, computed)
        rollback_states(self.cache, self.config.rollback, self.tokens, slots, computed, states)  # type: ignore[arg-type]
        if self.config.rollback == "replay":
            for request, count in zip(decodes, computed):
                request.replay_pending = count
        self._step = None

    def catch_up(self, work: list[CatchUp]) -> None:
        """MTP: the drafter's slots for this step's tokens, then drafts for requests that keep decoding."""
        if self.mtp is not None:
            self.mtp.run(work)
