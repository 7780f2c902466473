"""Compression-aware Linear, Embedding and Conv2d: fake quantization and pruning masks.

A matched module keeps its class's parameters (the same ``weight``/``bias`` objects, so an
optimizer built before or after ``init_compression`` updates them) and has its class switched
to the compression-aware subclass below, whose forward uses :meth:`CompressionState.weight`:
pruning masks first, then fake quantization with a straight-through estimator. The scheduler
(``slipstream.compression.scheduler``) switches each technique on at its step.

Masks are non-persistent buffers: ``state_dict`` keys stay those of the original model, so a
compressed model still loads into its uncompressed class. ``redundancy_clean`` turns the masks
into smaller shapes before export.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.compression.quantizers import fake_quantize, quantize_activation

__all__ = [
    "ActivationQuantSettings",
    "CompressionState",
    "Conv2dCompress",
    "EmbeddingCompress",
    "LinearCompress",
    "PruneSettings",
    "WeightQuantSettings",
    "make_compressible",
]

_STATIC_MOMENTUM = 0.95  # running range of static activation quantization, per step


@dataclasses.dataclass
class WeightQuantSettings:
    """A module's weight quantization: its group's params and the shared parameters."""

    start_bits: int
    target_bits: int
    period: int
    offset: int
    groups: int
    symmetric: bool = True
    stochastic: bool = False
    mixed_change_ratio: float | None = None  # fp16_mixed_quantize's step, None when off
    group_size: int | None = None  # row-aligned groups (quantize_group_size), else `groups`

    def groups_for(self, weight: torch.Tensor) -> int:
        """Groups of ``weight``: ``quantize_group_size`` along rows, else ``quantize_groups``."""
        if self.group_size is None:
            return self.groups
        row = weight.shape[1] if weight.dim() > 1 else weight.numel()
        if weight.dim() > 2:
            row = weight[0].numel()
        if row % self.group_size:
            raise ValueError(
                f"weight_quantization.shared_parameters.quantize_group_size = {self.group_size} "
                f"does not divide the {row} elements of a row of a weight of shape "
                f"{tuple(weight.shape)}; choose a divisor of every matched layer's input size"
            )
        return weight.numel() // self.group_size

    def bits_at(self, step: int) -> int | None:
        """Bits at ``step`` (None before ``offset``): one bit fewer every ``period`` steps."""
        if step < self.offset:
            return None
        return max(self.target_bits, self.start_bits - (step - self.offset) // self.period)


@dataclasses.dataclass
class ActivationQuantSettings:
    """A module's input quantization."""

    bits: int
    offset: int
    symmetric: bool
    static: bool


@dataclasses.dataclass
class PruneSettings:
    """A module's pruning by one technique (sparse, row, head or channel)."""

    dense_ratio: float
    method: str
    offset: int
    offset_end: int | None = None  # gradual (sparse pruning): the ratio falls until this step
    stride: int = 1
    num_heads: int | None = None
    related: list[str] = dataclasses.field(default_factory=list)  # pruned names' followers

    def ratio_at(self, step: int) -> float | None:
        """The kept share at ``step`` (None before ``offset``)."""
        if step < self.offset:
            return None
        if self.offset_end is None or self.offset_end == self.offset:
            return self.dense_ratio
        done = min(step, self.offset_end) - self.offset
        done -= done % self.stride
        fraction = done / (self.offset_end - self.offset)
        return 1.0 - (1.0 - self.dense_ratio) * fraction


def _topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """1 for the ``ceil(ratio * n)`` largest scores (at least one), 0 elsewhere."""
    flat = scores.reshape(-1)
    keep = max(1, round(ratio * flat.numel()))
    mask = torch.zeros_like(flat)
    mask[torch.topk(flat, keep, sorted=False).indices] = 1.0
    return mask.reshape(scores.shape)


