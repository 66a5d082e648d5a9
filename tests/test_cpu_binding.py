"""kernels/cpu/binding.py mirrors sgl_kernels.h: the same functions, struct fields in the
same order, the same status codes; and the built library exports exactly those functions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sgl.runtime.kernels.cpu import binding

HEADER = (Path(binding.__file__).parent / "sgl_kernels.h").read_text()


def _struct_fields(name: str) -> list[str]:
    body = re.search(r"typedef struct \{([^{}]*)\} " + name + ";", HEADER).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names: list[str] = []
    for decl in body.split(";"):
        decl = decl.strip()
        if decl:  # "const uint16_t *a, *b" -> a, b
            first, *rest = decl.split(",")
            names += [re.findall(r"\w+", part)[-1] for part in [first, *rest]]
    return names


@pytest.mark.parametrize("cls,name", [(binding.DecodeModel, "sgl_decode_model"),
                                      (binding.DecodeBatch, "sgl_decode_batch"),
                                      (binding.AttnParams, "sgl_attn_params"),
                                      (binding.RopeParams, "sgl_rope_params")])
def test_structs_match_the_header(cls, name):
    assert [f for f, _ in cls._fields_] == _struct_fields(name)


def test_functions_and_status_codes_match_the_header():
    declared = set(re.findall(r"\b(sgl_\w+)\(", HEADER))
    assert declared == set(binding._SIGNATURES)
    codes = dict(re.findall(r"SGL_(OK|ERR_\w+) = (\d+)", HEADER))
    assert {k.removeprefix("ERR_"): int(v) for k, v in codes.items()} == {s.name: s.value for s in binding.Status}
    assert all(s.message for s in binding.Status)


def test_every_exported_function_is_bound():
    kernels = binding.kernels()
    if kernels is None:
        pytest.skip("no C compiler for the CPU kernels")
    assert all(hasattr(kernels.lib, name) for name in binding._SIGNATURES)
    assert kernels.decode_fields() == 14
