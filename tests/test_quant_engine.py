"""The whole engine on the embedded GGUF model with its default, --quantization gguf: the
decode steps run on the file's blocks (get_server_info says which types), and greedy
generation is coherent text."""

from __future__ import annotations

import pytest

from sgl.runtime.engine import Engine
from sgl.runtime.kernels.cpu import binding

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(binding.kernels() is None, reason="no C compiler for the CPU kernels")]


def test_engine_decodes_on_gguf_blocks_by_default():
    with Engine(max_total_tokens=4096) as eng:
        outs = eng.generate(["The capital of France is", "def fibonacci(n):"],
                            {"temperature": 0, "max_new_tokens": 16})
        info = eng.get_server_info()
    assert info["quantization"] == "gguf"
    assert info["quantized_weights"] == {"Q4_1": 210, "Q8_0": 1}
    assert 90e6 < info["quantized_weight_bytes"] < 100e6  # 96.4 MB of blocks beside the bf16 weights
    assert info["cpu_decode_steps"] > 0  # the steps ran in the C kernel, on the blocks
    assert "Paris" in outs[0]["text"]
    assert "if n" in outs[1]["text"] and "return" in outs[1]["text"], outs[1]["text"]


def test_engine_with_quantization_none_reports_none():
    with Engine(max_total_tokens=4096, quantization="none") as eng:
        out = eng.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
        info = eng.get_server_info()
    assert info["quantization"] == "none" and info["quantized_weights"] == {} and info["quantized_weight_bytes"] == 0
    assert "Paris" in out["text"]


def test_gguf_linear_path_runs_prefill_on_the_blocks_and_rows_do_not_depend_on_the_batch():
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a town by the sea,",
               "1, 2, 3, 4, 5,"]
    sp = {"temperature": 0, "max_new_tokens": 12}
    # max_running_requests 2 with 4 prompts: later prompts join a running batch mid-way
    with Engine(max_total_tokens=4096, cpu_linear="gguf", max_running_requests=2) as eng:
        info = eng.get_server_info()
        alone = [eng.generate(p, sp)["text"] for p in prompts]
        eng.flush_cache()
        together = [o["text"] for o in eng.generate(prompts, sp)]
        again = eng.generate(prompts[2], sp)  # its prompt is cached now: only the last token is extended
    assert info["cpu_paths"]["linear"] == "gguf" and info["cpu_paths"]["sources"]["linear"] == "flag"
    assert together == alone
    assert again["meta_info"]["cached_tokens"] > 0 and again["text"] == alone[2]
    assert "Paris" in alone[0] and "6, 7" in alone[3]


def test_gguf_linear_path_needs_the_blocks():
    with Engine(max_total_tokens=4096, quantization="none", cpu_linear="gguf") as eng:
        info = eng.get_server_info()
        out = eng.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    assert info["cpu_paths"]["linear"] == "bf16"  # warned and stayed on bf16 GEMMs
    assert "Paris" in out["text"]
