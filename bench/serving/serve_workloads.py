"""Workloads and arrival processes of the serving benchmark (`bench/serving/serve.py`).

Prompts are random token ids (every hybridserve server takes token-id prompts, with or without a tokenizer),
drawn from `token_range` so they stay inside any served vocabulary. A workload is a list of *sessions*: a
session is one request (`random`, `shared-prefix`) or one conversation whose turns run in order
(`multi-turn`); sessions start at the arrival offsets.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

WORKLOADS = ("random", "shared-prefix", "multi-turn")
ARRIVALS = ("poisson", "fixed")


@dataclass
class Turn:
    """One request of a session: the new tokens this turn appends, and how many tokens it asks for."""

    new_token_ids: list[int]
    max_tokens: int


@dataclass
class Session:
    """Requests that run one after another; each turn's prompt is the history plus its new tokens."""

    session_id: int
    turns: list[Turn]
    group: int | None = None  # the shared prefix's group (shared-prefix)
    prefix_token_ids: list[int] = field(default_factory=list)  # sent ahead of the first turn's tokens

    def max_context(self) -> int:
        """Upper bound of any turn's prompt + output length (answers are at most max_tokens long)."""
        total, worst = len(self.prefix_token_ids), 0
        for turn in self.turns:
            total += len(turn.new_token_ids)
            worst = max(worst, total + turn.max_tokens)
            total += turn.max_tokens
        return worst


@dataclass
class WorkloadConfig:
    """What to generate; lengths are in tokens."""

    kind: str = "random"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    num_groups: int = 4  # shared-prefix: groups sharing one prefix
    prefix_len: int | None = None  # shared-prefix: the shared system prompt (default 1024); multi-turn (default 0)
    num_turns: int = 3  # multi-turn: turns per conversation (num_prompts conversations)
    token_range: tuple[int, int] = (3, 256)  # random ids in [lo, hi)
    seed: int = 0  # lengths, groups and (with id_seed) token ids
    id_seed: int = 0  # a new id_seed draws fresh token ids for the same lengths (nothing cached from before)

    def __post_init__(self) -> None:
        if self.prefix_len is None:
            self.prefix_len = 1024 if self.kind == "shared-prefix" else 0

    def validate(self) -> None:
        """Raise ValueError on settings no workload can be built from."""
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose from {', '.join(WORKLOADS)}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.num_groups < 1 or self.prefix_len < 0 or self.num_turns < 1:
            raise ValueError("num_groups and num_turns must be >= 1, prefix_len >= 0")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_range must satisfy 0 <= lo < hi, got {lo},{hi}")


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)] (integers, at least 1)."""
    lo = max(1, math.floor(mean * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1.0 + range_ratio)))
    return rng.randint(lo, hi)


def _ids(rng: random.Random, n: int, token_range: tuple[int, int]) -> list[int]:
    lo, hi = token_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def _lens(rng: random.Random, cfg: WorkloadConfig) -> tuple[int, int]:
    return sample_len(rng, cfg.input_len, cfg.range_ratio), sample_len(rng, cfg.output_len, cfg.range_ratio)


def build_workload(cfg: WorkloadConfig) -> list[Session]:
    """The sessions of `cfg`, deterministic in `cfg.seed`."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    id_rng = random.Random(cfg.seed * 1_000_003 + cfg.id_seed)
    tr = cfg.token_range
    sessions: list[Session] = []
    if cfg.kind == "random":
        for i in range(cfg.num_prompts):
            n_in, n_out = _lens(rng, cfg)
            sessions.append(Session(i, [Turn(_ids(id_rng, n_in, tr), n_out)]))
    elif cfg.kind == "shared-prefix":
        prefixes = [_ids(id_rng, cfg.prefix_len, tr) for _ in range(cfg.num_groups)]
        groups = [i % cfg.num_groups for i in range(cfg.num_prompts)]
        rng.shuffle(groups)  # groups interleave in arrival order
        for i, g in enumerate(groups):
            n_in, n_out = _lens(rng, cfg)
            sessions.append(Session(i, [Turn(_ids(id_rng, n_in, tr), n_out)], group=g, prefix_token_ids=prefixes[g]))
    else:  # multi-turn: num_prompts conversations, each with an optional system prompt of prefix_len tokens
        for i in range(cfg.num_prompts):
            turns = [Turn(_ids(id_rng, sample_len(rng, cfg.input_len, cfg.range_ratio), tr),
                          sample_len(rng, cfg.output_len, cfg.range_ratio)) for _ in range(cfg.num_turns)]
            system = _ids(id_rng, cfg.prefix_len, tr) if cfg.prefix_len else []
            sessions.append(Session(i, turns, prefix_token_ids=system))
    return sessions


def arrival_offsets(n: int, rate: float, process: str = "poisson", seed: int = 0) -> list[float]:
    """Start offsets (seconds from the run's start) of `n` sessions at `rate` per second.

    rate = inf: all at once. poisson: exponential gaps of mean 1/rate (the first session starts at 0).
    fixed: one every 1/rate seconds.
    """
    if process not in ARRIVALS:
        raise ValueError(f"unknown arrival process {process!r}; choose from {', '.join(ARRIVALS)}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    if process == "fixed":
        return [i / rate for i in range(n)]
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets
