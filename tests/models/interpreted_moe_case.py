"""Run by test_moe_models.py in a subprocess (the kernel mode is read at import): the whole engine with every op
on its Triton kernel (interpreted on CPU) on MoE checkpoints; prints one JSON line of greedy tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # test helpers

from checkpoints import nemotron_h_moe, nemotron_h_mtp, random_prompts  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def main() -> None:
    prompts = random_prompts([3, 11], vocab=128, seed=3)
    latent = LLM(nemotron_h_moe("ME*E", moe_latent_size=8)[0], prefill_chunk_size=8)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": "intermediate"}
    mtp = LLM(nemotron_h_mtp("ME*E", ("attention", "moe"), moe=True)[0], speculative_config=spec,
              max_model_len=96, state_block=16, page_size=8, max_num_seqs=4)
    print(json.dumps({
        "latent": [o.token_ids for o in latent.generate(prompt_token_ids=prompts, sampling_params=GREEDY)],
        "mtp": [o.token_ids for o in mtp.generate(prompt_token_ids=prompts, sampling_params=GREEDY)],
    }))


if __name__ == "__main__":
    main()
