"""The bar for the embedded demo model, on prompts it never saw: greedy continuations of everyday function
headers written for this test (not from any corpus) parse as Python in >= 80 % of cases, through `LLM` with the
checkpoint's shipped sampling defaults, cut as tools/demo_model/train_demo_eval.py's parse test cuts them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import train_demo_eval  # tools/demo_model/ is on pytest's pythonpath: the parse test's cut and check

from hybridserve import LLM

PROMPTS = json.loads((Path(__file__).parent / "data" / "everyday_prompts.json").read_text())


@pytest.mark.slow
def test_greedy_continuations_of_everyday_headers_parse() -> None:
    llm = LLM(enable_prefix_caching=False)  # the default model
    defaults = llm.get_default_sampling_params()
    assert defaults.repetition_penalty == pytest.approx(1.1)  # what the checkpoint ships (generation_config.json)
    params = dataclasses.replace(defaults, max_tokens=256, temperature=0.0, seed=0)
    outs = llm.generate(PROMPTS, params)
    parsed = [train_demo_eval.parses(p, o.text or "", o.finish_reason == "stop") for p, o in zip(PROMPTS, outs)]
    failed = [p.splitlines()[0] for p, ok in zip(PROMPTS, parsed) if not ok]
    assert sum(parsed) >= 0.8 * len(PROMPTS), f"{sum(parsed)}/{len(PROMPTS)} parse; failed: {failed}"
