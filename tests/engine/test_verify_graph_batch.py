"""The static batch a verify CUDA graph is captured on (CPU: no capture, the same forward eagerly): padded rows of
T tokens run through the verify path and touch no state, KV page or replay input; real verify batches find their
bucket, others do not."""

from __future__ import annotations

import pytest
import torch
from checkpoints import nemotron_h_mtp

from hybridserve import LLM
from hybridserve.engine.batch_builder import PlacedRow, place_rows
from hybridserve.engine.cuda_graphs import DecodeGraphs


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_padded_verify_batch_runs_and_touches_nothing(rollback: str) -> None:
    model_dir, _ = nemotron_h_mtp()
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": rollback}
    llm = LLM(model_dir, speculative_config=spec, max_model_len=64, page_size=8, max_num_seqs=4)
    engine = llm.engine
    graphs = DecodeGraphs(engine.model, engine.cache, 4, 8, tokens=3, rollback=rollback)
    assert graphs.buckets == (1, 2, 4)
    batch = graphs._batch(2)
    assert batch.query_lens == (3, 3) and batch.decode_len == 3 and batch.spec_rollback == rollback
    assert batch.cu_seqlens.tolist() == [0, 3, 6] and batch.slot_mapping.numel() == 6
    assert (batch.num_replay is not None) == (rollback == "replay")
    cache = engine.cache
    before = [t.clone() for t in (cache.conv_states, cache.ssm_states, cache.k_pages, cache.v_pages)]
    hidden = engine.model(graphs.input_ids[:6], batch, cache)
    assert hidden.shape == (6, engine.model_config.hidden_size) and torch.isfinite(hidden).all()
    for old, new in zip(before, (cache.conv_states, cache.ssm_states, cache.k_pages, cache.v_pages)):
        assert torch.equal(old, new)
    if rollback == "intermediate":
        assert set(batch.intermediate_states) == set(engine.model_config.layers_of("mamba"))


def test_verify_batches_find_their_bucket() -> None:
    model_dir, _ = nemotron_h_mtp()
    llm = LLM(model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "rollback": "replay"},
              max_model_len=64, page_size=8, max_num_seqs=4)
    engine = llm.engine
    graphs = DecodeGraphs(engine.model, engine.cache, 4, 8, tokens=3, rollback="replay")
    graphs.graphs = dict.fromkeys(graphs.buckets)  # type: ignore[arg-type]  # "captured", as far as lookup goes
    row = PlacedRow([0, 1], 4, 3, 0)  # 3 verify tokens from position 4, state slot 0
    replay = torch.zeros(1, dtype=torch.int32)
    batch, _ = place_rows([row, row], 2, 8, torch.device("cpu"), decode_len=3, spec_rollback="replay",
                          num_replay=torch.zeros(2, dtype=torch.int32))
    assert graphs.bucket_for(batch) == 2
    other, _ = place_rows([row], 1, 8, torch.device("cpu"), decode_len=3, spec_rollback="intermediate")
    assert graphs.bucket_for(other) is None  # another rollback
    plain = DecodeGraphs(engine.model, engine.cache, 4, 8)
    plain.graphs = dict.fromkeys(plain.buckets)  # type: ignore[arg-type]
    single, _ = place_rows([row], 1, 8, torch.device("cpu"), decode_len=3, spec_rollback="replay", num_replay=replay)
    assert plain.bucket_for(single) is None  # a decode graph never replays a verify batch
    with pytest.raises(ValueError, match="verify graphs"):
        DecodeGraphs(engine.model, engine.cache, 4, 8, tokens=3)
