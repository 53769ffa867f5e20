"""Random JSON schemas through a disaggregated server (1 prefill + 1 decode worker in this process, MTP K=3 on
the demo model): every answer must parse and validate with `jsonschema`, finish with "stop", and take its
first token from the prefill worker. Writes JSON (counts, failures, MTP acceptance, wall time, versions).

    python bench/serving/structured_schemas.py [--num-schemas 100] [--concurrency 8] \
        [--out bench/results/cpu/structured_output/structured_schemas.json]

tests/router/test_structured_outputs.py runs the same generator and check with fewer schemas.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "tests"),
                str(Path(__file__).resolve().parents[2] / "tests" / "router")]  # the test cluster

ENGINE_OPTIONS: dict[str, Any] = dict(prefill_chunk_size=64, max_num_seqs=8, max_model_len=512,
                                      speculative_config={"method": "mtp", "num_speculative_tokens": 3})


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects, arrays, bounded strings / integers, enums and booleans: every instance is short, so a grammar-
    following generation ends well within its token budget."""
    kinds = ["string", "integer", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "none"], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "ok", "tags", "size", "kind", "meta"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


def random_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"type": "object", "properties": {"v": random_schema(rng)}, "required": ["v"],
             "additionalProperties": False} for _ in range(count)]


def run_schemas(cluster: Any, client: Any, model: str, schemas: list[dict], concurrency: int = 8) -> dict[str, Any]:
    """Ask for each schema (greedy and sampled alternately) and check every answer; a summary dict whose
    `failures` lists the schemas whose answer did not finish, parse or validate."""
    import jsonschema

    def ask(index: int) -> tuple[str | None, str]:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Give JSON number {index}."}], max_tokens=200,
            temperature=0.0 if index % 2 else 0.8, seed=index,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schemas[index]}})
        return out.choices[0].finish_reason, out.choices[0].message.content or ""

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    wall = time.perf_counter() - start
    failures = []
    for index, ((reason, text), schema) in enumerate(zip(answers, schemas)):
        try:
            if reason != "stop":
                raise ValueError(f"finish_reason {reason!r}")
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"index": index, "schema": schema, "text": text, "error": str(exc)[:200]})
    reasons = sorted({d.reason for _, d in cluster.orchestrator.recent_decisions})
    metrics = [w.engine.spec.metrics for w in cluster.decode]
    return {
        "num_schemas": len(schemas), "num_valid": len(schemas) - len(failures), "failures": failures,
        "routing_reasons": reasons,
        "mtp_draft_tokens": sum(m.num_draft_tokens for m in metrics),
        "mtp_accepted_tokens": sum(m.num_accepted_tokens for m in metrics),
        "wall_s": wall, "concurrency": concurrency,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-schemas", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/cpu/structured_output/structured_schemas.json")
    args = parser.parse_args()
    import openai
    from router_cluster import MODEL_NAME, Cluster

    from hybridserve.engine.config import EngineConfig
    from hybridserve.models.default_model import default_model_dir

    cluster = Cluster(default_model_dir(), num_prefill=1, num_decode=1, engine=EngineConfig(**ENGINE_OPTIONS))
    try:
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        summary = run_schemas(cluster, client, MODEL_NAME, random_schemas(args.num_schemas, args.seed),
                              args.concurrency)
    finally:
        cluster.stop()
    summary.update(device=platform.machine(), engine=ENGINE_OPTIONS, seed=args.seed,
                   versions={name: version(name) for name in ("xgrammar", "jsonschema", "torch")})
    print(f"{summary['num_valid']}/{summary['num_schemas']} valid, MTP accepted {summary['mtp_accepted_tokens']}"
          f"/{summary['mtp_draft_tokens']} drafts, routing {summary['routing_reasons']}, {summary['wall_s']:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
