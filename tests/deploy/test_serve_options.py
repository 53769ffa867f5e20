"""Deployment options: one chain (ServeOptions -> RouterOptions + WorkerOptions -> EngineConfig / TransferConfig);
prefill workers may differ from decode workers in named engine fields only; what the router and the workers
must agree on is checked or filled in once."""

from __future__ import annotations

import dataclasses

import pytest

from hybridserve.deploy.options import ServeOptions, UpOptions, WorkerOptions
from hybridserve.engine.config import EngineConfig
from hybridserve.router.config import RouterOptions


def _serve(**kwargs: object) -> ServeOptions:
    engine = kwargs.pop("engine", EngineConfig())
    return ServeOptions(router=RouterOptions("m"), worker=WorkerOptions("m", engine), **kwargs)  # type: ignore[arg-type]


def test_prefill_workers_get_their_overrides_and_decode_workers_do_not() -> None:
    options = _serve(engine=EngineConfig(prefill_chunk_size=256), prefill_engine_overrides={"prefill_chunk_size": 4096})
    assert options.worker_for("prefill").engine.prefill_chunk_size == 4096
    assert options.worker_for("decode").engine.prefill_chunk_size == 256


def test_a_disaggregated_deployment_gives_its_workers_standby_slots_unless_told() -> None:
    pd = _serve(engine=EngineConfig(max_num_seqs=8), prefill_engine_overrides={"max_num_seqs": 4})
    assert pd.worker_for("decode").engine.standby_state_slots == 8
    assert pd.worker_for("prefill").engine.standby_state_slots == 4
    colocated = _serve(num_prefill=0, engine=EngineConfig(max_num_seqs=8))
    assert colocated.worker_for("decode").engine.standby_state_slots is None
    told = _serve(engine=EngineConfig(max_num_seqs=8, standby_state_slots=0))
    assert told.worker_for("decode").engine.standby_state_slots == 0
    with pytest.raises(ValueError, match="standby_state_slots must be an integer >= 0"):
        EngineConfig(standby_state_slots=-1)


@pytest.mark.parametrize("overrides, message", [
    ({"prefill_chunk_sz": 4096}, "name no EngineConfig field: ['prefill_chunk_sz']"),
    ({"prefill_chunk_size": 0}, "prefill_chunk_size must be a positive integer"),
])
def test_bad_overrides_are_refused_before_anything_starts(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        _serve(prefill_engine_overrides=overrides)
    assert message in str(info.value)


def test_the_router_takes_the_engine_context_length_and_the_shared_token() -> None:
    options = _serve(engine=EngineConfig(max_model_len=512))
    assert options.router.max_model_len == 512
    secured = options.with_internal_token("t" * 32)
    assert isinstance(secured, ServeOptions)
    assert secured.router.internal_token == secured.worker.internal_token == "t" * 32
    with pytest.raises(ValueError, match="one internal token"):
        dataclasses.replace(options, router=dataclasses.replace(options.router, internal_token="x" * 16))
    with pytest.raises(ValueError, match="different checkpoints"):
        ServeOptions(router=RouterOptions("a"), worker=WorkerOptions("b"))
    with pytest.raises(ValueError, match="at least 16"):
        WorkerOptions("m", internal_token="short")


def test_up_options_extend_the_same_chain() -> None:
    up = UpOptions(router=RouterOptions("m", host="0.0.0.0"), worker=WorkerOptions("m", host="node-ip"),
                   address="auto", num_decode=2)
    assert up.num_decode == 2 and up.worker_for("decode").host == "node-ip"
    with pytest.raises(ValueError, match="--timeout"):
        UpOptions(router=RouterOptions("m"), worker=WorkerOptions("m"), address="auto", timeout_s=0)


def test_no_field_is_defined_twice_along_the_chain() -> None:
    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    cluster_own = names(ServeOptions) - {"router", "worker"}
    for part in (RouterOptions, WorkerOptions, EngineConfig):
        shared = cluster_own & names(part)
        assert not shared, f"{part.__name__} repeats {shared}"


def test_the_cli_builds_the_chain_and_binds_workers_where_told(monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridserve.cli as cli
    from hybridserve.deploy import serve as serve_module

    seen: list[ServeOptions] = []
    monkeypatch.setattr(serve_module, "serve", lambda options: seen.append(options) or 0)
    monkeypatch.setattr(cli, "_early_preflight", lambda argv: None)  # "m" and 10.0.0.1 exist only in this test
    monkeypatch.delenv("HYBRIDSERVE_INTERNAL_TOKEN", raising=False)
    assert cli.main(["serve", "--no-ray", "--model", "m", "--max-model-len", "300", "--max-per-client", "3",
                     "--drain-timeout", "7"]) == 0
    options = seen[-1]
    assert options.worker.host == "127.0.0.1" and options.router.max_model_len == 300
    assert options.router.admission.max_per_client == 3
    assert options.router.drain_timeout_s == options.worker.drain_timeout_s == 7.0
    assert options.secure_internal and options.worker.internal_token is None  # serve() makes one per run
    assert cli.main(["serve", "--address", "10.0.0.1:6379", "--model", "m", "--internal-token", "t" * 20]) == 0
    assert seen[-1].worker.host == "node-ip" and seen[-1].router.internal_token == "t" * 20


def test_internal_tls_travels_whole_to_worker_processes_and_must_match_the_routers() -> None:
    from hybridserve.cli import build_parser
    from hybridserve.cli_options import internal_tls
    from hybridserve.proto.internal_tls import InternalTlsConfig

    tls = InternalTlsConfig(ca_file="/etc/tls/ca.crt", cert_file="/etc/tls/tls.crt", key_file="/etc/tls/tls.key",
                            server_name="internal.example")
    worker = WorkerOptions("m", internal_tls=tls)
    args = build_parser().parse_args(["worker", "--role", "decode", *worker.argv()])
    assert internal_tls(args) == tls
    assert internal_tls(build_parser().parse_args(["worker", "--role", "decode", *WorkerOptions("m").argv()])) \
        == InternalTlsConfig()
    with pytest.raises(ValueError, match="internal TLS"):
        ServeOptions(router=RouterOptions("m"), worker=worker)
    assert ServeOptions(router=RouterOptions("m", internal_tls=tls), worker=worker).worker.internal_tls.enabled
