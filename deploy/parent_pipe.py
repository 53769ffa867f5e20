"""A child the launcher owns ends when the launcher does, however it exits (SIGKILL included): the launcher
holds the only write end of the child's standard input, which closes when the launcher's process ends. Loads
nothing but the standard library, so a small supervising child (deploy/ray_head.py) starts fast."""

from __future__ import annotations

import os
import signal
import sys
import threading


def watch_parent_pipe() -> None:
    """In a worker started by the launcher: a daemon thread reads standard input until it closes (the launcher
    exited, however it did) and then SIGTERMs this process, which drains and stops as on any SIGTERM."""
    def watch() -> None:
        try:
            # os.read, not sys.stdin.buffer: a daemon thread blocked in the buffered reader holds its lock, and the
            # interpreter's shutdown then aborts (SIGABRT, "could not acquire lock for <stdin>")
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
