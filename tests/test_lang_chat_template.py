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


# Gemma's shape: refuses a system message, names the assistant "model".
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
         "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# Mistral's shape: a system message is folded into the last user turn, not appended.
MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
           "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
           "{{ bos_token }}{% for message in loop_messages %}"
           "{% if message['role'] == 'user' %}{% if loop.last and system_message is defined %}"
           "{{ '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
           "{% else %}{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}"
           "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")


def _render(source, messages, gen=False):
    import jinja2

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    return jinja2.Environment().from_string(source).render(messages=messages, add_generation_prompt=gen,
                                                            bos_token="", eos_token="</s>",
                                                            raise_exception=raise_exception)


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


@pytest.mark.parametrize("source", [GEMMA, MISTRAL], ids=["gemma", "mistral"])
def test_templates_without_a_system_role_keep_their_own_turns(source):
    t = chat_template_from_jinja(source, name="m", eos_token="</s>")
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    assert t.render(chat) == _render(source, chat)
    assert t.render(chat[:3]) == _render(source, chat[:3])
    assert "<|im_start|>" not in t.get_prefix_and_suffix("user")[0]
    with pytest.raises(ValueError, match="no 'system' role; put the instructions in the first user message"):
        t.get_prefix_and_suffix("system")
