"""The one test cluster (router, transfer and deploy tests, the router benchmark): in-process workers with
real gRPC on loopback, and a router over them (or only its orchestrator); a tiny NemotronH checkpoint with
the byte-level tokenizer."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from checkpoints import nemotron_h

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.models.default_model import write_byte_tokenizer
from hybridserve.prefill_worker.worker import PrefillWorker
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.router.app import Router
from hybridserve.router.config import RouterOptions
from hybridserve.router.orchestrator import Orchestrator
from hybridserve.transfer.planes import TransferConfig

ENGINE = EngineConfig(prefill_chunk_size=32, max_num_seqs=8, max_model_len=256)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MODEL_NAME = "tiny-hybrid"


def tiny_model_dir() -> Path:
    """NemotronH "M*-M*" (block 16 tokens, a Mamba checkpoint every 32) with a byte tokenizer (vocab 320)."""
    source, _ = nemotron_h("M*-M*", vocab_size=320)
    target = Path(tempfile.mkdtemp(prefix="hybridserve-router-ckpt-")) / MODEL_NAME
    shutil.copytree(source, target)
    write_byte_tokenizer(target)
    return target


class Cluster:
    """Workers in this process (real gRPC on loopback) and a router over them; with `router=False` only the
    router's orchestrator (checkpoints without a tokenizer)."""

    def __init__(self, model_dir: Path, num_prefill: int = 1, num_decode: int = 1, engine: EngineConfig = ENGINE,
                 transfer: TransferConfig | None = None, router: bool = True, internal_token: str | None = None,
                 internal_tls: InternalTlsConfig | None = None, **router_options) -> None:
        self.prefill = [PrefillWorker(model_dir, engine, worker_id=f"p{i}", transfer=transfer,
                                      internal_token=internal_token, internal_tls=internal_tls)
                        for i in range(num_prefill)]
        self.decode = [DecodeWorker(model_dir, engine, worker_id=f"d{i}", transfer=transfer,
                                    internal_token=internal_token, internal_tls=internal_tls) for i in range(num_decode)]
        for w in self.prefill + self.decode:
            w.start()
        prefill, decode = [w.address for w in self.prefill], [w.address for w in self.decode]
        self.router: Router | None = None
        if router:
            options = RouterOptions(str(model_dir), model_name=MODEL_NAME, http_port=0, grpc_port=0,
                                    max_model_len=engine.max_model_len, internal_token=internal_token,
                                    **({"internal_tls": internal_tls} if internal_tls else {}), **router_options)
            self.router = Router(options, prefill, decode).start()
            self.orchestrator = self.router.orchestrator
            self.wait_ready()
        else:
            self.orchestrator = Orchestrator(prefill, decode, internal_token=internal_token, internal_tls=internal_tls,
                                             **router_options)

    def generate(self, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        """Greedy or sampled token ids of one request through the orchestrator."""
        return [t for event in self.orchestrator.generate(prompt, params) for t in event.token_ids]

    def check_pools(self) -> None:
        """Every worker's pool invariants (StatePool.check) hold."""
        for w in self.prefill + self.decode:
            w.loop.call(w.engine.pool.check)

    @property
    def base_url(self) -> str:
        if self.router is None:
            raise RuntimeError("this cluster runs no router")
        return f"http://{self.router.http_address}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every worker answered a health check and its cache-event subscription has its snapshot."""
        deadline = time.monotonic() + timeout
        workers = self.orchestrator.workers
        while time.monotonic() < deadline:
            handles = workers.all()
            if all(h.health is not None and (h.subscriber is None or h.subscriber.ready.is_set()) for h in handles):
                return
            time.sleep(0.05)
        raise TimeoutError("workers did not become ready")

    def idle(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(not w.loop.call(w.engine.has_unfinished) for w in self.prefill + self.decode):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        else:
            self.orchestrator.close()
        for w in self.prefill + self.decode:
            w.stop(grace=0)
