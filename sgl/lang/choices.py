"""Ways to pick one of `select`'s choices from per-token logprobs.

A choice method receives, for every choice, the logprobs of that choice's tokens given
the prompt (`input_token_logprobs[i]` is a list of `(logprob, token_id, text)` entries)
plus their mean (`normalized_prompt_logprobs[i]`), and returns a `ChoicesDecision`. The
semantics match SGLang's three methods so that programs select the same answers:

- `token_length_normalized`: the highest mean token logprob wins.
- `greedy_token_selection`: compare choices token by token, keeping only the best at
  each position; a shorter choice is padded with its own mean logprob.
- `unconditional_likelihood_normalized`: the highest mean of
  (logprob given prompt - logprob without the prompt), which discounts choices that are
  merely likely in general. The first unconditional logprob (no context) counts as 0.
Ties go to the earliest choice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

LogprobEntry = Sequence[Any]  # (logprob | None, token_id, text | None)


@dataclass
class ChoicesDecision:
    decision: str  # the chosen choice: the select's variable
    meta_info: dict[str, Any] | None = None
    text: str | None = None  # what is appended to the prompt, where it differs (a leading space)


def _first_argmax(values: Sequence[float]) -> int:
    if not values:
        raise ValueError("cannot choose among zero choices")
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class ChoicesSamplingMethod(ABC):
    """Protocol of a choice method; subclasses are stateless singletons."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[LogprobEntry]],
        output_token_logprobs: list[list[LogprobEntry]],
        unconditional_token_logprobs: list[list[LogprobEntry]] | None = None,
    ) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return type(self).__name__


def _base_meta(normalized, input_lps, output_lps) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": input_lps,
        "output_token_logprobs": output_lps,
    }


class TokenLengthNormalized(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _first_argmax(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best], _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(lps) for lps in input_token_logprobs)
        matrix: list[list[float]] = []
        for lps in input_token_logprobs:
            row = [float(e[0]) for e in lps]
            # A shorter choice competes at later positions with its own average, so a
            # prefix of a longer choice is neither favoured nor punished for ending early.
            row += [_mean(row)] * (width - len(row))
            matrix.append(row)
        alive = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == top]
            if len(alive) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[alive[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the choices' unconditional logprobs")
        scores: list[float] = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError(
                    f"conditional ({len(cond)}) and unconditional ({len(uncond)}) logprobs differ in length"
                )
            c = [float(e[0]) for e in cond]
            u = [e[0] for e in uncond]
            u[0] = u[0] or 0.0  # the first token has no context, so no logprob
            scores.append(_mean([a - float(b) for a, b in zip(c, u)]))
        best = _first_argmax(scores)
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[best], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def normalized_logprob(entries: Sequence[LogprobEntry]) -> float:
    """Mean logprob of the entries that have one (the very first prompt token has none)."""
    vals = [float(e[0]) for e in entries if e[0] is not None]
    return _mean(vals) if vals else 0.0
