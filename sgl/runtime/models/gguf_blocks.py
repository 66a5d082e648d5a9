"""The raw quantized blocks of a GGUF file's matrices, laid out as the decode step reads them.

For `--quantization gguf` the C decode step (kernels/cpu/decode.c, quant.c) multiplies
GGUF blocks directly instead of the dequantized bf16 copy the torch model holds (the
torch model keeps that copy for prefill). This module reads each Llama matrix's rows of
blocks from the file and arranges them as our model's fused weights: qkv = the rows of
q, k, v concatenated, gate_up = gate then up. llama.cpp's converter permutes q and k
rows per head (see gguf_convert._unpermute); a row of blocks is a whole row of the
matrix, so the same row permutation is undone on the byte rows. A fused weight whose
parts differ in type, or a type without a C product (F16, Q5_K, ...), is left out: the
decode step then reads the bf16 matrix for it. Matrices are copied out of the file's
memory map, so the file can change afterwards without touching a running model.
Parsing a GGUF file (its ~50k-entry vocabulary above all) takes seconds, so the arranged
blocks are cached once as a safetensors file in the model's converted cache folder, next
to the dequantized weights (`load_gguf_blocks`); a cache that cannot be read is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file

from sgl.runtime.config import QUANTIZATION_CHOICES
from sgl.runtime.memory import huge_pages
from sgl.runtime.models.gguf_convert import _unpermute, hf_config_from_fields, read_fields

# Block types the C products handle (kernels/cpu/quant.c), by GGML type id.
NATIVE_TYPES = frozenset(int(t) for t in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                                          GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K,
                                          GGMLQuantizationType.Q6_K))
log = logging.getLogger(__name__)

# safetensors format, but not named *.safetensors: load_hf_weights reads every such file
# of the folder as the model's weights
BLOCKS_FILE = "gguf_blocks.sgl-st"
BLOCKS_VERSION = "1"  # bump when the arrangement below changes
_FUSED = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
          "down": ("ffn_down",)}


@dataclass
class BlockWeight:
    """One matrix as rows of GGUF blocks: `data` is uint8 [rows, bytes per row]."""

    wtype: int  # GGML type id (binding.WeightType)
    data: torch.Tensor

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.wtype).name


@dataclass
class GGUFBlocks:
    """The decode step's quantized matrices: per layer "qkv", "o", "gate_up", "down" where
    native (missing: bf16 for that weight); the embedding; the vocab projection (None:
    tied to the embedding, or not native). `tensors` counts the file's matrices per type
    as they run: native types by name, the rest as "bf16"."""

    layers: list[dict[str, BlockWeight]]
    embed: BlockWeight | None
    head: BlockWeight | None
    tied: bool
    tensors: dict[str, int] = field(default_factory=dict)

    def nbytes(self) -> int:
        ws = [w for layer in self.layers for w in layer.values()] + [w for w in (self.embed, self.head) if w]
        return sum(w.data.numel() for w in ws)


def gguf_source(hf_dir: Path) -> Path | None:
    """The GGUF file a converted cache folder came from (its sgl_source.json), or None for
    an ordinary Hugging Face folder."""
    src = Path(hf_dir) / "sgl_source.json"
    if not src.exists():
        return None
    path = json.loads(src.read_text()).get("gguf")
    return Path(path) if path else None


def resolve_quantization(quantization: str | None, gguf: Path | None) -> str:
    """The quantization in effect: `gguf` by default for a GGUF model, else `none`."""
    if quantization is None:
        return "gguf" if gguf is not None else "none"
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {quantization!r}")
    if quantization == "gguf" and gguf is None:
        raise ValueError("--quantization gguf needs a GGUF model (a .gguf file); this model is a Hugging Face "
                         "folder: use --quantization none")
    if quantization == "gguf" and not gguf.exists():
        raise ValueError(f"--quantization gguf: the model's GGUF file {gguf} is gone; use --quantization none")
    return quantization


def _rows(t, n_head: int | None) -> np.ndarray:
    """The tensor's rows of blocks as uint8 [rows, bytes]; q/k rows unpermuted."""
    data = np.asarray(t.data).view(np.uint8)
    data = data.reshape(int(t.shape[-1]) if len(t.shape) > 1 else 1, -1)  # gguf shape is (in, out)
    return _unpermute(data, n_head) if n_head else data


