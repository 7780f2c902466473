"""MII-style Python API: ``pipeline(model)`` for in-process batches, ``serve(model)`` for a
persistent deployment."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream.inference.serving.config import ServingConfig
from slipstream.inference.serving.deployment import Deployment
from slipstream.inference.serving.engine import ServingEngine
from slipstream.inference.serving.request import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Response:
    """One prompt's result (MII's field names)."""

    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: str
    token_ids: list[int]


def load_model(
    model_or_path: str | nn.Module,
    tokenizer: Any = None,
    *,
    device: str | torch.device | None = None,
    dtype: str = "auto",
) -> tuple[nn.Module, Any, str]:
    """``(model, tokenizer, name)`` from a module or a Hugging Face id / local folder.

    A path loads with ``AutoModelForCausalLM`` (bf16 on a GPU unless ``dtype`` says otherwise)
    and ``AutoTokenizer``; a module is used as is, moved to ``device`` when one is given.
    """
    if isinstance(model_or_path, nn.Module):
        model = model_or_path
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
    else:
        import transformers

        name = str(model_or_path)
        target = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = _DTYPES.get(dtype) or (
            torch.bfloat16 if torch.device(target).type == "cuda" else torch.float32
        )
        logger.info("loading %s (%s) onto %s", name, torch_dtype, target)
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype)
        if tokenizer is None:
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer, name


def _config(
    config: ServingConfig | dict[str, Any] | None, overrides: dict[str, Any]
) -> ServingConfig:
    data = config.to_dict() if isinstance(config, ServingConfig) else dict(config or {})
    data.update(overrides)
    return ServingConfig.from_dict(data, "serving")


class Pipeline:
    """Runs batches of prompts through a :class:`ServingEngine` in the calling thread.

    >>> pipe = pipeline(model, tokenizer=tokenizer)  # doctest: +SKIP
    >>> pipe(["Hello", "Bonjour"], max_new_tokens=32)[0].generated_text  # doctest: +SKIP
    """

    def __init__(self, engine: ServingEngine, name: str) -> None:
        self.engine = engine
        self.name = name

    def __call__(
        self, prompts: str | list[str], max_new_tokens: int = 128, **sampling: Any
    ) -> list[Response]:
        """Generate for every prompt (served together); sampling keys as :class:`SamplingParams`."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = SamplingParams(max_tokens=max_new_tokens, **sampling)
        return [
            Response(
                out.text,
                out.num_prompt_tokens,
                out.num_output_tokens,
                out.finish_reason or "",
                out.new_token_ids,
            )
            for out in self.engine.generate(prompts, params)
        ]

    def stream(self, prompt: str, max_new_tokens: int = 128, **sampling: Any) -> Iterator[str]:
        """Yield the text of ``prompt``'s completion piece by piece as tokens are generated."""
        params = SamplingParams(max_tokens=max_new_tokens, **sampling)
        request_id = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        if out.text:
                            yield out.text
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)  # a consumer that stops early frees the KV blocks

    def close(self) -> None:
        """Release the tensor-parallel worker ranks (a no-op on one rank)."""
        self.engine.close()

    def serve(self) -> Deployment:
        """A persistent :class:`Deployment` over this pipeline's engine (do not call the
        pipeline itself while it runs)."""
        return Deployment(self.engine, self.name)


def pipeline(
    model_or_path: str | nn.Module,
    *,
    tokenizer: Any = None,
    config: ServingConfig | dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    tensor_parallel: int = 1,
    **config_overrides: Any,
) -> Pipeline:
    """Build a serving :class:`Pipeline` for a Hugging Face causal LM (any family ``init_inference`` fuses) or checkpoint path.

    ``config`` is the ``serving`` block (:class:`ServingConfig` or its dict);
    ``config_overrides`` set single keys of it (``num_blocks=512``, ``dtype="bfloat16"``).

    With ``tensor_parallel=N``, call it on each of N ranks (launched by ``slipstream run``,
    the process group initialised): rank 0 returns the pipeline to use, the other ranks serve
    its steps and return only once rank 0 calls :meth:`Pipeline.close` (or its deployment
    shuts down); their pipeline then refuses requests.
    """
    serving = _config(config, {**config_overrides, "tensor_parallel": tensor_parallel})
    model, tokenizer, name = load_model(
        model_or_path, tokenizer, device=device, dtype=serving.dtype
    )
    engine = ServingEngine(model, tokenizer, serving)
    if not engine.is_driver:
        # Tensor parallelism: this rank runs rank 0's steps until rank 0's pipeline closes.
        steps = engine.run_worker()
        logger.info("tensor-parallel worker rank %d: ran %d steps", engine.rank, steps)
    return Pipeline(engine, name)


def serve(
    model_or_path: str | nn.Module,
    *,
    tokenizer: Any = None,
    config: ServingConfig | dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    tensor_parallel: int = 1,
    **config_overrides: Any,
) -> Deployment | None:
    """A persistent :class:`Deployment` (engine on a background thread) for ``model_or_path``.

    Under tensor parallelism (call it on every rank) ranks > 0 serve rank 0's steps and return
    None once rank 0's deployment has shut down.
    """
    pipe = pipeline(
        model_or_path,
        tokenizer=tokenizer,
        config=config,
        device=device,
        tensor_parallel=tensor_parallel,
        **config_overrides,
    )
    return pipe.serve() if pipe.engine.is_driver else None
