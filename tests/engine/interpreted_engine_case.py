"""Run by test_interpreted_kernels.py in a subprocess (the kernel mode is read at import): greedy tokens of the
tiny checkpoints, plus a prefix-cache turn (warm hits against a cold run), plus a seeded sampled run twice (the
sampler's kernel: the same tokens both times), printed as one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "statepool")]  # test helpers

from checkpoints import random_prompts  # noqa: E402
from prefix_cases import greedy, model_dir, warm_llm  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5 + (i * 7 + j) % 100 for j in range(n)] for i, n in enumerate((3, 40, 17, 90))]


def main(kind: str) -> None:
    llm = LLM(model_dir(kind))
    plain = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(6))
    sampled = [[o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=SamplingParams(
        max_tokens=4, temperature=0.8, seed=3, ignore_eos=True))] for _ in range(2)]
    warm = warm_llm(kind)
    system, a, b = random_prompts([37, 5, 9], vocab=128, seed=41)
    warm.generate(prompt_token_ids=[system + a], sampling_params=greedy(4))
    hit = warm.generate(prompt_token_ids=[system + b], sampling_params=greedy(4))[0]
    print(json.dumps({"plain": [o.token_ids for o in plain], "hit": hit.token_ids, "cached": hit.num_cached_tokens,
                      "sampled": sampled[0], "sampled_again": sampled[1]}))


if __name__ == "__main__":
    main(sys.argv[1])
