"""The demo checkpoint's MTP head drafts well on held-out Python: acceptance length > 1.5 with K = 3 (offline
LLM, greedy, fixed prompts), and greedy output with MTP equals greedy output without, for both rollbacks."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.models.default_model import default_model_dir

HELDOUT_PERCENT = 4  # tools/demo_model/train_demo.py's split: files with sha256(relative path) % 100 < 4 were never trained on


def heldout_prompts(count: int, chars: int) -> list[str]:
    """The first `chars` characters of the first `count` held-out stdlib files (sorted by path)."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    prompts = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        if int(hashlib.sha256(rel.as_posix().encode()).hexdigest(), 16) % 100 >= HELDOUT_PERCENT:
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        if len(text) >= chars:
            prompts.append(text[:chars])
        if len(prompts) == count:
            break
    if len(prompts) < count:
        pytest.skip(f"this Python's stdlib has only {len(prompts)} held-out files of {chars} characters")
    return prompts


@pytest.mark.parametrize("rollback", ["replay", "intermediate"])
def test_demo_mtp_acceptance_and_greedy_equality(rollback: str) -> None:
    prompts = heldout_prompts(4, 500)
    params = SamplingParams(max_tokens=48, temperature=0.0, seed=0)
    plain = LLM(default_model_dir()).generate(prompts, params)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(default_model_dir(), speculative_config=spec)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    metrics = llm.engine.spec.metrics
    assert metrics.acceptance_length > 1.5, f"acceptance length {metrics.acceptance_length:.2f} with K=3"
    assert sum(o.num_accepted_tokens for o in outs) == metrics.num_accepted_tokens