def read_gguf_blocks(path: Path) -> GGUFBlocks:
    """Every native matrix of the GGUF file at `path`, fused as the model's weights."""
    reader = GGUFReader(str(path))
    config = hf_config_from_fields(read_fields(reader))
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    by_name = {t.name: t for t in reader.tensors}
    counts: dict[str, int] = {}

    def note(ts: list, native: bool) -> None:
        for t in ts:
            name = t.tensor_type.name if native else "bf16"
            counts[name] = counts.get(name, 0) + 1

    def fused(names: list[str], heads: list[int | None]) -> BlockWeight | None:
        ts = [by_name[n] for n in names]
        types = {int(t.tensor_type) for t in ts}
        native = len(types) == 1 and types <= NATIVE_TYPES
        note(ts, native)
        if not native:
            return None
        rows = np.concatenate([_rows(t, h) for t, h in zip(ts, heads)], axis=0)
        return BlockWeight(types.pop(), torch.from_numpy(rows))  # concatenate made a fresh contiguous copy

    layers = []
    for i in range(config["num_hidden_layers"]):
        layer = {}
        for key, parts in _FUSED.items():
            heads = [n_head, n_kv, None] if key == "qkv" else [None] * len(parts)
            w = fused([f"blk.{i}.{p}.weight" for p in parts], heads)
            if w is not None:
                layer[key] = w
        layers.append(layer)
    embed = fused(["token_embd.weight"], [None])
    tied = "output.weight" not in by_name
    head = None if tied else fused(["output.weight"], [None])
    return GGUFBlocks(layers=layers, embed=embed, head=head, tied=tied, tensors=counts)


def _save(blocks: GGUFBlocks, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(blocks.layers):
        tensors.update({f"layers.{i}.{key}": w.data for key, w in layer.items()})
    if blocks.embed is not None:
        tensors["embed"] = blocks.embed.data
    if blocks.head is not None:
        tensors["head"] = blocks.head.data
    types = {}
    for i, layer in enumerate(blocks.layers):
        types.update({f"layers.{i}.{key}": w.wtype for key, w in layer.items()})
    types.update({k: w.wtype for k, w in (("embed", blocks.embed), ("head", blocks.head)) if w is not None})
    meta = {"version": BLOCKS_VERSION, "types": json.dumps(types), "tensors": json.dumps(blocks.tensors),
            "tied": json.dumps(blocks.tied), "n_layers": str(len(blocks.layers))}
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared like the rest
        os.replace(tmp, path)  # concurrent first starts: whole files only
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> GGUFBlocks:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        if meta.get("version") != BLOCKS_VERSION:
            raise ValueError(f"blocks cache version {meta.get('version')!r}")
        types = json.loads(meta["types"])
        w = {name: BlockWeight(int(types[name]), f.get_tensor(name)) for name in f.keys()}
    layers = [{key: w[f"layers.{i}.{key}"] for key in _FUSED if f"layers.{i}.{key}" in w}
              for i in range(int(meta["n_layers"]))]
    return GGUFBlocks(layers=layers, embed=w.get("embed"), head=w.get("head"), tied=json.loads(meta["tied"]),
                      tensors=json.loads(meta["tensors"]))


def load_gguf_blocks(hf_dir: Path, gguf: Path) -> GGUFBlocks:
    """The blocks of `gguf` (_cached_blocks), on huge pages."""
    return _on_huge_pages(_cached_blocks(hf_dir, gguf))


def _cached_blocks(hf_dir: Path, gguf: Path) -> GGUFBlocks:
    """The blocks of `gguf`, from the cache in its converted folder `hf_dir` (written on
    first use; where the folder is read-only, read from the file every time)."""
    cached = Path(hf_dir) / BLOCKS_FILE
    if cached.exists():
        try:
            return _load(cached)
        except Exception as e:  # a damaged or older cache: rebuild it
            log.warning("ignoring the GGUF blocks cache %s (%s); rebuilding it", cached, e)
    blocks = read_gguf_blocks(gguf)
    try:
        _save(blocks, cached)
    except OSError as e:
        log.info("could not cache the GGUF blocks in %s: %s", hf_dir, e)
    return blocks


def _on_huge_pages(blocks: GGUFBlocks) -> GGUFBlocks:
    """`blocks` with every matrix moved into one block of huge pages (memory/huge_pages.py):
    each decode step streams all of them. One matrix at a time, so the load's peak is the
    block plus one matrix, not two copies of the weights."""
    weights = [w for layer in blocks.layers for w in layer.values()]
    weights += [w for w in (blocks.embed, blocks.head) if w is not None]
    for w, view in zip(weights, huge_pages.views([(tuple(w.data.shape), w.data.dtype) for w in weights])):
        view.copy_(w.data)
        w.data = view
    return blocks
