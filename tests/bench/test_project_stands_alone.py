"""The project speaks of itself and stands alone: the README stays a five-minute read, and no project file points
outside the repository or names the work sessions and device runs its results came from."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".sh", ".toml", ".yaml", ".yml", ".json", ".txt", ".cfg", ".ini", ".proto"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".peer", ".whl",
             ".demo_data", "build", "dist", "node_modules"}
OUTSIDE = re.compile(re.escape("../" + "shared") + "|" + re.escape("/work/" + "shared"))
RUN_NAME = re.compile(r"\b(?:session|call)[0-9]+\b", re.IGNORECASE)  # e.g. a results folder named after a run
# in code only as a path component, so that a variable named like a run (a word and a digit) stays a variable
RUN_FOLDER = re.compile(r"[/\\](?:session|call)[0-9]+\b|\b(?:session|call)[0-9]+[/\\]", re.IGNORECASE)


def _project_files() -> Iterator[Path]:
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                   and not (folder == str(ROOT) and d == "shared")]  # a device copy's tools, not the project
        for name in files:
            yield Path(folder) / name


@lru_cache(maxsize=1)
def _text_lines() -> tuple[tuple[str, int, str], ...]:
    """(path, line number, line) of every text file of the project, read once for both scans."""
    return tuple((str(path.relative_to(ROOT)), number, line) for path in _project_files() if path.suffix in TEXT_SUFFIXES
                 for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1))


def test_readme_is_a_five_minute_read() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_no_file_points_outside_the_repository() -> None:
    hits = [f"{path}:{number}: {line.strip()[:100]}" for path, number, line in _text_lines() if OUTSIDE.search(line)]
    assert not hits, "files that point outside the repository:\n" + "\n".join(hits)


def test_no_file_or_folder_is_named_after_a_run() -> None:
    hits = [str(path.relative_to(ROOT)) for path in _project_files()
            if any(RUN_NAME.search(part) for part in path.relative_to(ROOT).parts)]
    hits += [f"{path}:{number}: {line.strip()[:100]}" for path, number, line in _text_lines()
             if (RUN_FOLDER if path.endswith(".py") else RUN_NAME).search(line)]
    assert not hits, "name what was measured, not the session or device run:\n" + "\n".join(hits)
