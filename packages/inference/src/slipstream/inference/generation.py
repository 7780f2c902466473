"""Hugging Face ``generate`` semantics: settings, logits processors and the token loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from slipstream.kernels.ops import argmax

__all__ = [
    "GenerationSettings",
    "StopStrings",
    "generate_tokens",
    "process_logits",
    "select_tokens",
]

# `generate` keywords Hugging Face accepts that change the search, which this engine refuses.
_REFUSED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "assistant_model": None,
    "prompt_lookup_num_tokens": None,
    "num_return_sequences": 1,
    "streamer": None,
    "logits_processor": None,
    "stopping_criteria": None,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
}
_IGNORED = {"use_cache"}


@dataclasses.dataclass
class GenerationSettings:
    """The decoding choices of one ``generate`` call, with Hugging Face's defaults and meaning."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_id: list[int] = dataclasses.field(default_factory=list)
    pad_token_id: int | None = None

    @classmethod
    def resolve(
        cls, generation_config: Any, prompt_length: int, kwargs: dict[str, Any]
    ) -> GenerationSettings:
        """Defaults from the model's ``generation_config``, overridden by ``generate`` kwargs."""
        settings = cls()
        names = {f.name for f in dataclasses.fields(cls)}
        if generation_config is not None:
            for name in names:
                value = getattr(generation_config, name, None)
                if value is not None:
                    setattr(settings, name, value)
            max_length = getattr(generation_config, "max_length", None)
            if getattr(generation_config, "max_new_tokens", None) is None and max_length:
                settings.max_new_tokens = max(max_length - prompt_length, 0)
        for key, value in kwargs.items():
            if key in _IGNORED:
                continue
            if key in _REFUSED:
                if value != _REFUSED[key]:
                    raise NotImplementedError(
                        f"generate({key}={value!r}) is not implemented yet by the Slipstream "
                        "inference engine: it runs greedy search and sampling (top-k, top-p, "
                        "temperature, repetition penalty); use the Hugging Face model for this"
                    )
                continue
            if key == "max_length":
                settings.max_new_tokens = max(int(value) - prompt_length, 0)
            elif key == "generation_config":
                continue  # applied by the caller before this merge
            elif key in names:
                setattr(settings, key, value)
            else:
                raise TypeError(
                    f"generate() got an unexpected keyword argument {key!r}; accepted: "
                    f"{', '.join(sorted(names | {'max_length', 'attention_mask'}))}"
                )
        if isinstance(settings.eos_token_id, int):
            settings.eos_token_id = [settings.eos_token_id]
        settings.eos_token_id = list(settings.eos_token_id or [])
        if settings.pad_token_id is None and settings.eos_token_id:
            settings.pad_token_id = settings.eos_token_id[0]
        if settings.do_sample and settings.temperature <= 0:
            raise ValueError(
                f"generate: temperature must be > 0 when sampling, got {settings.temperature}"
            )
        if not 0 < settings.top_p <= 1:
            raise ValueError(f"generate: top_p must be in (0, 1], got {settings.top_p}")
        if settings.repetition_penalty <= 0:
            raise ValueError(
                f"generate: repetition_penalty must be > 0, got {settings.repetition_penalty}"
            )
        return settings


