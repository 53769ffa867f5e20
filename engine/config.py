"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from hybridserve.common.model_config import KV_CACHE_DTYPES, SSM_CACHE_DTYPES, ModelConfig
from hybridserve.engine.grammar_limits import GrammarLimits
from hybridserve.engine.sm_partition import DEFAULT_SM_GRANULARITY, MIN_LANE_GROUPS
from hybridserve.engine.sm_split import SplitPolicy
from hybridserve.engine.spec_config import SpeculativeConfig
from hybridserve.kernels.ops import KERNEL_MODES, Kernels

# A 9B hybrid's 512-token step is host-bound on an H200 (41 ms for 15.6 ms of GPU work); 2048 tokens keep the
# GPU busy (31.5K vs 11.3K prefill tokens/s) and a step with prefill near 45 ms, its ITL bound
# (bench/results/h200/serving/)
CUDA_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 512
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the offline engine and the workers built on it."""

    device: str = "cpu"  # "cpu" or "cuda" (a worker's own GPU is cuda:0; the launcher sets CUDA_VISIBLE_DEVICES)
    dtype: str = "float32"  # weights and activations: float32, bfloat16 or float16
    # prefill tokens per step, shared by all prefilling requests; None: the device's default (CUDA_PREFILL_CHUNK
    # on CUDA, CPU_PREFILL_CHUNK on CPU: see `prefill_chunk_tokens`)
    prefill_chunk_size: int | None = None
    max_num_seqs: int = 32  # concurrent requests (one Mamba state slot each)
    # Mamba state slots beyond max_num_seqs for states outside the running batch: a decode worker's reservations
    # and received states waiting for a seat, a prefill worker's finished states waiting for their transfer, so
    # remote prefills run ahead of a full decode batch. None: 0, except that `serve` / `up` give the workers of a
    # disaggregated deployment max_num_seqs of them
    standby_state_slots: int | None = None
    # requests a worker queues beyond the running ones; more are refused at once (RESOURCE_EXHAUSTED, the router
    # answers 429) instead of queueing without bound (the offline LLM queues its whole batch regardless)
    max_num_waiting: int = 1024
    page_size: int = 16  # tokens per KV page
    max_model_len: int | None = None  # None: the model's max_position_embeddings (or 8192)
    # state-cache budget on CPU; None: what max_num_seqs (+ standby) requests of max_model_len need (twice that
    # with prefix caching), at most a quarter of the host's memory
    cpu_memory_gb: float | None = None
    # share of the whole GPU this worker may use: weights, activations and CUDA graphs (measured by a profiling
    # forward at start-up) and the state cache, which gets the rest
    gpu_memory_utilization: float = 0.9
    # a fixed state-cache budget on the GPU instead of the utilization share (several workers on one GPU)
    gpu_memory_gb: float | None = None
    # KV tokens the memory plan keeps for every running request: when the budget cannot hold max_num_seqs
    # Mamba slots with that much KV each, the running batch is lowered (WARNING) instead of leaving requests
    # without KV; None: 2048 (or max_model_len when shorter)
    plan_seq_len: int | None = None
    seed: int = 0  # seeds requests that bring no seed of their own
    enable_prefix_caching: bool = True  # radix cache of KV blocks + aligned Mamba checkpoints
    cuda_graphs: bool = True  # on device="cuda": replay decode-only steps from captured CUDA graphs
    # with cuda_graphs: a step mixing decode rows and prefill chunks replays the decode rows' graph and runs only
    # the prefill eagerly (a prefill step is bound by the host's kernel launches); off: the whole step eagerly
    split_mixed_steps: bool = True
    # with cuda_graphs: a step's prefill chunks (up to 7 sequences and 1024 tokens) replay a CUDA graph captured
    # per token bucket, padded to it, instead of ~400 eager kernel launches (engine/prefill_graphs.py)
    prefill_cuda_graphs: bool = True
    # schedule and launch step N+1 while step N runs on the GPU; its sampled tokens feed step N+1 on the device
    # and the host applies them (stop rules, outputs) during step N+1 (vLLM's --async-scheduling; same tokens as
    # synchronous steps; +21 % output tok/s at 256 in flight on an H200). Requests with logprobs, grammars, penalties
    # or state export, speculative decoding and tensor parallelism step synchronously
    async_scheduling: bool = True
    # Tokens between cached Mamba checkpoints; a multiple of the model's SSD chunk_size (and of page_size
    # for models with attention). None: 4 x chunk_size (rounded up to a page multiple). Each checkpoint is a
    # whole state (137 MiB for Nemotron-Nano-9B-v2 in fp32, ~8.8K tokens of its KV), so every chunk would
    # cost too much memory; 4 chunks keep a 2K prefix at 4 states while a hit recomputes < 4 chunks.
    state_block: int | None = None
    num_kv_pages: int | None = None  # override budget sizing of the KV pool
    num_checkpoint_slots: int | None = None  # override budget sizing of the checkpoint pool
    max_cache_events: int = 65536  # cache events kept until drained
    # speculative decoding: None (off), a SpeculativeConfig or its dict, e.g.
    # {"method": "mtp" | "ngram", "num_speculative_tokens": K, "rollback": "intermediate" | "replay"}
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    load_format: str = "safetensors"  # "dummy": random weights from config.json alone (benchmarks)
    # Mamba SSM state cache dtype: auto (the checkpoint's `mamba_ssm_cache_dtype`), float32, bfloat16 or float16;
    # bfloat16 halves the state bytes every decode step reads and writes (most of a large batch's step)
    mamba_ssm_cache_dtype: str = "auto"
    # attention KV cache dtype: auto (the model dtype) or fp8 (float8_e4m3fn pages with per-layer scales, as
    # vLLM's fp8 KV cache: half the KV memory and the bytes attention reads)
    kv_cache_dtype: str = "auto"
    # fp8 routed experts: the grouped expert GEMMs quantize their inputs to fp8 per row and multiply fp8 x fp8 (W8A8,
    # as vLLM runs fp8 MoE; on an H200 the expert GEMMs run 1.8-2.0x faster at prefill, 1.2-1.5x at decode); off:
    # bf16 activations (weight-only fp8). A one-token decode's expert GEMVs read fp8 weights with bf16 activations
    # either way
    moe_fp8_activations: bool = True
    # compile / autotune every kernel before serving (engine/warmup.py); None: on for CUDA, off on CPU (where
    # the kernels are torch references and nothing compiles)
    warmup: bool | None = None
    # tokens one step may compute: decode rows (1 + drafts each) first, then prefill chunks (at most
    # prefill_chunk_tokens of them); None: prefill_chunk_tokens on top of the decode rows
    max_num_batched_tokens: int | None = None
    # processes (one GPU each) that shard the model: rank 0 runs the scheduler, the others follow its steps
    # (engine/tp_worker.py); gloo on CPU, NCCL on CUDA
    tensor_parallel_size: int = 1
    # MoE blocks at tensor_parallel_size > 1: each rank holds a subset of whole experts (expert parallel)
    # instead of a slice of every expert
    enable_expert_parallel: bool = False
    # a follower rank that is alive but shows no sign of life (stopped, wedged) for this many seconds is ended and
    # the engine raises naming it, instead of waiting out the collectives' 10-minute timeout
    tensor_parallel_hang_timeout_s: float = 30.0
    # a torch.profiler trace (Chrome / Perfetto JSON + a table of ops) of a window of each worker loop's busy steps
    # is written into this directory (worker_runtime/step_profiler.py); None: no profiling
    profile_dir: str | None = None
    # with profile_dir: the window, FIRST:COUNT (busy steps counted from 0 after start-up), or FIRST:COUNT:stack
    # to add every thread's Python frames (slower)
    profile_steps: str = "100:20"
    # structured outputs: a grammar not compiled within this many seconds is refused (400) and its compile abandoned
    grammar_compile_timeout_s: float = 10.0
    grammar_max_spec_bytes: int = 256 * 1024  # a JSON schema or regex over this many bytes is refused (400)
    grammar_max_properties: int = 2048  # a JSON schema with more object properties in all is refused (400)
    # a regex larger than this with its counted repetitions expanded (a{100}{100}: 10,000) is refused (400)
    grammar_max_regex_states: int = 10_000
    # which implementation the model's ops run: auto (Triton kernels on CUDA, torch references on CPU),
    # reference (the torch references everywhere: debugging, A/B checks) or interpret (the Triton kernels on
    # CPU tensors under Triton's interpreter, TRITON_INTERPRET=1: checks the kernels without a GPU, slow)
    kernel_mode: str = "auto"
    # one process runs a prefill lane and a decode lane at once, each in its own SM partition of the GPU (CUDA
    # green contexts), sharing the weights and the state pool: a prompt's state passes to decode with no copy
    # (engine/multiplex.py); where green contexts are unavailable the engine says so and runs co-located
    pd_multiplex: bool = False
    # with pd_multiplex: the prefill SM counts the split may choose from, comma-separated (each rounded up to the
    # driver's granularity, decode taking the rest; each lane at least two groups); auto: 1/8 .. 7/8 of the
    # device's SMs, at most all but two groups (each split's CUDA graphs are captured at start-up, so a longer menu
    # costs start-up time)
    pd_multiplex_prefill_sms: str = "auto"
    # with pd_multiplex, while prompts wait: the decode step may take this many times its fastest split's time (the
    # running streams' inter-token tail); prefill gets every SM that budget leaves (engine/sm_split.py)
    pd_multiplex_decode_slowdown: float = 1.3
    # with pd_multiplex: a TPOT service-level objective in ms that replaces the slowdown budget when > 0: decode gets
    # just the SMs that keep its step within it, prefill the rest (goodput under TTFT and TPOT SLOs; it bounds a
    # decode step, which with speculative decoding emits more than one token; lifted, as the slowdown is, while the
    # backlog below is exceeded)
    pd_multiplex_tpot_slo_ms: float = 0.0
    # with pd_multiplex: steps run co-located on the whole GPU while one phase has no work and while a deep backlog
    # drains (pd_multiplex_backlog_ms); off: every step runs in the split's lanes
    pd_multiplex_whole_gpu: bool = True
    # with pd_multiplex: once the prompts waiting take longer than this (ms) to prefill in the split the decode budget
    # gives them (a queue past a TTFT objective of this size: drain it for throughput), steps run on the whole GPU
    # until nothing waits (without pd_multiplex_whole_gpu: the decode budget is lifted and prefill takes the most
    # SMs); 0: never
    pd_multiplex_backlog_ms: float = 500.0

    def __post_init__(self) -> None:
        self.grammar_limits  # noqa: B018 - validated on construction
        if self.kernel_mode not in KERNEL_MODES:
            raise ValueError(f"kernel_mode must be one of {', '.join(KERNEL_MODES)}, got {self.kernel_mode!r}")
        self.kernels  # noqa: B018 - interpret needs Triton's interpreter on
        if not (isinstance(self.grammar_compile_timeout_s, (int, float)) and self.grammar_compile_timeout_s > 0):
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.mamba_ssm_cache_dtype not in ("auto", *SSM_CACHE_DTYPES):
            raise ValueError(f"mamba_ssm_cache_dtype must be auto or one of {', '.join(SSM_CACHE_DTYPES)}, "
                             f"got {self.mamba_ssm_cache_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
        for name in ("prefill_chunk_size", "max_num_seqs", "page_size", "max_num_waiting"):
            value = getattr(self, name)
            if value is None and name == "prefill_chunk_size":
                continue
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.warmup is not None and not isinstance(self.warmup, bool):
            raise ValueError(f"warmup must be a bool or None (on for CUDA), got {self.warmup!r}")
        budget = self.max_num_batched_tokens
        if budget is not None:
            spec = self.speculative
            row = 1 + (spec.num_speculative_tokens if spec is not None else 0)
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < self.max_num_seqs * row + 1:
                raise ValueError(
                    f"max_num_batched_tokens must be an integer above max_num_seqs x tokens per decode row "
                    f"({self.max_num_seqs} x {row}), so a full decode batch leaves room for prefill; got {budget!r}"
                )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        hang = self.tensor_parallel_hang_timeout_s
        if isinstance(hang, bool) or not isinstance(hang, (int, float)) or not hang > 0:
            raise ValueError(f"tensor_parallel_hang_timeout_s must be > 0, got {hang!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        for name in ("cuda_graphs", "split_mixed_steps", "prefill_cuda_graphs", "async_scheduling", "pd_multiplex",
                     "pd_multiplex_whole_gpu", "moe_fp8_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        standby = self.standby_state_slots
        if standby is not None and (isinstance(standby, bool) or not isinstance(standby, int) or standby < 0):
            raise ValueError(f"standby_state_slots must be an integer >= 0 or None, got {standby!r}")
        for name in ("state_block", "num_kv_pages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        slots = self.num_checkpoint_slots
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
            raise ValueError(f"num_checkpoint_slots must be a non-negative integer or None, got {slots!r}")
        if not isinstance(self.max_cache_events, int) or self.max_cache_events <= 0:
            raise ValueError(f"max_cache_events must be a positive integer, got {self.max_cache_events!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ValueError(f"gpu_memory_gb must be > 0 or None, got {self.gpu_memory_gb}")
        if self.cpu_memory_gb is not None and not self.cpu_memory_gb > 0:
            raise ValueError(f"cpu_memory_gb must be > 0 or None, got {self.cpu_memory_gb}")
        plan_len = self.plan_seq_len
        if plan_len is not None and (isinstance(plan_len, bool) or not isinstance(plan_len, int) or plan_len <= 0):
            raise ValueError(f"plan_seq_len must be a positive integer or None, got {plan_len!r}")
        parse_profile_steps(self.profile_steps)
        if self.profile_dir is not None and (not isinstance(self.profile_dir, str) or not self.profile_dir):
            raise ValueError(f"profile_dir must be a directory path or None, got {self.profile_dir!r}")
        self.multiplex_menu(132)  # the menu's syntax, validated on construction (SM counts against the device later)
        for name, least, meaning in (("pd_multiplex_decode_slowdown", 1, "a multiple of the fastest decode step"),
                                     ("pd_multiplex_tpot_slo_ms", 0, "0: no SLO"),
                                     ("pd_multiplex_backlog_ms", 0, "0: never drained")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (least <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= {least} ({meaning}), got {value!r}")
        if self.pd_multiplex and tp > 1:
            raise ValueError("pd_multiplex runs both lanes on one GPU in one process; it does not combine with "
                             f"tensor_parallel_size={tp}: set tensor_parallel_size=1 or drop pd_multiplex")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def resolve_state_block(self, chunk_size: int, page_size: int | None) -> int:
        """The checkpoint interval for a model with this SSD chunk_size (page_size None: no attention)."""
        if self.state_block is None:
            block = 4 * chunk_size
            if page_size is not None and block % page_size:
                block = block * page_size // math.gcd(block, page_size)
            return block
        if self.state_block % chunk_size:
            raise ValueError(
                f"state_block={self.state_block} must be a multiple of the model's SSD chunk_size={chunk_size}"
            )
        if page_size is not None and self.state_block % page_size:
            raise ValueError(f"state_block={self.state_block} must be a multiple of page_size={page_size}")
        return self.state_block

    def runtime_model_config(self, model_config: ModelConfig) -> ModelConfig:
        """`model_config` with this engine's precision choices: state cache dtypes (`auto` keeps the checkpoint's)
        and the fp8 experts' W8A8 calls."""
        ssm = model_config.ssm_state_dtype if self.mamba_ssm_cache_dtype == "auto" else self.mamba_ssm_cache_dtype
        moe = model_config.moe
        if moe is not None:
            moe = dataclasses.replace(moe, fp8_activations=self.moe_fp8_activations)
        return dataclasses.replace(model_config, ssm_state_dtype=ssm, kv_cache_dtype=self.kv_cache_dtype, moe=moe)

    @property
    def prefill_chunk_tokens(self) -> int:
        """Prefill tokens per step: prefill_chunk_size, or the device's default when it is None."""
        if self.prefill_chunk_size is not None:
            return self.prefill_chunk_size
        return CUDA_PREFILL_CHUNK if self.torch_device.type == "cuda" else CPU_PREFILL_CHUNK

    def multiplex_menu(self, total_sms: int) -> tuple[int, ...]:
        """pd_multiplex_prefill_sms as SM counts for a device of `total_sms` SMs (auto: 1/8 .. 7/8 of them, the
        largest capped to leave decode MIN_LANE_GROUPS of the driver's groups)."""
        text = self.pd_multiplex_prefill_sms
        if text == "auto":  # plan_splits rounds each count up to whole groups; the cap is whole groups already
            group = DEFAULT_SM_GRANULARITY
            most = (total_sms - MIN_LANE_GROUPS * group) // group * group
            return tuple(sorted({max(1, min(total_sms * k // 8, most)) for k in range(1, 8)}))
        try:
            menu = tuple(int(part) for part in str(text).split(","))
        except ValueError:
            menu = ()
        if not menu or any(count <= 0 for count in menu):
            raise ValueError(f"pd_multiplex_prefill_sms must be 'auto' or comma-separated positive SM counts "
                             f"(e.g. 32,64,96), got {text!r}")
        return menu

    @property
    def split_policy(self) -> SplitPolicy:
        """The pd_multiplex split controller's policy (its decode budget from the pd_multiplex_* fields)."""
        return SplitPolicy(decode_slowdown=self.pd_multiplex_decode_slowdown,
                           tpot_slo_ms=self.pd_multiplex_tpot_slo_ms, backlog_ms=self.pd_multiplex_backlog_ms,
                           whole_gpu=self.pd_multiplex_whole_gpu)

    @property
    def warmup_enabled(self) -> bool:
        """Whether the engine warms its kernels up at start (the `warmup` default: on CUDA only)."""
        return self.warmup if self.warmup is not None else self.torch_device.type == "cuda"

    @property
    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(self.grammar_max_spec_bytes, self.grammar_max_properties,
                             max_regex_states=self.grammar_max_regex_states)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative config (None: off)."""
        spec = self.speculative_config
        return spec if isinstance(spec, SpeculativeConfig) else None

    @property
    def kernels(self) -> Kernels:
        """The kernel mode the model's layers are built with (kernels/ops.py)."""
        return Kernels(self.kernel_mode)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def parse_profile_steps(spec: str) -> tuple[int, int, bool]:
    """`profile_steps` FIRST:COUNT[:stack] -> (first step, step count, with Python stacks); a ValueError that
    names the field otherwise."""
    parts = spec.split(":") if isinstance(spec, str) else []
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "stack"):
            raise ValueError
        first, count = int(parts[0]), int(parts[1])
        if first < 0 or count <= 0:
            raise ValueError
    except ValueError as exc:
        raise ValueError(f"profile_steps must be FIRST:COUNT or FIRST:COUNT:stack with FIRST >= 0 and COUNT > 0, "
                         f"got {spec!r}") from exc
    return first, count, len(parts) == 3
