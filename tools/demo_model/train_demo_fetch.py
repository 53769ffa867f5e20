"""Build the demo model's training corpus (tools/demo_model/train_demo.py --corpus): the running interpreter's standard
library plus the Python sources of widely used, permissively licensed packages, fetched with
`pip download --no-deps` (wheels), packed into ONE compressed archive that travels to a GPU machine
without network.

    python tools/demo_model/train_demo_fetch.py --out .demo_data/corpus.tar.xz     # needs PyPI; ~2 minutes

The archive holds `stdlib/<path>` and `<package>/<path>` files (UTF-8 *.py only, vendored copies and files
over --max-file-kb skipped, exact duplicates dropped: the first copy in stdlib-then-package order wins) and
`MANIFEST.json`: every package's version, licence (checked against a permissive allow-list) and file count.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import io
import json
import logging
import platform
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger("train_demo_fetch")

# (distribution, pinned version): pure-Python, everyday libraries under MIT / BSD / Apache-2.0 / PSF
PACKAGES: tuple[tuple[str, str], ...] = (
    ("requests", "2.32.3"), ("urllib3", "2.2.3"), ("idna", "3.10"), ("charset-normalizer", "3.4.0"),
    ("click", "8.1.7"), ("flask", "3.0.3"), ("werkzeug", "3.0.6"), ("jinja2", "3.1.4"),
    ("itsdangerous", "2.2.0"), ("attrs", "24.2.0"), ("six", "1.16.0"), ("python-dateutil", "2.9.0.post0"),
    ("pytz", "2024.2"), ("packaging", "24.2"), ("setuptools", "75.6.0"), ("wheel", "0.45.1"),
    ("tomli", "2.1.0"), ("rich", "13.9.4"), ("pygments", "2.18.0"), ("pytest", "8.3.3"), ("pluggy", "1.5.0"),
    ("iniconfig", "2.0.0"), ("more-itertools", "10.5.0"), ("httpx", "0.27.2"), ("httpcore", "1.0.7"),
    ("h11", "0.14.0"), ("anyio", "4.6.2.post1"), ("sniffio", "1.3.1"), ("starlette", "0.41.3"),
    ("fastapi", "0.115.5"), ("typing-extensions", "4.12.2"), ("black", "24.10.0"), ("isort", "5.13.2"),
    ("pyflakes", "3.2.0"), ("pycodestyle", "2.12.1"), ("flake8", "7.1.1"), ("jsonschema", "4.23.0"),
    ("tabulate", "0.9.0"), ("cachetools", "5.5.0"), ("decorator", "5.1.1"), ("pyparsing", "3.2.0"),
    ("colorama", "0.4.6"), ("tornado", "6.4.2"), ("sqlalchemy", "2.0.36"),
    ("alembic", "1.14.0"), ("marshmallow", "3.23.1"), ("arrow", "1.3.0"), ("beautifulsoup4", "4.12.3"),
    ("soupsieve", "2.6"), ("openpyxl", "3.1.5"), ("django", "5.1.3"), ("networkx", "3.4.2"),
    ("sphinx", "8.1.3"), ("markdown", "3.7"), ("mako", "1.3.6"), ("boltons", "24.1.0"), ("toolz", "1.0.0"),
    ("wrapt", "1.17.0"), ("simplejson", "3.19.3"), ("paramiko", "3.5.0"), ("scrapy", "2.12.0"),
    ("twisted", "24.11.0"), ("mypy-extensions", "1.0.0"), ("pathspec", "0.12.1"), ("platformdirs", "4.3.6"),
    ("filelock", "3.16.1"), ("virtualenv", "20.28.0"), ("distlib", "0.3.9"), ("tox", "4.23.2"),
    ("coverage", "7.6.8"), ("hypothesis", "6.121.2"), ("sortedcontainers", "2.4.0"), ("bottle", "0.13.2"),
    ("falcon", "4.0.2"), ("celery", "5.4.0"), ("kombu", "5.4.2"), ("redis", "5.2.0"), ("pymysql", "1.1.1"),
    ("pyjwt", "2.10.1"), ("oauthlib", "3.2.2"), ("requests-oauthlib", "2.0.0"),
    ("markdown-it-py", "3.0.0"), ("mdurl", "0.1.2"), ("mistune", "3.0.2"), ("humanize", "4.11.0"),
    ("python-slugify", "8.0.4"), ("invoke", "2.2.0"), ("fabric", "3.2.2"), ("xmltodict", "0.14.2"),
)
ALLOWED = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|Unlicense|Public Domain)\b", re.I)
SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__", "_vendor", "vendor", "_vendored", "vendored"}


def licence_of(metadata: str) -> str:
    """The licence a wheel's METADATA declares (License-Expression, License, or the OSI classifiers)."""
    msg = email.parser.Parser().parsestr(metadata, headersonly=True)
    classifiers = [c.split("::")[-1].strip() for c in msg.get_all("Classifier") or [] if c.startswith("License ::")]
    expression = (msg.get("License-Expression") or "").strip()
    field = (msg.get("License") or "").strip().splitlines()[0] if msg.get("License") else ""
    parts = [p for p in (expression, "; ".join(classifiers), field[:80]) if p and p.upper() != "UNKNOWN"]
    return " | ".join(parts) or "unknown"


