"""Conversions between wire messages and engine types (shared by the router and both workers)."""

from __future__ import annotations

from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.sampling_params import SamplingParams
from hybridserve.proto import common_pb2


def sampling_from_proto(options: common_pb2.SamplingOptions) -> SamplingParams:
    """Raises ValueError (-> INVALID_ARGUMENT) for values SamplingParams refuses."""
    return SamplingParams(
        max_tokens=int(options.max_tokens) if options.max_tokens else 16,
        temperature=float(options.temperature),
        top_p=float(options.top_p) if options.top_p else 1.0,
        top_k=int(options.top_k) if options.top_k else -1,
        seed=int(options.seed) if options.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in options.stop_token_ids),
        ignore_eos=bool(options.ignore_eos),
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingOptions:
    options = common_pb2.SamplingOptions(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        options.seed = params.seed
    return options


def token_event(out: RequestOutput, new_tokens: list[int]) -> common_pb2.TokenEvent:
    """A TokenEvent carrying `new_tokens` of `out` (the finish reason and usage once finished)."""
    return common_pb2.TokenEvent(
        request_id=out.request_id,
        token_ids=new_tokens,
        finish_reason=out.finish_reason or "" if out.finished else "",
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
    )