def process_logits(
    logits: torch.Tensor, sequences: torch.Tensor, generated: int, settings: GenerationSettings
) -> torch.Tensor:
    """Apply Hugging Face's processors in its order to ``logits`` ``(batch, vocab)``, in fp32
    as Hugging Face computes them.

    Repetition penalty (over every token of ``sequences``, prompt and padding included, as HF
    does), the minimum-length EOS ban, then, when sampling, temperature, top-k and top-p.
    Greedy search with none of them returns ``logits`` as given, in their dtype: no fp32 copy
    of the vocabulary, since the argmax of the logits is the argmax of their fp32 copy.
    """
    ban = generated < settings.min_new_tokens and bool(settings.eos_token_id)
    if not (settings.do_sample or settings.repetition_penalty != 1.0 or ban):
        return logits
    scores = logits.float()
    if settings.repetition_penalty != 1.0:
        picked = scores.gather(1, sequences)
        picked = torch.where(
            picked < 0,
            picked * settings.repetition_penalty,
            picked / settings.repetition_penalty,
        )
        scores = scores.scatter(1, sequences, picked)
    if ban:
        scores = scores.clone()
        scores[:, settings.eos_token_id] = -float("inf")
    if not settings.do_sample:
        return scores
    if settings.temperature != 1.0:
        scores = scores / settings.temperature
    if settings.top_k > 0:
        k = min(settings.top_k, scores.shape[-1])
        threshold = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < threshold, -float("inf"))
    if settings.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - settings.top_p)
        remove[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    return scores


def select_tokens(
    scores: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token per row: argmax, or a draw from ``softmax(scores)`` when sampling.

    The argmax is ``slipstream.kernels.ops.argmax``: one launch on a GPU (a single-row
    ``torch.argmax`` over a 128K vocabulary was one 27 us reduction on an H200, and the
    two-pass torch form that replaced it five kernels), ``torch.argmax`` on the CPU; the same
    index either way (first on ties)."""
    if settings.do_sample:
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return argmax(scores)


class StopStrings:
    """``generate(stop_strings=..., tokenizer=...)``: a row is done once its text ends with one.

    The text is the tokenizer's decoding of the row's last tokens (enough of them to hold the
    longest stop string), so a stop string may span several tokens, and it must end where the
    sequence ends, as Hugging Face's ``StopStringCriteria`` matches. Each check decodes on the
    host: one device sync per generated token while stop strings are set.
    """

    def __init__(self, stop_strings: str | list[str], tokenizer: Any) -> None:
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not strings or not all(isinstance(text, str) and text for text in strings):
            raise ValueError(
                f"generate: stop_strings must be a non-empty string or list of them, got "
                f"{stop_strings!r}"
            )
        if tokenizer is None or not hasattr(tokenizer, "decode"):
            raise ValueError(
                "generate: stop_strings needs the tokenizer, as in Hugging Face: "
                "generate(..., stop_strings=[...], tokenizer=tokenizer)"
            )
        self.strings, self.tokenizer = strings, tokenizer
        # A token decodes to at least one character (special tokens aside), so the longest
        # stop string plus a margin of tokens covers every way it can end the text.
        self.window = max(len(text) for text in strings) + 4

    def __call__(self, sequences: torch.Tensor) -> torch.Tensor:
        """Bool ``(batch,)``: which rows now end with a stop string."""
        tails = sequences[:, -self.window :].tolist()
        done = [
            any(self.tokenizer.decode(tail).endswith(text) for text in self.strings)
            for tail in tails
        ]
        return torch.tensor(done, dtype=torch.bool, device=sequences.device)


def generate_tokens(
    prefill: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    decode: Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: GenerationSettings,
    generator: torch.Generator | None = None,
    stop: StopStrings | None = None,
) -> torch.Tensor:
    """The token loop of ``generate``: returns the prompts followed by the new tokens.

    Args:
        prefill: ``(input_ids, positions, attention_mask) -> last-token logits (batch, vocab)``.
        decode: ``(tokens (batch,), positions (batch,) or None, slot) -> logits (batch,
            vocab)``; positions None (every step after the first): the previous step's plus
            one, which the decode keeps itself (a CUDA-graph step advances them on the device).

    Positions follow Hugging Face's left-padding rule (``cumsum(mask) - 1``, pads at 1); rows
    that produced an EOS continue with ``pad_token_id`` until every row is done. A row that
    ``stop`` finds ending with a stop string is done too: padded from then on when EOS ids are
    set, else (as Hugging Face, whose padding comes with EOS) it keeps generating until every
    row is done.
    """
    mask = attention_mask.to(torch.long)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    sequences = input_ids
    if settings.max_new_tokens <= 0:
        return sequences
    eos = torch.tensor(settings.eos_token_id, device=input_ids.device, dtype=torch.long)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    logits = prefill(input_ids, positions, mask.bool())
    next_position: torch.Tensor | None = positions[:, -1] + 1
    slot = input_ids.shape[1]
    # Without a repetition penalty or stop strings nothing reads the sequences inside the loop:
    # the new tokens are joined once at the end instead of by a torch.cat every step.
    deferred = settings.repetition_penalty == 1.0 and stop is None
    new_tokens: list[torch.Tensor] = []
    for step in range(settings.max_new_tokens):
        scores = process_logits(logits, sequences, step, settings)
        tokens = select_tokens(scores, settings, generator)
        if eos.numel():
            tokens = torch.where(unfinished, tokens, settings.pad_token_id or 0)
            unfinished = unfinished & ~torch.isin(tokens, eos)
        if deferred:
            new_tokens.append(tokens)
        else:
            sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
        if stop is not None:
            unfinished = unfinished & ~stop(sequences)
        # One host sync per token: stopping early on EOS needs the flag on the host.
        checks = eos.numel() or stop is not None
        if step + 1 == settings.max_new_tokens or (checks and not bool(unfinished.any())):
            break
        logits = decode(tokens, next_position, slot)
        next_position = None  # the next step's: this one's plus one, kept by decode
        slot += 1
    if new_tokens:
        sequences = torch.cat([sequences, torch.stack(new_tokens, dim=-1)], dim=-1)
    return sequences
