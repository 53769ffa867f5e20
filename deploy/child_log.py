"""What a child process the launcher started last wrote to its log: start-up failures quote it."""

from __future__ import annotations

from pathlib import Path


def last_log_line(log_path: Path) -> str:
    """The log's last non-blank line, stripped ("" when the log is missing or empty)."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""