def wheel_sources(wheel: Path, max_bytes: int) -> tuple[str, list[tuple[str, bytes]]]:
    """(licence, [(path inside the wheel, source)]) of a wheel's *.py files."""
    files, metadata = [], ""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.endswith(".dist-info/METADATA"):
                metadata = zf.read(info).decode("utf-8", "replace")
            elif name.endswith(".py") and not SKIP_PARTS & set(name.split("/")) and info.file_size <= max_bytes:
                files.append((name, zf.read(info)))
    return licence_of(metadata), sorted(files)


def stdlib_sources(max_bytes: int) -> list[tuple[str, bytes]]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or path.stat().st_size > max_bytes:
            continue
        out.append((rel.as_posix(), path.read_bytes()))
    return out


def download(packages: tuple[tuple[str, str], ...], dest: Path) -> dict[str, Path]:
    """pip download --no-deps of each pinned wheel -> {distribution: wheel path}."""
    specs = [f"{name}=={version}" for name, version in packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), *specs]
    subprocess.run(cmd, check=True)
    found = {}
    for name, _ in packages:
        key = re.sub(r"[-_.]+", "_", name).lower()
        matches = [w for w in dest.glob("*.whl") if w.name.split("-")[0].lower() == key]
        if not matches:
            raise FileNotFoundError(f"pip download left no wheel for {name}")
        found[name] = matches[0]
    return found


def build(out: Path, packages: tuple[tuple[str, str], ...], max_bytes: int, wheel_dir: Path) -> dict:
    seen: set[str] = set()
    entries: list[tuple[str, bytes]] = []
    manifest: dict = {"python": platform.python_version(), "packages": [], "excluded": []}

    def add(prefix: str, files: list[tuple[str, bytes]]) -> tuple[int, int]:
        kept = size = 0
        for rel, data in files:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            digest = hashlib.sha256(data.replace(b"\r\n", b"\n").strip()).hexdigest()
            if digest in seen or not data.strip():
                continue
            seen.add(digest)
            entries.append((f"{prefix}/{rel}", data))
            kept, size = kept + 1, size + len(data)
        return kept, size

    kept, size = add("stdlib", stdlib_sources(max_bytes))
    manifest["stdlib"] = {"files": kept, "bytes": size, "licence": "PSF-2.0"}
    wheels = download(packages, wheel_dir)
    for name, version in packages:
        licence, files = wheel_sources(wheels[name], max_bytes)
        if not ALLOWED.search(licence):
            manifest["excluded"].append({"name": name, "version": version, "licence": licence})
            logger.warning("%s %s: licence %r not on the allow-list, excluded", name, version, licence)
            continue
        kept, size = add(name, files)
        manifest["packages"].append({"name": name, "version": version, "licence": licence, "files": kept,
                                     "bytes": size, "wheel": wheels[name].name})
        logger.info("%-20s %-12s %5d files %6.2f MB  %s", name, version, kept, size / 1e6, licence)
    manifest["files"] = len(entries)
    manifest["bytes"] = sum(len(d) for _, d in entries)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=9) as tar:
        blob = json.dumps(manifest, indent=1).encode()
        for name, data in [("MANIFEST.json", blob), *entries]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    logger.info("%s: %d files, %.1f MB source, %.1f MB compressed", out, manifest["files"],
                manifest["bytes"] / 1e6, out.stat().st_size / 1e6)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".demo_data/corpus.tar.xz"))
    p.add_argument("--max-file-kb", type=int, default=256, help="skip larger files (generated tables)")
    p.add_argument("--wheel-dir", type=Path, default=None, help="keep the downloaded wheels here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    with tempfile.TemporaryDirectory() as tmp:
        build(args.out, PACKAGES, args.max_file_kb * 1024, args.wheel_dir or Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
