"""The compression scheduler: switches each technique on at its step, steps bits and ratios."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from slipstream.compression.config import CompressionConfig, compression_config
from slipstream.compression.layers import CompressionState

__all__ = ["CompressionScheduler"]

logger = logging.getLogger(__name__)


class CompressionScheduler:
    """Advance compression with the optimizer steps (DeepSpeed's ``compression_scheduler``).

    ``step()`` counts one optimizer step; after ``k`` steps a technique whose
    ``schedule_offset`` is ``<= k`` is on, weights use ``start_bits - (k - offset) //
    quantization_period`` bits (never below ``target_bits``) and gradual sparse pruning keeps
    the share that its ``schedule_offset_end``/``schedule_offset_stride`` give. The state at
    construction is that of step 0, so an offset of 0 acts from the first forward.

    >>> # scheduler = CompressionScheduler(model, config); after each optimizer.step():
    >>> # scheduler.step()
    """

    def __init__(self, model: nn.Module, config: Any) -> None:
        self.model = model
        self.config: CompressionConfig = compression_config(config)
        self.training_steps = 0
        self.verbose = self.config.weight_quantization.shared_parameters.quantize_verbose
        self.apply()

    def modules(self) -> list[tuple[str, CompressionState]]:
        """The compression-aware modules of the model, by name."""
        return [
            (name, module)
            for name, module in self.model.named_modules()
            if isinstance(module, CompressionState)
        ]

    def step(self) -> None:
        """Count one optimizer step and update every module."""
        self.training_steps += 1
        self.apply()

    def apply(self) -> None:
        """Put every module in the state of the current step."""
        step = self.training_steps
        for name, module in self.modules():
            if module.weight_quant is not None:
                bits = module.weight_quant.bits_at(step)
                if bits != module.weight_bits and self.verbose:
                    logger.info("step %d: %s quantizes its weight to %s bits", step, name, bits)
                module.weight_bits = bits
                ratio = module.weight_quant.mixed_change_ratio
                if ratio is not None and bits is not None:
                    done = step - module.weight_quant.offset
                    module.mixed_ratio = min(1.0, done * ratio)
            if module.act_quant is not None:
                module.act_bits = module.act_quant.bits if step >= module.act_quant.offset else None
            for technique, settings in module.prune.items():
                module.set_prune_ratio(technique, settings.ratio_at(step))

    def state_dict(self) -> dict[str, Any]:
        """The step count and the pruning masks in use (checkpointed by the engine).

        Masks are part of the state: an ``l1`` mask was fixed from the weights of the step it
        switched on, and recomputing it from later weights would change the model.
        """
        masks = {
            name: {technique: mask.detach().cpu() for technique, mask in module.masks.items()}
            for name, module in self.modules()
            if module.masks
        }
        return {"training_steps": self.training_steps, "masks": masks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count, the masks, and the modules' state at that step."""
        self.training_steps = int(state["training_steps"])
        modules = dict(self.modules())
        for name, masks in state.get("masks", {}).items():
            module = modules[name]
            for technique, mask in masks.items():
                ratio = module.prune[technique].ratio_at(self.training_steps)
                if ratio is not None:
                    module.prune_ratio[technique] = ratio
                    module.masks[technique] = mask.to(module.weight.device)
        self.apply()
