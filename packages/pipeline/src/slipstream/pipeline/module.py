"""PipelineModule: a model given as a list of layers, built and run stage by stage.

Each rank builds only the layers of the stages it owns (``LayerSpec`` defers construction, so
a model too big for one device never exists whole anywhere). Layers shared between stages
(tied input embedding and output head) are declared with ``TiedLayerSpec``: every owning
stage builds one copy, the copies start from the lowest stage's values and their gradients are
summed across the owners before each optimizer step, so they stay identical.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm.topology import PipeDataParallelTopology, ProcessGrid, ProcessTopology
from slipstream.pipeline.checkpointing import checkpoint
from slipstream.pipeline.partition import balanced_partition, uniform_partition

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]

logger = logging.getLogger(__name__)

_PARTITION_METHODS = "'uniform', 'parameters', 'type:<regex>' or 'profile'"


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 16, 16)`` builds ``nn.Linear(16, 16)``.

    >>> spec = LayerSpec(torch.nn.Linear, 4, 2, bias=False)
    >>> spec.build().weight.shape
    torch.Size([2, 4])
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec needs an nn.Module subclass, got {typename!r}; pass the class "
                "and its constructor arguments, not an instance"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the layer."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared with every other spec of the same ``key``.

    ``forward_fn(module, x)`` replaces ``module(x)`` where the sharing layer is used
    differently (the output head reusing the embedding matrix); ``tied_weight_attr`` names the
    shared parameter(s) (a name or a list of names).

    >>> embed = TiedLayerSpec("embed", torch.nn.Embedding, 10, 4)
    >>> head = TiedLayerSpec("embed", torch.nn.Embedding, 10, 4,
    ...                      forward_fn=lambda emb, h: h @ emb.weight.t())
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


class _TiedCall(nn.Module):
    """Calls the shared module of a tie through the spec's ``forward_fn``; owns no parameters."""

    def __init__(self, owner: PipelineModule, key: str, forward_fn: Callable | None) -> None:
        super().__init__()
        self._owner = [owner]  # a list keeps the owner out of this module's children
        self.key = key
        self.forward_fn = forward_fn

    def forward(self, x: Any) -> Any:
        module = self._owner[0].tied_modules[self.key]
        return self.forward_fn(module, x) if self.forward_fn is not None else module(x)


def _layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return (
        type(layer).__name__
        if not callable(layer) or isinstance(layer, nn.Module)
        else getattr(layer, "__name__", type(layer).__name__)
    )


