"""``init_inference`` and the engine it returns: the config's choices applied in order."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.inference.adapters import from_hf
from slipstream.inference.config import InferenceConfig, load_inference_config
from slipstream.inference.generation import GenerationSettings, StopStrings, generate_tokens
from slipstream.inference.model import FusedDecoder
from slipstream.inference.runner import StaticCacheRunner

__all__ = ["CausalLMOutput", "InferenceEngine", "init_inference"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CausalLMOutput:
    """What the engine's ``forward`` returns: ``.logits``, also reachable as ``output[0]``."""

    logits: torch.Tensor

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.logits,)[index]


def _default_device(model: nn.Module) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device  # meta: filled by a checkpoint


def _install_gemv_table(path: str) -> None:
    """Read ``decode_gemv_table``'s file and make its launches the decode GEMVs' first choice."""
    from slipstream.kernels.ops.decode_gemv.table import (
        LaunchTableError,
        load_launch_table,
        use_launch_table,
    )

    try:
        entries = load_launch_table(path)
    except LaunchTableError as error:
        raise ValueError(
            f"decode_gemv_table = {path!r}: {error}. Write the file with "
            "tools/bench/bf16_gemv_bench.py --table-out, or leave the key unset (the built-in "
            "table and the default launches)"
        ) from error
    use_launch_table(entries)
    logger.info("decode_gemv_table: %d launch(es) from %s", len(entries), path)


def _install_quant_table(path: str) -> None:
    """Read ``quant.weight.decode_gemv_table``'s file and make its launches the fused quantized
    decode GEMVs' first choice."""
    from slipstream.kernels.ops.quant_matmul.fused_table import (
        FusedTableError,
        load_fused_table,
        use_fused_table,
    )

    try:
        entries = load_fused_table(path)
    except FusedTableError as error:
        raise ValueError(
            f"quant.weight.decode_gemv_table = {path!r}: {error}. Write the file with "
            "tools/bench/quant_decode_bench.py --table-out, or leave the key unset (the "
            "built-in table and the rule)"
        ) from error
    use_fused_table(entries)
    logger.info("quant.weight.decode_gemv_table: %d launch(es) from %s", len(entries), path)


def _cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters only (the rotary inverse frequencies stay fp32)."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _tp_group(config: InferenceConfig) -> dist.ProcessGroup | None:
    tp = config.tensor_parallel
    if tp.tp_group is not None:
        return tp.tp_group  # type: ignore[no-any-return]
    if tp.mpu is not None:
        return tp.mpu.get_model_parallel_group()  # type: ignore[no-any-return]
    if not dist.is_initialized() or dist.get_world_size() != config.tp_size:
        world = dist.get_world_size() if dist.is_initialized() else 1
        raise ValueError(
            f"tensor_parallel.tp_size = {config.tp_size} needs a process group of that size: "
            f"the default group has {world} rank(s). Launch {config.tp_size} processes with "
            "`slipstream run` (or torchrun) or pass tensor_parallel.tp_group"
        )
    return None  # the default group


