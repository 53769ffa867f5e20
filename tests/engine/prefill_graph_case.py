"""Used by test_prefill_graphs.py, on the Triton kernels under the interpreter (kernel_mode="interpret"): every
prefill forward of a chunked, prefix-cached run is computed eagerly and, from the same cache contents, padded into
a prefill graph's static buffers (what a CUDA-graph replay runs); hidden states of the real tokens and every cache
tensor must agree (the padded result is what the engine then uses). Returns the greedy tokens and how many
forwards of each kind were checked."""

from __future__ import annotations

import torch
from checkpoints import mamba2, nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.engine.prefill_graphs import SEQS, PrefillBuffers, PrefillShape

BUCKETS = (64, 128)


class PaddedCheck:
    """Stands in for the runner's model: prefill-only batches, and the prefill half of mixed ones, run eagerly and
    padded into a bucket's buffers from the same cache contents; the padded result is what the engine gets."""

    def __init__(self, model, chunk_size: int, state_block: int, max_pages: int, seqs: int = SEQS) -> None:
        self.model = model
        self.buffers = {b: PrefillBuffers(PrefillShape.for_bucket(b, seqs, chunk_size, state_block), max_pages,
                                          chunk_size, state_block, torch.device("cpu")) for b in BUCKETS}
        self.checked = 0
        self.resumed = 0
        self.multi = 0
        self.kept = 0

    def __call__(self, input_ids, batch, cache):
        nd = batch.num_decode
        if nd == batch.num_seqs:
            return self.model(input_ids, batch, cache)
        if nd:  # mixed: the decode rows eagerly, the prefill half checked
            rows = nd * batch.decode_len
            decoded = self.model(input_ids[:rows], batch.decode_half(), cache)
            return torch.cat([decoded, self._check(input_ids[rows:], batch.prefill_half(), cache)])
        return self._check(input_ids, batch, cache)

    def _check(self, input_ids, batch, cache):
        size = next(b for b in BUCKETS if b >= batch.num_tokens)
        buffers = self.buffers[size]
        if not buffers.fits(batch):
            return self.model(input_ids, batch, cache)
        tensors = [cache.k_pages, cache.v_pages, cache.conv_states, cache.ssm_states]
        before = [t.clone() for t in tensors]
        eager = self.model(input_ids, batch, cache).clone()
        after = [t.clone() for t in tensors]
        for t, saved in zip(tensors, before):
            t.copy_(saved)
        assert buffers.load(input_ids, batch), "a batch that fits was refused"
        padded = self.model(buffers.input_ids, buffers.new_batch(), cache)[: batch.num_tokens]
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        for t, expected in zip(tensors, after):
            torch.testing.assert_close(t, expected, rtol=1e-5, atol=1e-5)
        self.checked += 1
        self.resumed += any(batch.context_lens_host)
        self.multi += batch.num_seqs > 1
        self.kept += batch.boundary_rows is not None
        return padded

    def __getattr__(self, name):
        return getattr(self.model, name)


def run(kind: str) -> dict:
    """kind: "nemotron_h" or "mamba2"."""
    model_dir = mamba2()[0] if kind == "mamba2" else nemotron_h("M*-M*")[0]
    system, *tails = random_prompts([40, 3, 21, 57, 9], vocab=128, seed=12)
    prompts = [system + t for t in tails] + [tails[2]]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # the prefills are what is checked
    options = dict(prefill_chunk_size=50, state_block=16, page_size=8, max_model_len=256, max_num_seqs=4,
                   kernel_mode="interpret")
    llm = LLM(model_dir, **options)  # every forward is checked against the eager one as it runs (no second run:
    # the interpreter is slow, and the eager forwards are checked against transformers elsewhere)
    engine = llm.engine
    mamba = engine.model_config.mamba
    check = PaddedCheck(engine.runner.model, mamba.chunk_size, engine.state_block, -(-256 // 8))
    engine.runner.model = check
    llm.generate(prompt_token_ids=[system + tails[0]], sampling_params=params)  # caches the system prompt
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return {"tokens": [o.token_ids for o in outs],
            "checked": check.checked, "resumed": check.resumed, "multi": check.multi, "kept": check.kept}
