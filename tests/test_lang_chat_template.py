"""Role segments derived from jinja chat templates by rendering sentinel contents."""

from __future__ import annotations

import pytest

from sgl.lang.chat_template import DEFAULT_TEMPLATE, chat_template_from_jinja, chat_template_or_default

SMOLLM = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def _render(source, messages, gen=False):
    import jinja2

    return jinja2.Environment().from_string(source).render(messages=messages, add_generation_prompt=gen,
                                                            bos_token="")


def test_chatml_segments_default_system_and_stop():
    t = chat_template_from_jinja(SMOLLM)
    assert t.get_prefix_and_suffix("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.get_prefix_and_suffix("assistant") == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert t.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert t.stop_str == ("<|im_end|>",)


@pytest.mark.parametrize("source", [SMOLLM, LLAMA3])
def test_segments_reproduce_the_template_exactly(source):
    t = chat_template_from_jinja(source)
    for msgs in (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    ):
        assert t.render(msgs, add_generation_prompt=True) == _render(source, msgs, gen=True)


def test_llama3_stop_is_eot():
    t = chat_template_from_jinja(LLAMA3)
    assert t.stop_str == ("<|eot_id|>",)
    assert t.default_system_prompt is None


def test_missing_template_falls_back_to_default():
    assert chat_template_or_default(None) is DEFAULT_TEMPLATE
