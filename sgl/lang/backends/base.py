"""The DSL backend protocol, and the parts every backend shares (select, prefix warm-up).

A backend needs one primitive, `generate`, with the same shape as SGLang's offline
`Engine.generate`: prompt text (or a list, or token ids) plus a dict of SGLang sampling
parameters in, `{"text", "output_ids", "meta_info"}` out. `generate_stream` yields
the same dicts with cumulative text. Everything else the interpreter needs is built on
that here, so the in-process engine, the HTTP endpoint and a launched runtime behave
identically:

- `cache_prefix(text)`: a prefill-only call (max_new_tokens=0) that leaves the text's
  KV in the radix cache, used before forks and batches.
- `select(prefix, choices, ...)`: scores every choice in ONE batched prefill-only call
  with prompt logprobs, then applies the choice method. Token boundary: the prefix is
  P tokens; we ask logprobs from position P-1 and drop that first entry when it is
  still the prefix's own last token, so a choice that merges with the prefix's last
  token (e.g. "A:" + " B") is scored on the token(s) that actually carry it.

           prefix tokens                      choice tokens
    | t0 | t1 | ... | t[P-1] | t[P] | ... | t[n-1] |
                       ^ logprob_start_len = P-1
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator

from sgl.lang.chat_template import ChatTemplate
from sgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, normalized_logprob


class BackendError(RuntimeError):
    """The backend refused or aborted a request (bad parameters, server error, abort)."""


def check_result(res: dict) -> dict:
    """Raise BackendError when a result dict reports an abort."""
    fr = (res.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(fr, dict) and fr.get("type") == "abort":
        raise BackendError(f"request aborted: {fr.get('message') or fr}")
    return res


class Backend(ABC):
    """What the interpreter calls. Subclasses implement `generate` and `get_chat_template`."""

    is_chat_model: bool = False  # True: only whole chat turns can be generated (OpenAI chat)
    # True where the server takes sgl's `token_healing` sampling parameter (the DSL then
    # heals every gen's prompt boundary); SGLang's servers would refuse the unknown key.
    supports_token_healing: bool = False

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate: ...

    @abstractmethod
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict]:
        """SGLang offline-engine semantics; one dict per prompt (a list for list input or n>1)."""

    def generate_stream(self, prompt: str, sampling_params: dict, **logprob_opts: Any) -> Iterator[dict]:
        """Cumulative result dicts; the last has a finish_reason. Default: one final dict."""
        yield self.generate(prompt, sampling_params, **logprob_opts)  # type: ignore[misc]

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass

    # ---- shared on top of generate -------------------------------------------------

    def cache_prefix(self, text: str) -> int:
        """Prefill `text` into the prefix cache; returns its number of prompt tokens."""
        res = check_result(self.generate(text, {"max_new_tokens": 0}))  # type: ignore[arg-type]
        return int(res["meta_info"]["prompt_tokens"])

    def select(self, prefix: str, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score each choice as written and, after a prefix that does not end in
        whitespace, also with the space the model may want first (" Paris" after "A:");
        each choice competes with its better spelling, the variable is the choice itself
        and `ChoicesDecision.text` the spelling appended to the prompt."""
        spellings = [choice_spellings(prefix, c) for c in choices]
        flat = [s for group in spellings for s in group]
        scored = self._score(prefix, flat, choices_method.requires_unconditional_logprobs)
        picked: list[int] = []
        k = 0
        for group in spellings:
            best = max(range(len(group)), key=lambda j: (scored[0][k + j], -j))
            picked.append(k + best)
            k += len(group)
        normalized, input_lps, output_lps, uncond = (
            [x[i] for i in picked] if x is not None else None for x in scored)
        decision = choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                                  input_token_logprobs=input_lps, output_token_logprobs=output_lps,
                                  unconditional_token_logprobs=uncond)
        decision.text = flat[picked[choices.index(decision.decision)]]
        return decision

    def _score(self, prefix: str, choices: list[str], want_unconditional: bool) -> tuple[Any, Any, Any, Any]:
        """(normalized logprobs, input logprobs, output logprobs, unconditional logprobs or
        None) of each of `choices` after `prefix` (see the module doc for the boundary)."""
        num_prefix = self.cache_prefix(prefix) if prefix else 0
        start = max(num_prefix - 1, 0)
        results = self.generate(
            [prefix + c for c in choices], [{"max_new_tokens": 0, "temperature": 0.0}] * len(choices),
            return_logprob=True, logprob_start_len=start, return_text_in_logprobs=True)
        assert isinstance(results, list)
        input_lps: list[list] = []
        output_lps: list[list] = []
        for res in results:
            meta = check_result(res)["meta_info"]
            entries = [list(e) for e in meta["input_token_logprobs"]]
            # Drop the overlap entry when it is the prefix's unchanged last token.
            if num_prefix > 0 and len(entries) > 1 and prefix.endswith(entries[0][2] or "\x00"):
                entries = entries[1:]
            input_lps.append(entries)
            output_lps.append(list(meta.get("output_token_logprobs") or []))
        normalized = [normalized_logprob(e) for e in input_lps]

        unconditional = None
        if want_unconditional:
            ids = [[int(e[1]) for e in entries] for entries in input_lps]
            uncond = self.generate(None, [{"max_new_tokens": 0, "temperature": 0.0}] * len(ids), input_ids=ids,
                                   return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True)
            assert isinstance(uncond, list)
            unconditional = [[list(e) for e in check_result(r)["meta_info"]["input_token_logprobs"]]
                             for r in uncond]
        return normalized, input_lps, output_lps, unconditional


def choice_spellings(prefix: str, choice: str) -> list[str]:
    """How a choice may be appended after `prefix`: as written, and with one leading space
    where the prefix ends in neither whitespace nor nothing and the choice starts with
    neither (the boundary where a byte-level model's word tokens carry the space)."""
    if prefix and not prefix[-1].isspace() and choice and not choice[0].isspace():
        return [choice, " " + choice]
    return [choice]