class PipelineModule(nn.Module):
    """A sequential model split into pipeline stages; this rank holds its stages' layers.

    Args:
        layers: the model in order: :class:`LayerSpec`, :class:`TiedLayerSpec`, ``nn.Module``
            instances or plain callables (``lambda x: x.transpose(0, 1)``). The output of one
            is the input of the next; a tuple is passed on as one value.
        num_stages: the pipeline depth; needed unless ``topology`` is given.
        topology: a :class:`slipstream.comm.topology.ProcessTopology` with a ``pipe`` axis
            (default: pipe × data with data = world size / num_stages).
        loss_fn: ``loss_fn(outputs, labels) -> scalar`` applied on the last stage; when None
            the last layer's output is the loss.
        seed_layers: seed torch's generator with ``base_seed + layer index`` before building
            each layer, so initial weights do not depend on the partitioning.
        base_seed: the seed offset used by ``seed_layers``.
        partition_method: ``"uniform"`` (equal layer counts), ``"parameters"`` (balance
            trainable parameter counts), ``"type:<regex>"`` (balance the layers whose class
            name matches the regex, case-insensitively) or ``"profile"`` (time each layer's
            forward and backward on ``profile_inputs``, then balance the times).
        activation_checkpoint_interval: checkpoint every run of this many layers (0: never).
        checkpointable_layers: class names that may be checkpointed (default: any run that
            holds a layer with parameters).
        virtual_stages: model chunks per rank for the interleaved schedule: the model is cut
            into ``num_stages × virtual_stages`` parts and rank ``r`` holds parts
            ``r, r + num_stages, ...``.
        profile_inputs: a sample micro-batch input for ``partition_method="profile"``.

    >>> model = PipelineModule(
    ...     [LayerSpec(torch.nn.Linear, 8, 8), torch.nn.ReLU(), LayerSpec(torch.nn.Linear, 8, 2)],
    ...     num_stages=1, loss_fn=torch.nn.functional.cross_entropy)
    >>> model(torch.randn(4, 8)).shape
    torch.Size([4, 2])
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
        virtual_stages: int = 1,
        profile_inputs: Any = None,
    ) -> None:
        super().__init__()
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise ValueError("PipelineModule needs at least one layer")
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval={activation_checkpoint_interval} must be >= 0"
            )
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = (
            list(checkpointable_layers) if checkpointable_layers is not None else None
        )
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages} must be >= 1")
        self.virtual_stages = virtual_stages

        self._topology, self._grid = self._resolve_topology(num_stages, topology)
        self.num_stages = self._topology.get_dim("pipe")
        self.stage_id = self._grid.stage_id if self._grid is not None else 0
        num_parts = self.num_stages * virtual_stages
        if len(self._layer_specs) < num_parts:
            raise ValueError(
                f"{len(self._layer_specs)} layers cannot fill {self.num_stages} stages × "
                f"{virtual_stages} virtual stages = {num_parts} parts; use fewer stages"
            )
        self.parts = self._partition(num_parts, profile_inputs)

        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        # chunk -> [(global layer index, callable)]
        self._chunks: list[list[tuple[int, Callable[..., Any]]]] = []
        for chunk in range(virtual_stages):
            part = chunk * self.num_stages + self.stage_id
            self._chunks.append(self._build_part(part))
        self._tie_groups: dict[str, tuple[list[int], dist.ProcessGroup | None]] = {}
        self._setup_tied_groups()
        # The copies of tied weights are made equal by synchronize_tied_weights(), which
        # build_executor calls once the module is on its device (NCCL cannot send host
        # tensors, and modules are usually built on the host and moved afterwards).
        self.tied_weights_synchronized = not any(g for _, g in self._tie_groups.values())

    # ------------------------------------------------------------------ construction
    def _resolve_topology(
        self, num_stages: int | None, topology: ProcessTopology | None
    ) -> tuple[ProcessTopology, ProcessGrid | None]:
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        if topology is None:
            if num_stages is None:
                raise ValueError("PipelineModule needs num_stages=<pipeline depth> or topology=")
            if not initialised and num_stages > 1:
                raise RuntimeError(
                    f"num_stages={num_stages} needs {num_stages} processes but torch.distributed "
                    "is not initialised; call slipstream.comm.init_distributed() first (under "
                    "torchrun or `slipstream run`)"
                )
            if num_stages < 1 or world % num_stages:
                raise ValueError(
                    f"num_stages={num_stages} must be >= 1 and divide the world size {world}"
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        elif num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(
                f"num_stages={num_stages} disagrees with the topology's pipe axis "
                f"({topology.get_dim('pipe')}); give one or the other"
            )
        if "pipe" not in topology.axes:
            raise ValueError(f"{topology} has no 'pipe' axis")
        if not initialised:
            if topology.world_size() != 1:
                raise RuntimeError(
                    f"{topology} needs {topology.world_size()} processes but torch.distributed "
                    "is not initialised; call slipstream.comm.init_distributed() first "
                    "(under torchrun or `slipstream run`)"
                )
            return topology, None
        return topology, ProcessGrid(topology)

    def _weights(self, num_parts: int, profile_inputs: Any) -> list[float] | None:
        method = self.partition_method
        lowered = method.lower()
        if lowered == "uniform":
            return None
        if lowered == "parameters":
            return [float(self._count_parameters(layer)) for layer in self._layer_specs]
        if lowered.startswith("type:"):
            pattern = re.compile(method[len("type:") :], re.IGNORECASE)
            weights = [
                1.0 if pattern.search(_layer_name(layer)) else 0.0 for layer in self._layer_specs
            ]
            if sum(weights) < num_parts:
                raise ValueError(
                    f"partition_method={method!r} matches {int(sum(weights))} layers, fewer "
                    f"than the {num_parts} parts to fill; match more layer class names"
                )
            return weights
        if lowered == "profile":
            return self._profile_layers(profile_inputs)
        raise ValueError(f"partition_method={method!r} is not one of {_PARTITION_METHODS}")

    def _partition(self, num_parts: int, profile_inputs: Any) -> list[int]:
        weights = self._weights(num_parts, profile_inputs)
        if weights is None or sum(weights) == 0:
            return uniform_partition(len(self._layer_specs), num_parts)
        return balanced_partition(weights, num_parts)

    @staticmethod
    def _count_parameters(layer: Any) -> int:
        if isinstance(layer, LayerSpec):
            # Built on the meta device: counts shapes without allocating any memory.
            with torch.device("meta"):
                layer = layer.build()
        if isinstance(layer, nn.Module):
            return sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return 0

    def _profile_layers(self, profile_inputs: Any) -> list[float]:
        if profile_inputs is None:
            raise ValueError(
                "partition_method='profile' needs profile_inputs=<a sample micro-batch input "
                "for the first layer>; each layer's forward and backward is timed on it"
            )
        device = profile_inputs.device if isinstance(profile_inputs, torch.Tensor) else None
        times: list[float] = []
        x = profile_inputs
        for index, spec in enumerate(self._layer_specs):
            layer = spec.build() if isinstance(spec, LayerSpec) else spec
            if isinstance(layer, nn.Module) and device is not None:
                layer = layer.to(device)
            elapsed = []
            out = x
            for _ in range(3):
                inp = _detached(x)
                if device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                out = layer(inp)
                grads = [t for t in _flatten(out) if t.requires_grad]
                if grads:
                    torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
                if device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed.append(time.perf_counter() - start)
            times.append(min(elapsed))
            x = _detached(out, requires_grad=False)
            logger.debug("profiled layer %d: %.6f s", index, times[-1])
        measured = torch.tensor(times, dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            # Every rank must cut the model at the same places: average the measurements.
            dist.all_reduce(measured)
            measured /= dist.get_world_size()
        return [max(t, 1e-9) for t in measured.tolist()]

    def _build_part(self, part: int) -> list[tuple[int, Callable[..., Any]]]:
        built: list[tuple[int, Callable[..., Any]]] = []
        for index in range(self.parts[part], self.parts[part + 1]):
            spec = self._layer_specs[index]
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self._seed(index)
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                built.append((index, _TiedCall(self, spec.key, spec.forward_fn)))
            elif isinstance(spec, LayerSpec):
                self._seed(index)
                module = spec.build()
                self.add_module(str(index), module)
                built.append((index, module))
            elif isinstance(spec, nn.Module):
                self.add_module(str(index), spec)
                built.append((index, spec))
            elif callable(spec):
                built.append((index, spec))
            else:
                raise TypeError(
                    f"layer {index} is a {type(spec).__name__}; layers must be LayerSpec, "
                    "nn.Module or callable"
                )
        return built

    def _seed(self, index: int) -> None:
        if not self.seed_layers:
            return
        if self.seed_fn is not None:
            self.seed_fn(self.base_seed + index)
        else:
            torch.manual_seed(self.base_seed + index)

    def _stage_of_layer(self, index: int) -> int:
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= index < self.parts[part + 1]:
                return part % self.num_stages
        raise IndexError(index)

    def _setup_tied_groups(self) -> None:
        keys: dict[str, set[int]] = {}
        for index, spec in enumerate(self._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                keys.setdefault(spec.key, set()).add(self._stage_of_layer(index))
        for key, stages in keys.items():
            ordered = sorted(stages)
            if len(ordered) < 2 or self._grid is None:
                if key in self.tied_modules:
                    self._tie_groups[key] = ([dist.get_rank()] if self._grid else [0], None)
                continue
            # Collective: every rank creates every tie group, in the same order.
            for pipe_ranks in self._topology.get_axis_comm_lists("pipe"):
                ranks = [pipe_ranks[s] for s in ordered]
                group = dist.new_group(ranks)
                if self._grid.global_rank in ranks:
                    self._tie_groups[key] = (ranks, group)

    @torch.no_grad()
    def synchronize_tied_weights(self) -> None:
        """Copy each tied weight from the lowest stage sharing it to the others (collective
        over the tie groups; call it on every rank once the module is on its device)."""
        for key, (ranks, group) in self._tie_groups.items():
            if group is None:
                continue
            for tensor in self._tied_tensors(key):
                dist.broadcast(tensor, src=ranks[0], group=group)
        self.tied_weights_synchronized = True

    def _tied_tensors(self, key: str) -> list[torch.Tensor]:
        module = self.tied_modules[key]
        tensors: list[torch.Tensor] = []
        for name in self.tied_weight_attrs[key]:
            tensor: Any = module
            for part in name.split("."):
                tensor = getattr(tensor, part)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"tied_weight_attr {name!r} of tied key {key!r} is a "
                    f"{type(tensor).__name__}, not a tensor"
                )
            tensors.append(tensor)
        return tensors

    # ------------------------------------------------------------------ tied weights
    def allreduce_tied_weight_gradients(
        self, grad_of: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """Sum the gradients of each tied weight across the stages sharing it (collective).

        ``grad_of(weight)`` names the tensor to sum in place (default: ``weight.grad``, made
        zeros when missing); ZeRO passes the weight's gradient shard, which covers the same
        range on every stage of the tie group (same shape, same data-parallel coordinate).
        """
        for key, (_, group) in self._tie_groups.items():
            if group is None:
                continue
            for tensor in self._tied_tensors(key):
                if grad_of is not None:
                    dist.all_reduce(grad_of(tensor), group=group)
                    continue
                if tensor.grad is None:
                    tensor.grad = torch.zeros_like(tensor)
                dist.all_reduce(tensor.grad, group=group)

    def owns_tied_key(self, key: str) -> bool:
        """Whether this rank is the lowest stage holding tied module ``key`` (the copy that a
        checkpoint stores; the other stages' copies are equal)."""
        ranks, group = self._tie_groups.get(key, ([], None))
        return group is None or dist.get_rank() == ranks[0]

    def layer_stages(self) -> list[int]:
        """The stage holding each layer, by layer index (the layer -> stage map)."""
        return [self._stage_of_layer(index) for index in range(len(self._layer_specs))]

    def tied_weight_owner(self, param: torch.Tensor) -> bool:
        """False when ``param`` is a tied weight whose lowest owning stage is another rank.

        Used to count each tied weight once in a global gradient norm.
        """
        for key, (ranks, group) in self._tie_groups.items():
            if group is None:
                continue
            if any(param is t for t in self._tied_tensors(key)):
                return bool(dist.get_rank() == ranks[0])
        return True

    # ------------------------------------------------------------------ running
    def topology(self) -> ProcessTopology:
        """The process topology this module was partitioned for."""
        return self._topology

    def mpu(self) -> ProcessGrid | None:
        """The process grid (None in a single process without torch.distributed)."""
        return self._grid

    @property
    def num_chunks(self) -> int:
        """Model chunks on this rank (``virtual_stages``)."""
        return len(self._chunks)

    def stage_layers(self, chunk: int = 0) -> list[int]:
        """Global indices of the layers this rank runs in ``chunk``."""
        return [index for index, _ in self._chunks[chunk]]

    def is_first_part(self, chunk: int) -> bool:
        """Whether ``chunk`` on this rank is the model's first part (it reads the inputs)."""
        return chunk == 0 and self.stage_id == 0

    def is_last_part(self, chunk: int) -> bool:
        """Whether ``chunk`` on this rank is the model's last part (it computes the loss)."""
        return chunk == self.virtual_stages - 1 and self.stage_id == self.num_stages - 1

    def _checkpointable(self, funcs: Sequence[Callable[..., Any]]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        """Run this rank's layers of ``chunk`` on ``inputs`` (with activation checkpointing)."""
        funcs = [fn for _, fn in self._chunks[chunk]]
        interval = self.activation_checkpoint_interval
        x = inputs
        if interval == 0 or not torch.is_grad_enabled():
            for fn in funcs:
                x = fn(x)
            return x
        for start in range(0, len(funcs), interval):
            group = funcs[start : start + interval]

            def run(value: Any, group: Sequence[Callable[..., Any]] = group) -> Any:
                for fn in group:
                    value = fn(value)
                return value

            if self._checkpointable(group):
                x = self.activation_checkpoint_func(run, x)
            else:
                x = run(x)
        return x

    def describe_partition(self) -> str:
        """One line per stage part: its layer indices and class names."""
        lines = []
        for part in range(len(self.parts) - 1):
            lo, hi = self.parts[part], self.parts[part + 1]
            names = ", ".join(_layer_name(self._layer_specs[i]) for i in range(lo, hi))
            lines.append(
                f"part {part} (stage {part % self.num_stages}, chunk {part // self.num_stages}): "
                f"layers {lo}..{hi - 1}: {names}"
            )
        return "\n".join(lines)


def _flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _flatten(item)]
    return []


def _detached(value: Any, requires_grad: bool = True) -> Any:
    if isinstance(value, torch.Tensor):
        out = value.detach()
        if requires_grad and out.is_floating_point():
            out.requires_grad_(True)
        return out
    if isinstance(value, tuple):
        return tuple(_detached(v, requires_grad) for v in value)
    if isinstance(value, list):
        return [_detached(v, requires_grad) for v in value]
    return value
