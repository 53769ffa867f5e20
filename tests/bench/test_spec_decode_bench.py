"""bench/system/spec_decode.py's configurations run on CPU with a tiny checkpoint (the oracle acceptance, the step loop
and the row it records), so the GPU benchmark does not rot between device sessions."""

from __future__ import annotations

import pytest
import spec_decode
from checkpoints import nemotron_h_mtp


@pytest.mark.parametrize("spec, rate", [(None, 0.0), ({"rollback": "replay"}, 1.0),
                                        ({"rollback": "intermediate"}, 0.5),
                                        ({"rollback": "replay", "method": "mtp", "load_format": "dummy"}, 1.0)])
def test_spec_decode_configs_run_on_cpu(spec: dict | None, rate: float) -> None:
    model_dir, _ = nemotron_h_mtp()
    spec = dict(spec or {})
    load_format = spec.pop("load_format", "safetensors")
    full = {"method": "ngram", "num_speculative_tokens": 2, **spec} if spec else None
    row = spec_decode.run_config(str(model_dir), 2, full, rate, False, 2, device="cpu", load_format=load_format)
    assert row["batch"] == 2 and row["tokens_per_s"] > 0 and row["cuda_graphs"] is False
    if full is None:
        assert row["acceptance_length"] == 1.0
    elif rate == 1.0:
        assert row["acceptance_length"] == 3.0  # every draft accepted


def test_graph_modes_parse_and_refuse_unknown_ones() -> None:
    import argparse

    assert spec_decode.graph_modes("eager,graph") == [False, True]
    assert spec_decode.graph_modes("graph") == [True]
    with pytest.raises(argparse.ArgumentTypeError, match="modes are 'eager' and 'graph'"):
        spec_decode.graph_modes("eager,cuda")
