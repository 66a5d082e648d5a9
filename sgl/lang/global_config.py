"""Process-wide DSL settings (`sgl.global_config`), mirroring SGLang's names."""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    def __init__(self) -> None:
        # The backend used when `run`/`run_batch` get none.
        self.default_backend: Any = None
        # 0 silent, 1 warnings, 2 print each finished program's text.
        self.verbosity = 0
        # run_batch warms the cache with the programs' constant prefix (found by tracing).
        self.enable_precache_with_tracing = True
        # Only prefixes longer than this many characters are worth a warm-up call.
        self.precache_min_chars = 64
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        # SGLang knobs kept for compatibility; they do not change behaviour here.
        self.enable_parallel_encoding = True
        self.default_timeout: float | None = None


global_config = GlobalConfig()
