"""Helpers of the router tests (and the router benchmark): a tiny NemotronH checkpoint with the byte-level
tokenizer, in-process workers, and a router over them."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from checkpoints import nemotron_h

from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.models.default_model import write_byte_tokenizer
from hybridserve.prefill_worker.worker import PrefillWorker
from hybridserve.router.app import Router, RouterOptions

ENGINE = EngineConfig(prefill_chunk_size=32, max_num_seqs=8, max_model_len=256)
MODEL_NAME = "tiny-hybrid"


def tiny_model_dir() -> Path:
    """NemotronH "M*-M*" (block 16 tokens, a Mamba checkpoint every 32) with a byte tokenizer (vocab 320)."""
    source, _ = nemotron_h("M*-M*", vocab_size=320)
    target = Path(tempfile.mkdtemp(prefix="hybridserve-router-ckpt-")) / MODEL_NAME
    shutil.copytree(source, target)
    write_byte_tokenizer(target)
    return target


class Cluster:
    """Workers in this process (real gRPC on loopback) and a router over them."""

    def __init__(self, model_dir: Path, num_prefill: int, num_decode: int, engine: EngineConfig = ENGINE,
                 **router_options) -> None:
        self.prefill = [PrefillWorker(model_dir, engine, worker_id=f"p{i}") for i in range(num_prefill)]
        self.decode = [DecodeWorker(model_dir, engine, worker_id=f"d{i}") for i in range(num_decode)]
        for w in self.prefill + self.decode:
            w.start()
        options = RouterOptions(str(model_dir), model_name=MODEL_NAME, http_port=0, grpc_port=0,
                                max_model_len=engine.max_model_len, **router_options)
        self.router = Router(options, [w.address for w in self.prefill], [w.address for w in self.decode]).start()
        self.wait_ready()

    @property
    def base_url(self) -> str:
        return f"http://{self.router.http_address}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every worker answered a health check and its cache-event subscription has its snapshot."""
        deadline = time.monotonic() + timeout
        workers = self.router.orchestrator.workers
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
        self.router.stop()
        for w in self.prefill + self.decode:
            w.stop(grace=0)
