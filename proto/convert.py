"""Conversions between wire messages and engine types (shared by the router and both workers)."""

from __future__ import annotations

from hybridserve.common.outputs import RequestOutput, TokenLogprob
from hybridserve.common.sampling_params import SamplingParams, StructuredOutput
from hybridserve.proto import common_pb2


def sampling_from_proto(options: common_pb2.SamplingOptions) -> SamplingParams:
    """Raises ValueError (-> INVALID_ARGUMENT) for values SamplingParams refuses."""
    return SamplingParams(
        max_tokens=int(options.max_tokens) if options.HasField("max_tokens") else 16,  # 0 set: refused
        temperature=float(options.temperature),
        top_p=float(options.top_p) if options.top_p else 1.0,
        top_k=int(options.top_k) if options.top_k else -1,
        seed=int(options.seed) if options.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in options.stop_token_ids),
        stop=tuple(options.stop),
        include_stop_str_in_output=bool(options.include_stop_str_in_output),
        ignore_eos=bool(options.ignore_eos),
        logprobs=int(options.logprobs) if options.HasField("logprobs") else None,
        prompt_logprobs=int(options.prompt_logprobs) if options.HasField("prompt_logprobs") else None,
        min_tokens=int(options.min_tokens),
        logit_bias=tuple((int(t), float(b)) for t, b in sorted(options.logit_bias.items())),
        presence_penalty=float(options.presence_penalty),
        frequency_penalty=float(options.frequency_penalty),
        repetition_penalty=float(options.repetition_penalty) if options.HasField("repetition_penalty") else 1.0,
        no_repeat_ngram_size=int(options.no_repeat_ngram_size) if options.HasField("no_repeat_ngram_size") else 0,
        structured=StructuredOutput(options.structured_kind, options.structured_spec,  # type: ignore[arg-type]
                                    tuple(options.structured_choices), options.structured_field or "structured_output")
        if options.structured_kind else None,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingOptions:
    options = common_pb2.SamplingOptions(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    if params.structured is not None:
        options.structured_kind = params.structured.kind
        options.structured_spec = params.structured.spec
        options.structured_choices.extend(params.structured.choices)
        options.structured_field = params.structured.field
    if params.repetition_penalty != 1.0:
        options.repetition_penalty = params.repetition_penalty
    if params.no_repeat_ngram_size:
        options.no_repeat_ngram_size = params.no_repeat_ngram_size
    if params.seed is not None:
        options.seed = params.seed
    if params.logprobs is not None:
        options.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        options.prompt_logprobs = params.prompt_logprobs
    return options


def logprob_to_proto(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                                   top_token_ids=[t for t, _ in entry.top], top_logprobs=[v for _, v in entry.top])


def logprob_from_proto(entry: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(int(entry.token_id), float(entry.logprob), int(entry.rank),
                        tuple(zip((int(t) for t in entry.top_token_ids), (float(v) for v in entry.top_logprobs))))


def token_event(out: RequestOutput, sent: int) -> common_pb2.TokenEvent:
    """A TokenEvent carrying `out`'s tokens after the first `sent` (their logprobs when asked, the prompt's on
    the first event), and the finish reason and usage once finished."""
    event = common_pb2.TokenEvent(
        request_id=out.request_id,
        token_ids=out.new_token_ids(sent),
        finish_reason=out.finish_reason or "" if out.finished else "",
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.logprobs is not None:
        event.logprobs.extend(logprob_to_proto(e) for e in out.logprobs[sent:])
    if out.prompt_logprobs is not None and sent == 0:
        event.prompt_logprobs.extend(logprob_to_proto(e) for e in out.prompt_logprobs[1:] if e is not None)
    return event
