"""The NIXL data plane (optional extra `hybridserve[nixl]`): the decode worker READs the prefill worker's
registered staging arena through a NIXL agent over UCX (RDMA where the fabric has it, TCP or shared memory
otherwise), as vLLM's NixlConnector does for KV.

Each side registers its arena with its own agent once. The sender's agent metadata and the arena's base
address travel in the StateOffer's descriptor; the receiver adds the sender as a remote agent on first sight
(cached by source id) and reads the offered range straight into its landing block.
"""

from __future__ import annotations

import pickle
import threading
import time
import uuid

from hybridserve.transfer.arena import Arena, ArenaRange
from hybridserve.transfer.manifest import TransferError
from hybridserve.transfer.planes import NIXL

NIXL_TIMEOUT_S = 60.0
_POLL_S = 0.0002


def _agent(name: str):  # noqa: ANN202 - nixl's own type
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ValueError("transfer plane 'nixl' needs the nixl package: pip install 'hybridserve[nixl]'") from exc
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _memory(arena: Arena) -> tuple[str, int]:
    """NIXL's memory type and device id of an arena's buffer."""
    if arena.device.type == "cuda":
        return "VRAM", arena.buffer.device.index or 0
    return "DRAM", 0


class NixlSource:
    """The sending side: an agent with the staging arena registered."""

    plane = NIXL

    def __init__(self, arena: Arena) -> None:
        self.source_id = f"nixl-{uuid.uuid4().hex}"
        self._agent = _agent(self.source_id)
        self._registration = self._agent.register_memory(arena.buffer)
        mem, dev = _memory(arena)
        self._descriptor = pickle.dumps({
            "metadata": self._agent.get_agent_metadata(), "base": arena.buffer.data_ptr(),
            "nbytes": arena.capacity, "mem": mem, "dev": dev,
        })

    def descriptor(self) -> bytes:
        return self._descriptor

    def close(self) -> None:
        self._agent.deregister_memory(self._registration)


class NixlSink:
    """The receiving side: an agent with the landing arena registered; reads offered ranges."""

    plane = NIXL

    def __init__(self, landing: Arena) -> None:
        self._agent = _agent(f"nixl-sink-{uuid.uuid4().hex}")
        self._registration = self._agent.register_memory(landing.buffer)
        self._mem, self._dev = _memory(landing)
        self._peers: dict[str, tuple[str, dict]] = {}  # source id -> (agent name, descriptor)
        self._lock = threading.Lock()  # NIXL calls on one agent are serialized; the transfers overlap

    def _peer(self, source_id: str, descriptor: bytes) -> tuple[str, dict]:
        with self._lock:
            if source_id not in self._peers:
                try:
                    info = pickle.loads(descriptor)
                    name = self._agent.add_remote_agent(info["metadata"])
                except Exception as exc:
                    raise TransferError("FAILED_PRECONDITION", f"cannot reach the sender's NIXL agent: {exc}") from exc
                self._peers[source_id] = (name.decode() if isinstance(name, bytes) else name, info)
            return self._peers[source_id]

    def fetch(self, source_id: str, descriptor: bytes, offset: int, block: ArenaRange) -> None:
        """READ the sender's bytes [offset, offset + block.nbytes) into `block`; returns when they landed."""
        name, info = self._peer(source_id, descriptor)
        if offset < 0 or offset + block.nbytes > info["nbytes"]:
            raise TransferError("INVALID_ARGUMENT", f"offer range {offset}+{block.nbytes} is outside the sender's arena")
        with self._lock:
            local = self._agent.get_xfer_descs([(block.data.data_ptr(), block.nbytes, self._dev)], self._mem)
            remote = self._agent.get_xfer_descs([(info["base"] + offset, block.nbytes, info["dev"])], info["mem"])
            handle = self._agent.initialize_xfer("READ", local, remote, name)
            state = self._agent.transfer(handle)
        try:
            deadline = time.monotonic() + NIXL_TIMEOUT_S
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError("DEADLINE_EXCEEDED", f"NIXL read of {block.nbytes} bytes did not finish")
                time.sleep(_POLL_S)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError("UNAVAILABLE", "NIXL read failed (the sender went away?)")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        with self._lock:
            for name, _ in self._peers.values():
                self._agent.remove_remote_agent(name)
            self._peers.clear()
            self._agent.deregister_memory(self._registration)
