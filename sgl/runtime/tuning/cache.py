"""Where calibrated paths are kept: one JSON file per (host, kernel build, torch, model
shapes, threads) under `<cache dir>/tuning/`.

The key's parts are the facts a measurement depends on: the CPU's model name and flags
line (/proc/cpuinfo), the C kernel build (kernels/cpu `build_key`: sources, compiler,
CPU flags), torch's version, the model's shape signature, the thread count, the Python
that times and applies the paths (`logic_key`) and the settings that pick torch's GEMM
kernels (ATEN_CPU_CAPABILITY, oneDNN's and MKL's ISA limits). A file
holds {"key": parts, "items": {name: {"value": ..., "timings_ms": {...}}}}; items measured
at a later start are merged in. A file that does not parse, or whose key differs (a hash
collision, a hand edit), is ignored with a warning and rewritten; writes go to a
temporary file renamed into place, so concurrent starts never read half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sgl.runtime.config import kernel_environment

log = logging.getLogger("sgl.tuning")

FORMAT = 2  # bump when the file layout or the meaning of an item changes


def cpu_identity(cpuinfo: str | None = None) -> tuple[str, str]:
    """(model name, flags line) of this CPU from /proc/cpuinfo (empty where unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    name = flags = ""
    for line in cpuinfo.splitlines():
        head, _, value = line.partition(":")
        if head.strip() == "model name" and not name:
            name = value.strip()
        elif head.strip() in ("flags", "Features") and not flags:
            flags = value.strip()
    return name, flags


def shape_signature(config: Any, dtype: str) -> str:
    """The model shapes measurements run on (weights' values do not matter)."""
    c = config
    return (f"L{c.num_layers}-h{c.hidden_size}-i{c.intermediate_size}-q{c.num_heads}-kv{c.num_kv_heads}"
            f"-d{c.head_dim}-v{c.vocab_size}-b{int(bool(c.attention_bias))}{int(bool(c.o_proj_bias))}"
            f"-t{int(bool(c.tie_word_embeddings))}-{dtype}")


_RUNTIME = Path(__file__).resolve().parent.parent
# The Python that decides what is timed and what a cached answer means (the fp32 path's
# padding rows, the C step's row limits): an edit there must not trust old answers.
_LOGIC_FILES = ("tuning/measure.py", "tuning/calibrate.py", "kernels/cpu/linear.py", "kernels/cpu/decode.py")


def logic_key() -> str:
    h = hashlib.sha256()
    for rel in _LOGIC_FILES:
        try:
            h.update((_RUNTIME / rel).read_bytes())
        except OSError:
            h.update(rel.encode())
    return h.hexdigest()[:16]


def key_parts(cpu: tuple[str, str], build: str | None, torch_version: str, shapes: str, threads: int) -> dict[str, Any]:
    return {"format": FORMAT, "cpu_model": cpu[0], "cpu_flags": cpu[1], "kernel_build": build or "none",
            "torch": torch_version, "model_shapes": shapes, "threads": threads, "logic": logic_key(),
            "kernel_env": kernel_environment()}  # they pick torch's GEMM kernels: timings, fp32 checks


def cache_path(root: Path, parts: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return root / "tuning" / f"paths-{digest}.json"


def read_items(path: Path, parts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The cached items of `parts` at `path`, {} when there is none (or it is unusable)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("path calibration cache %s unreadable (%s): measuring again", path, e)
        return {}
    try:
        data = json.loads(raw.decode())  # UnicodeDecodeError is a ValueError too
        if not isinstance(data, dict) or data.get("key") != parts or not isinstance(data.get("items"), dict):
            raise ValueError("not a calibration file of this host, build and model")
        items = data["items"]
        for name, item in items.items():
            if not isinstance(item, dict) or "value" not in item:
                raise ValueError(f"item {name!r} has no value")
            timings = item.get("timings_ms", {})
            if not isinstance(timings, dict) or not all(isinstance(v, (int, float)) for v in timings.values()):
                raise ValueError(f"item {name!r} has timings that are not numbers")
        return items
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        log.warning("path calibration cache %s is corrupt (%s): ignoring it; it will be rewritten", path, e)
        return {}


LOCK_WAIT_S = 120.0  # a start waits at most this long for another's calibration


@contextlib.contextmanager
def exclusive(path: Path, wait_s: float | None = None) -> Iterator[bool]:
    """Hold `path`.lock exclusively (flock) while the body reads, measures and writes; yields
    whether it got the lock. After `wait_s` (a stuck start elsewhere) or where locking is
    impossible (read-only cache folder, no fcntl) the body runs unlocked, as before."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield False
        return
    deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
    got = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("path calibration cache %s: another start holds it for %.0f s; measuring "
                                "without waiting", path, LOCK_WAIT_S if wait_s is None else wait_s)
                    break
                time.sleep(0.05)
            except OSError:
                break
        yield got
    finally:
        os.close(fd)  # releases the lock


def write_items(path: Path, parts: dict[str, Any], items: dict[str, dict[str, Any]]) -> None:
    """Write atomically; a failure (read-only cache folder) only warns: the choice still holds."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": parts, "items": items}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("could not write the path calibration cache %s: %s", path, e)
