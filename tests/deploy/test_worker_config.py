"""One config path: CLI flags come from the config dataclasses, and a worker process gets its config whole."""

from __future__ import annotations

import argparse
import dataclasses
import json

import grpc
import pytest
from checkpoints import nemotron_h

from hybridserve.cli import build_parser
from hybridserve.common.config_flags import add_config_flags, config_from_args, from_jsonable, to_jsonable
from hybridserve.deploy.launch import WorkerOptions, configs_from_json, start_worker_process
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import common_pb2, worker_pb2_grpc
from hybridserve.transfer.planes import TransferConfig

# every field away from its default (and valid on a CPU machine)
ENGINE = EngineConfig(
    device="cpu", dtype="bfloat16", prefill_chunk_size=48, max_num_seqs=3, page_size=8, max_model_len=500,
    cpu_memory_gb=0.5, gpu_memory_utilization=0.5, gpu_memory_gb=3.0, seed=7, enable_prefix_caching=False,
    cuda_graphs=False, split_mixed_steps=False, prefill_cuda_graphs=False, async_scheduling=False, state_block=64,
    num_kv_pages=96, num_checkpoint_slots=2, max_cache_events=100,
    speculative_config={"method": "ngram", "num_speculative_tokens": 2}, load_format="dummy", warmup=False,
    max_num_batched_tokens=20, max_num_waiting=50, standby_state_slots=2, plan_seq_len=256,
    mamba_ssm_cache_dtype="bfloat16", kv_cache_dtype="fp8", moe_fp8_activations=False, grammar_compile_timeout_s=3.0,
    grammar_max_spec_bytes=4096, grammar_max_properties=64, grammar_max_regex_states=500, kernel_mode="reference",
    tensor_parallel_hang_timeout_s=12.5, pd_multiplex_prefill_sms="32,64", pd_multiplex_decode_slowdown=1.5,
    pd_multiplex_tpot_slo_ms=25.0, pd_multiplex_backlog_ms=750.0,
    pd_multiplex_whole_gpu=False,
    # a window no test run reaches: the trace is never written
    profile_dir="hybridserve-profile-never-written", profile_steps="1000000:1:stack",
)
# ... and tensor parallelism: its flag and JSON round trip are checked here; a worker process at TP=2 starts follower
# processes, which tests/engine/test_tensor_parallel.py covers, so the worker-process test below runs ENGINE at TP=1
ENGINE_ALL = dataclasses.replace(ENGINE, tensor_parallel_size=2, enable_expert_parallel=True)
# pd_multiplex is its own step, refused beside tensor parallelism: round-tripped on its own
ENGINE_MULTIPLEX = dataclasses.replace(ENGINE, pd_multiplex=True, async_scheduling=False)
TRANSFER = TransferConfig(planes=("grpc",), staging_mb=16, grpc_streams=3, grpc_chunk_bytes=65536, arena_wait_s=5.0)


def test_every_field_differs_from_its_default() -> None:
    for config in (ENGINE_ALL, TRANSFER):
        default = type(config)()
        same = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) == getattr(default, f.name)]
        same = [name for name in same if name != "pd_multiplex"]  # ENGINE_MULTIPLEX sets it
        assert same in ([], ["device"]), f"{type(config).__name__} fields left at their default: {same}"  # CI: cpu


@pytest.mark.parametrize("config, prefix", [(ENGINE_ALL, ""), (ENGINE_MULTIPLEX, ""), (TRANSFER, "transfer-")])
def test_flags_are_generated_from_the_dataclass_and_round_trip(config, prefix: str) -> None:  # noqa: ANN001
    parser = argparse.ArgumentParser()
    add_config_flags(parser, type(config), "config", prefix=prefix)
    argv = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        flag = f"--{prefix}{f.name.replace('_', '-')}"
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{prefix}{f.name.replace('_', '-')}")
        elif isinstance(value, tuple):
            argv += [flag, ",".join(value)]
        elif dataclasses.is_dataclass(value):
            argv += [flag, json.dumps(dataclasses.asdict(value))]
        else:
            argv += [flag, str(value)]
    assert config_from_args(type(config), parser.parse_args(argv), prefix=prefix) == config
    assert from_jsonable(type(config), to_jsonable(config)) == config


def test_every_engine_field_is_a_flag_of_serve_and_worker() -> None:
    for command in (["serve"], ["worker", "--role", "decode"]):
        args = build_parser().parse_args(command)
        for f in dataclasses.fields(EngineConfig):
            assert hasattr(args, f.name), f"{command[0]} has no flag for EngineConfig.{f.name}"
        for f in dataclasses.fields(TransferConfig):
            assert hasattr(args, f"transfer_{f.name}"), f"{command[0]} has no flag for TransferConfig.{f.name}"


def test_bad_worker_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no field"):
        configs_from_json('{"engine": {"prefil_chunk_size": 4}}')
    with pytest.raises(ValueError, match="keys"):
        configs_from_json('{"router": {}}')
    with pytest.raises(ValueError, match="prefill_chunk_size must be a positive integer"):
        configs_from_json('{"engine": {"prefill_chunk_size": 0}}')


def test_a_worker_process_runs_with_exactly_the_config_it_was_given() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    options = WorkerOptions(str(model_dir), ENGINE, transfer=TRANSFER)
    worker = start_worker_process("decode", "decode-config", options)
    try:
        stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(worker.address))
        health = stub.Health(common_pb2.HealthRequest(), timeout=60)
        assert json.loads(health.config_json) == json.loads(options.config_json())
        assert health.total_kv_pages == ENGINE.num_kv_pages and health.state_block == ENGINE.state_block
    finally:
        worker.kill()
