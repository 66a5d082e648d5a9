"""Role segments for `sgl.system/user/assistant`, derived from the model's jinja template.

A program writes a chat as text: `prefix(role) + content + suffix(role)` per message, so
the text the model sees must be exactly what the tokenizer's chat template would render
for the same messages. Rather than keeping a table of hand-written templates, we render
the model's own template with sentinel contents and cut the text around the sentinels:

    render([... , {role, SENTINEL}]) = render([...]) + prefix + SENTINEL + suffix

The template's default system prompt (inserted when a chat does not start with a
system message) is found the same way, and the end-of-turn marker (the assistant
suffix without trailing whitespace, e.g. "<|im_end|>") becomes a stop string for gens
inside assistant turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_SENTINEL = "\x00SGL_CONTENT\x00"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """Per-role text around each message, plus what is needed to drive a chat."""

    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    image_token: str = "<image>"
    extra: dict = field(default_factory=dict)

    def get_prefix_and_suffix(self, role: str, history: list[dict] | None = None) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            hint = "; put the instructions in the first user message" if role == "system" else ""
            raise ValueError(f"the chat template of {self.name!r} has no {role!r} role{hint}")
        return self.role_prefix_and_suffix[role]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of a whole chat, as the DSL would write it."""
        out = ""
        if messages and messages[0]["role"] != "system" and self.default_system_prompt:
            p, s = self.role_prefix_and_suffix["system"]
            out += p + self.default_system_prompt + s
        for m in messages:
            p, s = self.role_prefix_and_suffix[m["role"]]
            out += p + m["content"] + s
        if add_generation_prompt:
            out += self.role_prefix_and_suffix["assistant"][0]
        return out


# Used when the model ships no template (base models): plain "ROLE:" lines like SGLang's default.
DEFAULT_TEMPLATE = ChatTemplate(
    name="default",
    role_prefix_and_suffix={"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
)

CHATML_TEMPLATE = ChatTemplate(
    name="chatml",
    role_prefix_and_suffix={
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    },
    stop_str=("<|im_end|>",),
)


def _renderer(source: str, special: dict[str, str]):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string(source)

    def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)

    return render


def _cut(before: str, after: str, what: str) -> tuple[str, str]:
    if not after.startswith(before):
        raise ValueError(f"template is not append-only at {what}")
    seg = after[len(before):]
    i = seg.find(_SENTINEL)
    if i < 0:
        raise ValueError(f"template drops the content of {what}")
    return seg[:i], seg[i + len(_SENTINEL):]


def _segments(render: Any, histories: dict[str, list[dict]]) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for role, hist in histories.items():
        before = render(hist) if hist else ""
        after = render(hist + [{"role": role, "content": _SENTINEL}])
        out[role] = _cut(before, after, f"a {role} message")
    return out


def chat_template_from_jinja(source: str, name: str = "model", bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """Derive role segments from a tokenizer's jinja chat template.

    BOS is rendered as "" because the tokenizer adds it (if at all) when encoding.
    Raises ValueError when the template is not expressible as per-role segments.
    """
    render = _renderer(source, {"bos_token": bos_token, "eos_token": eos_token})
    sys_msg = {"role": "system", "content": "S"}
    user_msg = {"role": "user", "content": "U"}
    # Each role is cut after a history that makes it legal for templates that check
    # alternation (system, user, assistant, user, ...). Templates with no system role
    # (Gemma raises on one, Mistral folds it into the first user turn) get user and
    # assistant only; a program's sgl.system() then fails with a clear error.
    try:
        segments = _segments(render, {"system": [], "user": [sys_msg], "assistant": [sys_msg, user_msg]})
        chat = [sys_msg, user_msg]
    except Exception:  # noqa: BLE001 - the template's own raise_exception, or a system it does not append
        segments = _segments(render, {"user": [], "assistant": [user_msg]})
        chat = [user_msg]

    # Default system prompt: what appears ahead of a lone user message.
    lone_user = render([{"role": "user", "content": _SENTINEL}])
    head = lone_user[: lone_user.find(_SENTINEL)]
    user_prefix = segments["user"][0]
    default_system = None
    if "system" in segments and head.endswith(user_prefix):
        head = head[: len(head) - len(user_prefix)]
        sp, ss = segments["system"]
        if head and head.startswith(sp) and head.endswith(ss) and len(head) >= len(sp) + len(ss):
            default_system = head[len(sp): len(head) - len(ss)]

    # The generation prompt must be the assistant prefix, or programs would write a different turn opener.
    gen_tail = render(chat, add_generation_prompt=True)[len(render(chat)):]
    if gen_tail and gen_tail != segments["assistant"][0]:
        raise ValueError("generation prompt differs from the assistant message prefix")

    stop = segments["assistant"][1].rstrip()
    stop_str = (stop,) if stop else ((eos_token,) if eos_token else ())
    return ChatTemplate(name=name, role_prefix_and_suffix=segments, default_system_prompt=default_system,
                        stop_str=stop_str)


def chat_template_or_default(source: str | None, name: str = "model", eos_token: str = "") -> ChatTemplate:
    """The derived template, or the plain default when there is none or it cannot be cut."""
    if not source:
        return DEFAULT_TEMPLATE
    try:
        return chat_template_from_jinja(source, name=name, eos_token=eos_token)
    except Exception:  # noqa: BLE001 - an exotic template must not make the backend unusable
        import warnings

        warnings.warn(f"could not derive role segments from the chat template of {name!r}; using ChatML")
        return CHATML_TEMPLATE


def read_template_source(model_path: str | None) -> tuple[str | None, str]:
    """(jinja chat template, eos token) read from a local model without loading it.

    For clients whose server does not report its template: a GGUF file keeps it in its
    metadata, a Hugging Face folder in tokenizer_config.json. Returns (None, "") when
    the path is not local or has no template.
    """
    import json
    import os

    if not model_path or not os.path.exists(model_path):
        return None, ""
    try:
        if model_path.endswith(".gguf"):
            from gguf import GGUFReader

            fields = GGUFReader(model_path).fields

            def text(key: str) -> str | None:
                f = fields.get(key)
                return bytes(f.parts[f.data[0]]).decode() if f is not None else None

            eos = ""
            eos_id = fields.get("tokenizer.ggml.eos_token_id")
            tokens = fields.get("tokenizer.ggml.tokens")
            if eos_id is not None and tokens is not None:
                idx = int(eos_id.parts[eos_id.data[0]][0])
                eos = bytes(tokens.parts[tokens.data[idx]]).decode()
            return text("tokenizer.chat_template"), eos
        cfg_path = os.path.join(model_path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
            eos = cfg.get("eos_token") or ""
            eos = eos.get("content", "") if isinstance(eos, dict) else eos
            tmpl = cfg.get("chat_template")
            return (tmpl if isinstance(tmpl, str) else None), eos
    except Exception:  # noqa: BLE001 - a best-effort fallback
        return None, ""
    return None, ""
