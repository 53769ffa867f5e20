"""lm-evaluation-harness against a live disaggregated server with the demo model: its `local-completions`
model runs a loglikelihood task and a generate_until task whose data ships in tests/router/lm_eval_tasks (HF
offline: nothing is downloaded). Every loglikelihood it computes from the server's echo logprobs equals the
offline engine's `prompt_logits` on the same token ids within 1e-4 (fp32); every generation equals the offline
engine's greedy output cut at the task's stop string."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from router_cluster import MODEL_NAME, Cluster

from hybridserve import LLM
from hybridserve.engine.config import EngineConfig
from hybridserve.models.default_model import default_model_dir

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(default_model_dir(), engine=EngineConfig(prefill_chunk_size=64, max_num_seqs=4, max_model_len=512))
    yield c
    c.stop()


def test_lm_eval_local_completions(cluster, monkeypatch, tmp_path) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(TASKS)  # the task YAMLs name their jsonl files relative to here
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(base_url=cluster.base_url + "/v1/completions", model=MODEL_NAME,
                             tokenizer_backend="huggingface", tokenizer=str(default_model_dir()), max_retries=1,
                             num_concurrent=1, max_length=512)
    out = lm_eval.simple_evaluate(model=lm, tasks=["hybridserve_tiny_mc", "hybridserve_tiny_gen"],
                                  task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
                                  bootstrap_iters=0)
    assert 0.0 <= out["results"]["hybridserve_tiny_mc"]["acc,none"] <= 1.0
    llm = LLM(default_model_dir(), max_model_len=512)
    mc = out["samples"]["hybridserve_tiny_mc"]
    assert len(mc) == 4
    for sample in mc:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx, cont = lm._encode_pair(context, continuation)
            ids = ctx + cont
            logprobs = torch.log_softmax(llm.prompt_logits(ids).float(), dim=-1)
            expected = sum(logprobs[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
            assert resp[0][0] == pytest.approx(expected, abs=1e-4), (context, continuation)
    gen = out["samples"]["hybridserve_tiny_gen"]
    assert len(gen) == 3 and all(s["resps"][0][0].strip() for s in gen)
    for sample in gen:
        prompt = sample["arguments"][0][0]
        offline = llm.generate(prompt_token_ids=[lm.tok_encode(prompt)],  # the ids lm-eval sent
                               # lm-eval leaves repetition_penalty unset: the server applies the checkpoint's default
                               sampling_params=dataclasses.replace(llm.get_default_sampling_params(), max_tokens=12,
                                                                   temperature=0.0, stop=("\n",)))[0]
        assert sample["resps"][0][0] == offline.text, prompt