class CompressionState:
    """What one module compresses and how far the schedule has gone; mixed into the layers."""

    weight: Any  # the layer's nn.Parameter (declared by nn.Linear / nn.Embedding / nn.Conv2d)
    weight_quant: WeightQuantSettings | None
    act_quant: ActivationQuantSettings | None
    prune: dict[str, PruneSettings]
    weight_bits: int | None  # the bits in use now (None: full precision)
    act_bits: int | None
    mixed_ratio: float
    prune_ratio: dict[str, float]  # the kept share in use now, per technique
    masks: dict[str, torch.Tensor]
    baked: bool

    def _init_compression(self) -> None:
        self.baked = False  # redundancy_clean put the weight on its grid: no fake quant left
        self.weight_quant = None
        self.act_quant = None
        self.prune = {}
        self.weight_bits = None
        self.act_bits = None
        self.mixed_ratio = 0.0
        self.prune_ratio = {}
        self.masks = {}
        self.static_range: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- masks -------------------------------------------------------------------------------
    def prune_scores(self, technique: str) -> torch.Tensor:
        """Importance of the units pruned by ``technique`` (l1 norms / magnitudes)."""
        w = self.weight.detach().float()
        if technique == "sparse_pruning":
            return w.abs()
        if technique in ("row_pruning", "channel_pruning"):
            return w.abs().reshape(w.shape[0], -1).sum(dim=1)
        if technique == "head_pruning":
            heads = self.prune[technique].num_heads
            assert heads is not None
            if w.shape[1] % heads:
                raise ValueError(
                    f"head_pruning.shared_parameters.num_heads = {heads} does not divide the "
                    f"{w.shape[1]} input features of {type(self).__name__}; set num_heads to "
                    "the layer's number of attention heads"
                )
            return w.abs().reshape(w.shape[0], heads, -1).sum(dim=(0, 2))
        raise KeyError(technique)

    def compute_mask(self, technique: str, ratio: float) -> torch.Tensor:
        """A fresh mask keeping ``ratio`` of the units ``technique`` prunes."""
        return _topk_mask(self.prune_scores(technique), ratio)

    def current_mask(self, technique: str) -> torch.Tensor | None:
        """The mask in use now (topk: recomputed from the current weights), None when off."""
        ratio = self.prune_ratio.get(technique)
        if ratio is None:
            return None
        settings = self.prune[technique]
        if settings.method == "topk" and self.training:  # type: ignore[attr-defined]
            self.masks[technique] = self.compute_mask(technique, ratio)
        elif technique not in self.masks:
            self.masks[technique] = self.compute_mask(technique, ratio)
        return self.masks[technique]

    def set_prune_ratio(self, technique: str, ratio: float | None) -> None:
        """Switch ``technique`` on at ``ratio`` (off with None); a new ratio makes a new mask."""
        if ratio is None:
            self.prune_ratio.pop(technique, None)
            self.masks.pop(technique, None)
            return
        if self.prune_ratio.get(technique) != ratio:
            self.prune_ratio[technique] = ratio
            self.masks[technique] = self.compute_mask(technique, ratio)

    def weight_masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(mask on the weight's shape, mask on the output features) from every technique on."""
        full: torch.Tensor | None = None
        rows: torch.Tensor | None = None
        w = self.weight
        sparse = self.current_mask("sparse_pruning")
        if sparse is not None:
            full = sparse.to(w.dtype)
        for technique in ("row_pruning", "channel_pruning"):
            mask = self.current_mask(technique)
            if mask is not None:
                rows = mask if rows is None else rows * mask
        if rows is not None:
            shaped = rows.to(w.dtype).reshape(-1, *([1] * (w.dim() - 1)))
            full = shaped if full is None else full * shaped
        heads = self.current_mask("head_pruning")
        if heads is not None:
            columns = heads.repeat_interleave(w.shape[1] // heads.numel()).to(w.dtype)
            full = columns[None, :] if full is None else full * columns[None, :]
        return full, rows

    # -- the weight the forward uses -----------------------------------------------------------
    def compressed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight after masks and fake quantization, mask of output rows or None)."""
        w: torch.Tensor = self.weight
        full, rows = self.weight_masks()
        if full is not None:
            w = w * full
        if self.weight_bits is not None and self.weight_quant is not None and not self.baked:
            settings = self.weight_quant
            q = fake_quantize(
                w,
                self.weight_bits,
                settings.groups_for(w),
                settings.symmetric,
                settings.stochastic,
            )
            if settings.mixed_change_ratio is not None and self.mixed_ratio < 1.0:
                q = self.mixed_ratio * q + (1.0 - self.mixed_ratio) * w
            w = q
        return w, rows

    def compressed_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input after the head mask and activation fake quantization (when on).

        Masking the pruned heads' input features (as well as the weight's columns) keeps them
        out of the token-wise activation range, so the cleaned model, which no longer has
        them, quantizes its input exactly as the masked one did.
        """
        if self.act_bits is None or self.act_quant is None:
            return x
        heads = self.current_mask("head_pruning")
        if heads is not None:
            x = x * heads.repeat_interleave(x.shape[-1] // heads.numel()).to(x.dtype)
        settings = self.act_quant
        if not settings.static:
            return quantize_activation(x, self.act_bits, settings.symmetric)
        data = x.detach().float()
        low, high = data.amin(), data.amax()
        if self.static_range is None:
            self.static_range = (low, high)
        elif self.training:  # type: ignore[attr-defined]
            old_low, old_high = self.static_range
            m = _STATIC_MOMENTUM
            self.static_range = (m * old_low + (1 - m) * low, m * old_high + (1 - m) * high)
        return quantize_activation(x, self.act_bits, settings.symmetric, self.static_range)

    def compression_repr(self) -> str:
        """The techniques on now, for ``extra_repr``."""
        parts = []
        if self.weight_bits is not None:
            parts.append(f"weight_bits={self.weight_bits}")
        if self.act_bits is not None:
            parts.append(f"act_bits={self.act_bits}")
        parts += [f"{name}={ratio:g}" for name, ratio in self.prune_ratio.items()]
        return ", ".join(parts)


class LinearCompress(nn.Linear, CompressionState):
    """``nn.Linear`` with weight/activation fake quantization and sparse/row/head masks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, rows = self.compressed_weight()
        bias: torch.Tensor | None = self.bias
        if bias is not None and rows is not None:
            bias = bias * rows.to(bias.dtype)
        return F.linear(self.compressed_input(x), weight, bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.compression_repr()}"


class EmbeddingCompress(nn.Embedding, CompressionState):
    """``nn.Embedding`` with weight fake quantization (pruning does not apply)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self.compressed_weight()
        return F.embedding(
            x,
            weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )


class Conv2dCompress(nn.Conv2d, CompressionState):
    """``nn.Conv2d`` with weight fake quantization and sparse/channel masks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, rows = self.compressed_weight()
        bias: torch.Tensor | None = self.bias
        if bias is not None and rows is not None:
            bias = bias * rows.to(bias.dtype)
        return self._conv_forward(self.compressed_input(x), weight, bias)


_SUBCLASS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: LinearCompress,
    nn.Embedding: EmbeddingCompress,
    nn.Conv2d: Conv2dCompress,
}


def make_compressible(module: nn.Module) -> CompressionState | None:
    """Switch ``module`` to its compression-aware class in place (None if it has none).

    Only exact ``nn.Linear``/``nn.Embedding``/``nn.Conv2d`` instances are switched (a subclass
    may have its own forward); already compression-aware modules are returned as they are.
    """
    if isinstance(module, CompressionState):
        return module
    target: Any = _SUBCLASS.get(type(module))
    if target is None:
        return None
    module.__class__ = target
    state: CompressionState = module  # type: ignore[assignment]
    state._init_compression()
    return state