class InferenceEngine(nn.Module):
    """The model ``init_inference`` returns: ``forward`` gives logits, ``generate`` tokens.

    With ``replace_with_kernel_inject`` the Hugging Face model is rebuilt as a
    :class:`FusedDecoder` (its weights shared or fused, then cast, quantized, sharded over the
    tensor-parallel ranks and placed: resident on the device, or streamed from pinned host
    memory under ZeRO-Inference). Without it, the Hugging Face model itself runs, cast and moved.
    """

    def __init__(self, model: nn.Module, config: InferenceConfig) -> None:
        super().__init__()
        self.config = config
        self.module = model
        self.device = _default_device(model)
        self.fused: FusedDecoder | None = None
        self._runner: StaticCacheRunner | None = None
        dtype = config.torch_dtype
        if not config.replace_with_kernel_inject:
            self._check_unfused()
            model.to(device=self.device, dtype=dtype)
            return
        if config.checkpoint_path:
            from slipstream.inference.compressed import load_checkpoint

            # Hugging Face safetensors, or slipstream-compression's packed export (which sets
            # the config's weight bits and group size to the export's).
            load_checkpoint(model, config)
        fused = from_hf(model)
        # The order matters: cast before quantizing (scales come from the cast weights), shard
        # before quantizing (each rank's groups lie inside its own slice) and before placing (each
        # rank moves only its slice to the device).
        _cast_parameters(fused, dtype)
        if config.tp_size > 1:
            from slipstream.inference.tensor_parallel import shard_decoder

            shard_decoder(fused, _tp_group(config))
        if config.weight_bits is not None:
            from slipstream.inference.quantize import quantize_decoder, weight_bytes_per_parameter

            weight = config.quant.weight
            quantize_decoder(
                fused,
                config.weight_bits,
                weight.group_size,
                format=weight.code_format,
                gemv_layout=weight.packed_gemv,
                lm_head=weight.lm_head,
                scale_dtype=weight.scale_torch_dtype,
                head_format=weight.head_format,
            )
            # memory per parameter, the head counted at its own width (quant.weight.lm_head_bits)
            logger.info(
                "quant.weight: %s blocks, LM head %s; %.3f bytes per weight parameter (the "
                "blocks %.3f, the head %.3f)",
                weight.code_format,
                weight.head_format or "dense",
                weight_bytes_per_parameter(fused),
                weight_bytes_per_parameter(fused.blocks),
                weight_bytes_per_parameter(fused.head),
            )
            # the fused quantized decode step's launches (fused_quant_decode reads it)
            fused.quant_pdl = weight.pdl_mode
            if weight.decode_gemv_table is not None:
                _install_quant_table(weight.decode_gemv_table)
        if config.use_triton:
            from slipstream.inference.gemv import use_triton_gemv

            use_triton_gemv(fused)
        offload = config.zero.offload_param
        if offload.device in ("cpu", "nvme"):
            from slipstream.inference.zero_inference import offload_decoder

            offload_decoder(
                fused,
                self.device,
                pin_memory=offload.pin_memory,
                nvme_path=offload.nvme_path if offload.device == "nvme" else None,
                max_in_cpu=offload.max_in_cpu,
            )
        else:
            fused.to(self.device)
        if config.tp_size > 1:
            from slipstream.inference.allreduce import install_reducer

            tp = config.tensor_parallel
            install_reducer(
                fused,
                _tp_group(config),
                tp.allreduce,
                tp.symm_mem_bytes,
                self.device,
                tp.symm_mem_kernel,
            )
        self.fused = fused
        self._runner = StaticCacheRunner(
            fused, config.max_out_tokens, cuda_graph=config.enable_cuda_graph
        )
        if config.decode_gemv_table is not None:
            _install_gemv_table(config.decode_gemv_table)
        from slipstream.inference.fused_decode import enable_decode_fusion

        enable_decode_fusion(fused, config.decode_fusion, self.device, config.decode_pdl)
        if config.injection_policy is not None:
            logger.info(
                "injection_policy is not needed for %s: its fused adapter knows the layout",
                fused.spec.family,
            )

    def _check_unfused(self) -> None:
        config = self.config
        asked = {
            "tensor_parallel.tp_size": config.tp_size > 1,
            "dtype (int8 weights)": config.weight_bits is not None,
            "zero.offload_param": config.zero.offload_param.device != "none",
            "enable_cuda_graph": config.enable_cuda_graph,
            "checkpoint": config.checkpoint_path is not None,
        }
        missing = [name for name, on in asked.items() if on]
        if missing:
            raise NotImplementedError(
                f"{', '.join(missing)} with replace_with_kernel_inject=False (the unfused Hugging "
                "Face model) is not implemented yet; set replace_with_kernel_inject=True for a "
                "supported architecture"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """Logits for every position of ``input_ids`` (no cache kept); HF's forward if unfused.

        Without ``position_ids``, positions count real tokens (``cumsum(attention_mask) - 1``),
        as ``generate`` does; Hugging Face's GPT-2 forward counts pads too (``arange``).
        """
        if self.fused is None:
            return self.module(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **kwargs,
            )
        if kwargs:
            raise TypeError(
                f"InferenceEngine.forward: unexpected arguments {sorted(kwargs)}; the fused model "
                "takes input_ids and attention_mask"
            )
        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        mask = mask.to(device=self.device, dtype=torch.long)
        if position_ids is None:
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        else:
            positions = position_ids.to(self.device).expand_as(input_ids)
        slots = torch.arange(input_ids.shape[1], device=self.device)
        with torch.no_grad():
            logits = self.fused(input_ids, positions, mask.bool(), slots)
        return CausalLMOutput(logits)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Hugging Face ``generate`` semantics: prompts followed by new tokens ``(batch, len)``.

        Greedy search, or sampling (``do_sample=True``) with temperature, top-k and top-p;
        repetition penalty; ``eos_token_id`` (one or a list) ends a row, which is then padded
        with ``pad_token_id``; ``stop_strings`` (with ``tokenizer=``) end a row whose text ends
        with one; ``max_new_tokens`` / ``min_new_tokens``. Prompts of a batch are
        left-padded, ``attention_mask`` marking the real tokens. Defaults come from the model's
        ``generation_config``, as in Hugging Face.

        >>> engine.generate(ids, attention_mask=mask, max_new_tokens=32)  # doctest: +SKIP
        """
        if self.fused is None:
            return self.module.generate(  # type: ignore[no-any-return,operator]
                input_ids=input_ids, attention_mask=attention_mask, **kwargs
            )
        assert self._runner is not None
        generation_config = kwargs.get("generation_config") or getattr(
            self.module, "generation_config", None
        )
        stop_strings = kwargs.pop("stop_strings", None)
        if stop_strings is None:
            stop_strings = getattr(generation_config, "stop_strings", None)
        tokenizer = kwargs.pop("tokenizer", None)
        stop = None if stop_strings is None else StopStrings(stop_strings, tokenizer)
        settings = GenerationSettings.resolve(generation_config, input_ids.shape[1], kwargs)
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            # As HF: a pad token that is not also EOS marks padding; otherwise every token counts.
            pad = settings.pad_token_id
            if pad is not None and pad not in settings.eos_token_id:
                attention_mask = input_ids.ne(pad).long()
            else:
                attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device)
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError(
                "generate: a prompt ends with padding (attention_mask[:, -1] == 0); decoder-only "
                "batches must be left-padded (tokenizer.padding_side = 'left')"
            )
        return generate_tokens(
            self._runner.prefill,
            # generate reads each step's logits before the next step: no copy out of the graph
            functools.partial(self._runner.decode, copy=False),
            input_ids,
            attention_mask,
            settings,
            generator,
            stop,
        )


def init_inference(
    model: nn.Module,
    config: str | os.PathLike[str] | Mapping[str, Any] | InferenceConfig | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """DeepSpeed's ``init_inference``: wrap a Hugging Face causal LM for fast generation.

    ``config`` is DeepSpeed's inference config (a dict, a JSON file or an
    :class:`InferenceConfig`); keywords add to it. Unknown keys and bad values raise
    :class:`slipstream.kernels.config_schema.ConfigError` naming the key.

    >>> engine = init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True,
    ...                         tensor_parallel={"tp_size": 2})  # doctest: +SKIP
    >>> out = engine.generate(input_ids, max_new_tokens=64)  # doctest: +SKIP
    """
    parsed = load_inference_config(config, **kwargs)
    return InferenceEngine(model, parsed)
