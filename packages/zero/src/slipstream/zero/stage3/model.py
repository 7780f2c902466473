"""shard_parameters: ZeRO stage 3 over a plain module (hooks that gather, release and reduce)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from slipstream.zero.grad_reduce import GradientReduceScatter
from slipstream.zero.gradient_path import GradientPathMixin, MultiGroupPath
from slipstream.zero.group import DataParallelGroup
from slipstream.zero.host_memory import HostArena
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.settings import ZeroSettings, stage3_reduce_bucket_numel
from slipstream.zero.stage3.sharded_param import (
    ShardedParameter,
    ensure_shards,
    gather_full,
    prefetch_shards,
    release_shards,
    sharded_state_of,
)
from slipstream.zero.stage3.state import ShardState, TrainingState
from slipstream.zero.stage3.trace import ExecutionTrace
from slipstream.zero.stage3.unit import ParamUnit

__all__ = ["Stage3Model", "register_external_parameter", "shard_parameters"]

logger = logging.getLogger(__name__)

_UNIT_ATTR = "_slipstream_zero_unit"
_EXTERNAL_ATTR = "_slipstream_external_params"


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``parameter``, which another module owns.

    Stage 3 gathers a module's own parameters around its forward; a parameter it reads
    from elsewhere (``F.linear(h, self.embed.weight)`` in a parent) must be declared so it is
    gathered too. May be called before or after :func:`shard_parameters` (e.g. inside the
    model's ``__init__`` under :class:`slipstream.zero.Init`).
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(
            f"register_external_parameter takes an nn.Parameter, got {type(parameter).__name__}"
        )
    external = module.__dict__.setdefault(_EXTERNAL_ATTR, [])
    if all(p is not parameter for p in external):
        external.append(parameter)
    unit: ParamUnit | None = module.__dict__.get(_UNIT_ATTR)
    sharded = sharded_state_of(parameter)
    if unit is not None and sharded is not None:
        unit.add_member(sharded)


class Stage3Model:
    """The stage-3 state of a module: its sharded parameters, units, hooks and trace.

    Built by :func:`shard_parameters`. Forward: a module's pre-forward hook gathers its unit
    (prefetching the next ones along the recorded trace), its post-forward hook releases it
    and hooks the outputs so that the first gradient reaching them re-gathers the unit for
    backward. Backward: each trainable parameter's gradient goes into a reduce-scatter
    bucket as soon as autograd has accumulated it (and the full gradient is dropped); when
    all gradients a unit owns are in, the unit is released. :meth:`finish_backward` flushes
    the buckets and releases what is left (units without trainable parameters, unused ones).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        settings: ZeroSettings,
        group: DataParallelGroup,
        names: list[str],
        sharded: list[ShardedParameter],
        units: list[ParamUnit],
        compute_device: torch.device | None = None,
        store: Any = None,
    ) -> None:
        self.module = module
        # offload_param to NVMe: the ParamSwapStore holding the shards (None otherwise).
        self.store = store
        offload_param = settings.offload_param
        self.read_ahead_numel = (
            offload_param.buffer_count * offload_param.buffer_size
            if store is not None and offload_param is not None
            else 0
        )
        self.compute_device = compute_device or torch.device("cpu")
        self.settings = settings
        self.group = group
        self.names = names
        self.sharded = sharded
        self.units = units
        self.trace = ExecutionTrace(
            settings.prefetch_numel, settings.max_live_numel, settings.max_reuse_numel
        )
        self.path: Any = None  # Stage3GradientPath or MultiGroupPath, once attached
        self._persistent = [s for s in sharded if s.persistent]
        self._live = [sum(s.full_numel for s in sharded if s.state is ShardState.UNSHARDED)]
        for member in sharded:
            member.live = self._live
        self._handles: list[Any] = []
        self._in_forward = 0
        for unit in units:
            self._install_hooks(unit)
        self._handles.append(module.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self._handles.append(module.register_forward_hook(self._root_post_forward))

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self, unit: ParamUnit) -> None:
        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            unit.state = TrainingState.FORWARD
            for upcoming in self.trace.on_forward(unit, self._live_numel):
                upcoming.prefetch()
            self._read_ahead(unit, backward=False)
            unit.unshard()

        def post_forward(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self.trace.reused_soon(unit):
                unit.keep_for_next_call()
            else:
                unit.reshard()
            unit.state = TrainingState.IDLE
            if torch.is_grad_enabled():
                self._hook_outputs(unit, output)
            return output

        self._handles.append(unit.module.register_forward_pre_hook(pre_forward))
        self._handles.append(unit.module.register_forward_hook(post_forward))

    def _hook_outputs(self, unit: ParamUnit, output: Any) -> None:
        def on_output_grad(grad: torch.Tensor) -> None:
            if unit.pre_backward():
                for upcoming in self.trace.on_backward(unit, self._live_numel):
                    upcoming.prefetch()
                self._read_ahead(unit, backward=True)

        tensors, _ = tree_flatten(output)
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(on_output_grad)

    def _live_numel(self) -> int:
        """Elements gathered now (each parameter once), kept up to date by the parameters'
        state changes (walking every parameter on every hook cost host time per module)."""
        return self._live[0]

    def _read_ahead(self, unit: ParamUnit, backward: bool) -> None:
        """NVMe parameters: start reading the shards of the units due next along the trace
        (beyond those being gathered now), up to ``buffer_count * buffer_size`` elements."""
        if self.store is None or self.read_ahead_numel <= 0:
            return
        budget = self.read_ahead_numel
        wanted: list[ShardedParameter] = []
        for upcoming in self.trace.ahead(unit, backward):
            for member in upcoming.members:
                if member.state is not ShardState.SHARDED or member.pending is not None:
                    continue  # gathered or being gathered: its shard is not needed now
                shard = member.shard
                if shard not in self.store or not self.store.is_swapped(shard):
                    continue  # resident already (or not swapped at all)
                if member.spec.shard_numel > budget:
                    budget = 0
                    break
                budget -= member.spec.shard_numel
                wanted.append(member)
            if budget <= 0:
                break
        prefetch_shards(wanted)

    @contextlib.contextmanager
    def shards_resident(self, dirty: bool) -> Iterator[None]:
        """NVMe parameters: every shard in host memory for the block (checkpoint save/load),
        swapped out after (``dirty``: written back first). A no-op without NVMe."""
        ensure_shards(self.sharded)
        try:
            yield
        finally:
            release_shards(self.sharded, dirty=dirty)
            if self.store is not None:
                self.store.finish()

    def close(self) -> None:
        """Remove the NVMe parameter swap files (also done at exit); the shards are unusable
        after this."""
        if self.store is not None:
            self.store.close()

    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._in_forward == 0:
            self.trace.begin_iteration()
            self._gather_persistent()
        self._in_forward += 1

    def _gather_persistent(self) -> None:
        """Start one all-gather of every persistent parameter released since the last forward
        (an optimizer step releases them all), instead of one small collective per module
        (the norms: two per block). The modules' gathers adopt it (``member.pending``)."""
        if len(self._persistent) > 1:
            gather_full(self._persistent, async_op=True)

    def _root_post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        self._in_forward -= 1
        if self._in_forward == 0:
            if self.trace.order:
                self.trace.finish_recording()  # one forward is the trace
            for unit in self.units:
                unit.drop_prefetch()  # prefetched for a call that did not come
            for member in self._persistent:
                if member.pending is not None:  # gathered for a module that did not run
                    member.pending.wait()
        return output

    # ------------------------------------------------------------------ optimizer
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Re-home ``optimizer`` onto the fp32 master shards; install the gradient path.

        Returns a :class:`Stage3GradientPath`; when some parameters are sharded over other
        groups than the model's (``shard_parameters(param_groups=...)``: expert parameters
        over their expert-data-parallel groups), a
        :class:`~slipstream.zero.gradient_path.MultiGroupPath` of one stage-3 path per group
        (the model's group first), stepped together with one norm over the model's group.
        """
        if self.path is not None:
            raise RuntimeError("an optimizer is already attached to this stage-3 model")
        by_group: dict[int, list[ShardedParameter]] = {id(self.group.group): []}
        groups: dict[int, DataParallelGroup] = {id(self.group.group): self.group}
        for sharded in self.sharded:
            key = id(sharded.group.group)
            by_group.setdefault(key, []).append(sharded)
            groups.setdefault(key, sharded.group)
        if len(by_group) == 1:
            self.path = Stage3GradientPath(self, optimizer)
            return self.path
        if self.settings.offload_optimizer is not None or self.store is not None:
            raise NotImplementedError(
                "ZeRO stage 3 with parameters sharded over several groups (expert-parallel "
                "MoE layers) does not support offload_optimizer or offload_param yet; remove "
                "the offload blocks or use ep_size=1"
            )
        parts = [
            Stage3GradientPath(
                self,
                optimizer,
                members=members,
                group=groups[key],
                # Expert gradients are summed over their expert-DP group but averaged over
                # every data-parallel rank's loss (DeepSpeed's rule).
                divisor=self.group.world_size,
                strict_optimizer=False,
            )
            for key, members in by_group.items()
            if members
        ]
        self.path = MultiGroupPath(parts, optimizer, self.group, self.compute_device)
        return self.path

    def release_all(self) -> None:
        """Free every gathered parameter that nobody holds (persistent ones included)."""
        for sharded in self.sharded:
            sharded.secondary = None  # hpZ: the values changed (see zeropp.py)
            if sharded.holders == 0 and sharded.state is ShardState.UNSHARDED:
                sharded.free()

    def named_sharded(self) -> list[tuple[str, ShardedParameter]]:
        """(name, ShardedParameter) for every parameter, tied ones once, in module order."""
        return list(zip(self.names, self.sharded))


class Stage3GradientPath(GradientPathMixin):
    """The optimizer side of stage 3: masters, the reduce-scatter buckets, publishing.

    [Note: ZeRO-3 memory] What one rank holds, for ``P`` parameters over ``N`` ranks in
    bf16 training with AdamW and no offload (docs/zero.md has the 7B numbers):

    persistent (the model states, as FSDP2 keeps them)
        the fp32 master shard, ``4P/N`` bytes: it *is* the all-gather's source, cast to
        bf16 inside the gather (``PendingGather``), so no bf16 shard is kept beside it;
        Adam's two moments, ``8P/N``; the fp32 gradient shards, ``4P/N``, from the first
        bucket landed in backward until ``zero_grad`` (views of the buckets' outputs, not
        copies: [Note: bucket lifetime]); persistent small parameters, gathered.
    transient, forward and backward
        the gathered bf16 parameters of the unit in use, of the prefetched ones (at most
        ``stage3_prefetch_bucket_size`` elements, and none beyond
        ``stage3_max_live_parameters`` gathered) and, in backward, of the unit whose
        gradients are not all in yet; a gather's send buffer (``shard`` in bf16) and, unless
        the unit is one unpadded parameter gathered in place, its ``[N, shard]`` receive
        buffer; each parameter's full bf16 ``.grad`` until its bucket has copied it; the
        reduce-scatter send buffers of at most two buckets (one in flight, one filling:
        ``N x bucket shard`` elements in the communication dtype, fp32 by default, i.e.
        ``4 * reduce_bucket_size`` bytes each).
    transient, step
        the fused AdamW kernel's (none); the norm's per-tensor squares, one tensor at a time.

    Before this accounting, stage 3 also kept a bf16 shard beside each fp32 master
    (``2P/N``), every bucket's send buffer and output until the end of backward (a full
    fp32 copy of all gradients, ``4P``, plus ``4P/N``), copied the outputs into fresh
    master grads (``4P/N`` more at once), and padded each gradient into a full-size fp32
    temporary: at 7B over 2 ranks that was 6.3 + 25.1 + 12.6 GiB on top of the model states,
    the out-of-memory of docs/benchmarks.md.
    """

    def __init__(
        self,
        model: Stage3Model,
        optimizer: torch.optim.Optimizer,
        *,
        members: list[ShardedParameter] | None = None,
        group: DataParallelGroup | None = None,
        divisor: int | None = None,
        strict_optimizer: bool = True,
    ) -> None:
        """``members`` / ``group`` / ``divisor`` / ``strict_optimizer``: one part of a
        multi-group path (:meth:`Stage3Model.attach_optimizer`): these parameters only,
        reduce-scattered over ``group`` and averaged over ``divisor`` ranks, sharing the
        optimizer with the other parts. Default: every parameter, the model's group."""
        self.model = model
        self.group = group or model.group
        chosen = members if members is not None else model.sharded
        trainable = [s for s in chosen if s.param.requires_grad]
        self.sharded = trainable
        self.params = [s.param for s in trainable]
        self.specs = [s.spec for s in trainable]
        settings = model.settings
        offload = settings.offload_optimizer
        # NVMe parameters: the shards stay the store's (swapped out between uses), so the
        # masters are always copies; the shards are read in just to build them.
        swapped = model.store is not None
        ensure_shards(trainable)
        offloaded = None
        if offload is not None:
            from slipstream.zero.offload import offloaded_flags

            offloaded = offloaded_flags([s.spec.shard_numel for s in trainable], offload.ratio)
        # Without optimizer offload the masters live on the compute device; on a CPU one that
        # is "with their shards" (None), not "moved to the host", which is offload's path.
        device = model.compute_device if model.compute_device.type != "cpu" else None
        self.masters = ShardedMasterWeights(
            self.params,
            self.specs,
            [s.shard for s in trainable],
            device=torch.device("cpu") if offload is not None else device,
            pin=offload is not None and offload.pin_memory,
            share=(offload is None or offload.device == "cpu") and not swapped,
            own_storage=offload is not None and offload.device == "nvme",
            offloaded=offloaded,
            kept_device=model.compute_device,
        )
        release_shards(trainable, dirty=False)
        for i, (sharded, master) in enumerate(zip(trainable, self.masters.masters)):
            sharded.master = master
            if swapped or master.device != sharded.shard.device:
                continue
            # The master *is* the shard the all-gather reads (cast to the parameter's dtype
            # inside it): no 16-bit copy beside the fp32 master ([Note: ZeRO-3 memory]).
            # Not for a master the CPU step updates in host memory while the shard is there
            # too (offload_param): the gathers upload the shard, in the compute dtype.
            host_step = offload is not None and self.masters.offloaded[i]
            if master.dtype == sharded.shard.dtype or not host_step:
                sharded.shard = master.data
        self.masters.swap_into(optimizer, strict=strict_optimizer)
        # Offload: the CPU step writes each updated master in the shard's dtype into the shard
        # itself when it lives on the host (offload_param). A shard on the device is refreshed
        # by _publish from its source: the fp32 master itself, uploaded and cast there, so the
        # memory-bound CPU step writes no model-dtype copy; with NVMe optimizer offload, which
        # swaps the masters out after the step, a host staging buffer the step writes.
        self._sources: list[torch.Tensor | None] = [None] * len(trainable)
        step = None
        if offload is not None:
            from slipstream.zero.offload import OffloadedStep

            copies: dict[int, torch.Tensor] = {}
            for i, (sharded, master) in enumerate(zip(trainable, self.masters.masters)):
                if sharded.shard.data_ptr() == master.data_ptr() or not self.masters.offloaded[i]:
                    continue  # the master is the shard, or stays on the device (partial)
                if sharded.shard.device.type == "cpu":
                    copies[id(master)] = sharded.shard
                elif offload.device == "nvme":
                    staging = self.masters.host_empty(master.shape, sharded.shard.dtype)
                    copies[id(master)] = staging
                    self._sources[i] = staging
                else:
                    self._sources[i] = master
            names = {id(m): n for m, n in zip(self.masters.masters, _names_of(model, trainable))}
            step = OffloadedStep(optimizer, self.masters, offload, self.group, copies, names)
            if swapped:
                # The step writes each updated value into its (NVMe-backed) shard: read a
                # sub-group's shards in before its update, write them back after.
                by_master = {id(m): s for s, m in zip(trainable, self.masters.masters)}

                def before(masters: list[torch.Tensor]) -> None:
                    ensure_shards([by_master[id(m)] for m in masters if id(m) in by_master])

                def after(masters: list[torch.Tensor]) -> None:
                    members = [by_master[id(m)] for m in masters if id(m) in by_master]
                    release_shards(members, dirty=True)

                step.sub_group_hooks = (before, after)
        # Sized from the whole model (every part of a multi-group path alike).
        bucket_numel = stage3_reduce_bucket_numel(
            settings, [s.spec.numel for s in model.sharded if s.param.requires_grad]
        )
        if bucket_numel < settings.reduce_bucket_numel and self.group.rank == 0:
            logger.info(
                "ZeRO stage 3: reduce-scatter buckets of %s elements (reduce_bucket_size %s "
                "capped at 1/%d of the model: zero_optimization.stage3_reduce_bucket_parts)",
                f"{bucket_numel:,}",
                f"{settings.reduce_bucket_numel:,}",
                settings.stage3_reduce_bucket_parts,
            )
        self.reducer = GradientReduceScatter(
            self.masters,
            self.group,
            bucket_numel,
            grad_of=lambda i: self.params[i].grad,
            release=self._release,
            overlap=settings.overlap_comm,
            communication_dtype=settings.communication_dtype,
            gradient_predivide_factor=settings.gradient_predivide_factor,
            prescale=settings.prescale_gradients,
            divisor=divisor,
            # Offload: a bf16 reduction lands on the host in bf16 and the C++ step reads it
            # there (when it is the step's only reduction; accumulated ones in fp32).
            land_low_precision=step is not None and step.reads_low_precision_grads,
        )
        owner: dict[int, ParamUnit] = {}
        mine = {id(s) for s in trainable}
        for unit in model.units:
            for member in unit.members:
                if id(member) in mine and id(member) not in owner:
                    owned = unit.module.parameters(recurse=unit.leaf)
                    if any(p is member.param for p in owned):
                        owner[id(member)] = unit
                        unit.owned_trainable.add(id(member))
        self._owner = [owner.get(id(s)) for s in trainable]
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i))  # type: ignore[misc]
            for i, p in enumerate(self.params)
        ]
        device = model.compute_device
        self.optimizer = ZeroOptimizer(
            optimizer, self.masters, self.group, self._publish, device, offload=step
        )

    def _release(self, index: int) -> None:
        self.params[index].grad = None

    def _on_grad(self, index: int) -> None:
        self.reducer.mark_ready(index)
        unit = self._owner[index]
        if unit is not None:
            unit.grad_ready()

    def prepare_backward(self, is_boundary: bool, loss_scale: float | None = None) -> None:
        """Stage 3 reduces every backward; only the last before a step may land in bf16 (the
        loss scale is for stages 1-2's speculative step: stage 3 steps after backward)."""
        self.reducer.boundary = is_boundary

    def finish_backward(self, is_boundary: bool = True) -> None:
        """Flush the gradient buckets and release every unit still held."""
        self.reducer.finish()
        for unit in self.model.units:
            unit.end_backward()

    def publish(self) -> None:
        """Refresh every parameter shard from its master (after a load: the masters were
        written, not stepped, so the host shards the CPU step writes are refreshed too)."""
        self._publish(after_step=False)

    def _publish(self, after_step: bool = True) -> None:
        with torch.no_grad():
            offloaded = self.optimizer.offload is not None
            flags = self.masters.offloaded
            for sharded, source, on_host in zip(self.sharded, self._sources, flags):
                master = sharded.master
                if offloaded and on_host and after_step:
                    # The CPU step wrote the host shard itself (source None), or the source
                    # this device shard takes: the fp32 master (cast there) or NVMe staging.
                    if source is not None:
                        source = source.detach()
                        if source.dtype != sharded.shard.dtype:  # the fp32 master: cast there
                            source = source.to(sharded.shard.device, non_blocking=True)
                        sharded.shard.copy_(source, non_blocking=True)
                    continue
                if offloaded and on_host and source is not None and source is not master:
                    # After a load: the NVMe staging copy holds the value from before it.
                    assert master is not None
                    source.copy_(master)
                if master is not None and master.data_ptr() != sharded.shard.data_ptr():
                    ensure_shards([sharded])  # NVMe parameters: read, update, write back
                    sharded.shard.copy_(master)
                    release_shards([sharded], dirty=True)
        if self.model.store is not None:
            self.model.store.finish()
        self.model.trace.finish_recording()
        # Persistent parameters hold the old values: drop them, the next use re-gathers.
        self.model.release_all()

    def zero_grad(self) -> None:
        """Drop master gradients and any full-size gradient left on the parameters."""
        self.masters.zero_grad()
        for param in self.params:
            param.grad = None


def _names_of(model: Stage3Model, members: list[ShardedParameter]) -> list[str]:
    name_of = {id(s): n for n, s in model.named_sharded()}
    return [name_of.get(id(s), f"param{i}") for i, s in enumerate(members)]


def shard_parameters(
    module: torch.nn.Module,
    settings: ZeroSettings,
    group: DataParallelGroup | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    param_groups: Mapping[int, DataParallelGroup] | None = None,
) -> Stage3Model:
    """ZeRO stage 3: shard every parameter of ``module`` in place and install the hooks.

    ``param_groups`` maps ``id(parameter)`` to the group that parameter is sharded over
    instead of ``group`` (expert parameters over their expert-data-parallel group: each
    such group's rank 0 supplies the values, its ranks hold the shards). The optimizer then
    gets one stage-3 path per group (:meth:`Stage3Model.attach_optimizer`).

    Each parameter is broadcast from rank 0, cut to this rank's flat padded shard (cast to
    ``dtype`` and placed on ``device`` if given) and its full storage freed, one parameter at
    a time. Parameters already partitioned by :class:`slipstream.zero.Init` are adopted.
    Buffers are moved (and floating ones cast) and broadcast from rank 0. Parameters of at
    most ``param_persistence_numel`` elements (up to ``model_persistence_numel`` in all) stay
    gathered once used, until the next optimizer step.

    >>> sharded = shard_parameters(model, ZeroSettings(stage=3))
    >>> zero = sharded.attach_optimizer(torch.optim.AdamW(model.parameters()))
    >>> loss = model(x).sum(); loss.backward(); zero.finish_backward(); zero.optimizer.step()
    """
    group = group or DataParallelGroup.of()
    names: list[str] = []
    sharded: list[ShardedParameter] = []
    seen: dict[int, ShardedParameter] = {}
    storages: dict[int, str] = {}
    store: Any = None
    arena: HostArena | None = None
    offload_param = settings.offload_param
    if offload_param is not None and offload_param.device == "cpu":
        # The pinned host shards, at their exact size (NVMe shards need storages of their own).
        # (zero.Init parameters keep their full shape, so numel() is the full size here too.)
        expected = (
            sum(
                p.numel() * (dtype.itemsize if dtype is not None else p.element_size())
                for p in module.parameters()
            )
            // group.world_size
        )
        arena = HostArena(offload_param.pin_memory, expected_bytes=expected)
    for name, param in module.named_parameters():
        existing = sharded_state_of(param)
        if existing is None:
            ptr = param.untyped_storage().data_ptr()
            if ptr and ptr in storages:
                raise ValueError(
                    f"parameters {storages[ptr]!r} and {name!r} share storage but are different "
                    "nn.Parameter objects; stage 3 frees each parameter's storage on its own. "
                    "Tie them by assigning the same Parameter (head.weight = embed.weight)."
                )
            storages[ptr] = name
            own_group = param_groups.get(id(param), group) if param_groups else group
            existing = ShardedParameter.partition(param, own_group, device, dtype)
        else:
            if param_groups and id(param) in param_groups:
                raise NotImplementedError(
                    f"parameter {name!r} was partitioned by zero.Init over the data-parallel "
                    "group, but it is an expert parameter that stage 3 shards over its "
                    "expert-data-parallel group; build expert-parallel MoE models outside "
                    "zero.Init"
                )
            _adopt(existing, group, device, dtype, name)
        if offload_param is not None:
            existing.offload_to_host(offload_param.pin_memory, arena)
            if offload_param.device == "nvme":
                if store is None:
                    store = _param_store(settings, group)
                _swap_out(existing, store, name, len(sharded))
        seen[id(param)] = existing
        names.append(name)
        sharded.append(existing)
    _mark_persistent(sharded, settings)
    _place_buffers(module, group, device, dtype)

    units: list[ParamUnit] = []
    inside: str | None = None  # the name of the leaf module being walked, if any
    leaf_unit: ParamUnit | None = None
    for name, sub in module.named_modules():
        if inside is not None and (inside == "" or name.startswith(inside + ".")):
            # Inside a leaf module: its unit gathers this module's parameters (and takes
            # the external ones registered on it later).
            sub.__dict__[_UNIT_ATTR] = leaf_unit
            continue
        leaf = _is_leaf(name, sub, settings)
        subtree = sub.modules() if leaf else (sub,)
        members: list[ShardedParameter] = []
        for each in subtree:
            members += [seen[id(p)] for p in each.parameters(recurse=False) if id(p) in seen]
            for external in each.__dict__.get(_EXTERNAL_ATTR, []):
                if id(external) in seen:
                    members.append(seen[id(external)])
        members = list({id(m): m for m in members}.values())  # tied inside a leaf: once
        inside, leaf_unit = (name, None) if leaf else (None, None)
        if not members:
            continue
        unit = ParamUnit(sub, name or "<root>", members, leaf=leaf)
        sub.__dict__[_UNIT_ATTR] = unit
        units.append(unit)
        leaf_unit = unit if leaf else None
    total = sum(s.spec.numel for s in sharded)
    if group.rank == 0:
        logger.info(
            "ZeRO stage 3: %s parameters in %d units, %d persistent; %s elements per rank",
            f"{total:,}",
            len(units),
            sum(s.persistent for s in sharded),
            f"{sum(s.spec.shard_numel for s in sharded):,}",
        )
    compute_device = device or next((s.param.device for s in sharded), torch.device("cpu"))
    if store is not None:
        store.finish()
        if group.rank == 0:
            logger.info("parameter offload to NVMe: %r", store)
    return Stage3Model(module, settings, group, names, sharded, units, compute_device, store)


def _is_leaf(name: str, module: torch.nn.Module, settings: ZeroSettings) -> bool:
    """Whether ``module`` is a ZeRO-3 leaf (``zero_optimization.leaf_module``): its whole
    subtree's parameters are one unit, gathered by one all-gather around its forward and
    backward, and its descendants get no hooks."""
    cls = type(module)
    return (
        cls.__name__ in settings.leaf_module_classes
        or f"{cls.__module__}.{cls.__qualname__}" in settings.leaf_module_classes
        or name in settings.leaf_module_names
        or any(name.endswith(suffix) for suffix in settings.leaf_module_name_suffixes)
    )


def _param_store(settings: ZeroSettings, group: DataParallelGroup) -> Any:
    """offload_param.device="nvme": a swap folder under ``nvme_path`` and its ParamSwapStore."""
    from slipstream.zero.offload import require_offload_package

    offload = settings.offload_param
    assert offload is not None and offload.nvme_path is not None  # ParamOffload checks
    package = require_offload_package("offload_param.device='nvme'")
    engine = package.AsyncIOEngine(offload.aio)
    space = package.SwapSpace(offload.nvme_path, engine, name="param", rank=group.rank)
    return package.ParamSwapStore(space, offload.max_in_cpu)


def _swap_out(sharded: ShardedParameter, store: Any, name: str, index: int) -> None:
    """Hand ``sharded``'s host shard to the NVMe store (its key: position and name)."""
    shard = sharded.shard
    if (
        not shard.is_contiguous()
        or shard.untyped_storage().nbytes() != shard.numel() * shard.element_size()
    ):
        sharded.shard = shard = shard.clone()  # the store frees whole storages
    safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in name)
    store.register(f"p{index}.{safe[:180]}", shard)
    sharded.store = store


def _adopt(
    sharded: ShardedParameter,
    group: DataParallelGroup,
    device: torch.device | None,
    dtype: torch.dtype | None,
    name: str,
) -> None:
    if sharded.group.world_size != group.world_size or sharded.group.rank != group.rank:
        raise ValueError(
            f"parameter {name!r} was partitioned by zero.Init over {sharded.group.world_size} "
            f"ranks but is being sharded over {group.world_size}; pass the same "
            "data_parallel_group to zero.Init and the engine"
        )
    # The engine's group may carry ZeRO++ collectives (qwZ, hpZ) over the same ranks.
    sharded.group = group
    param = sharded.param
    target_dtype = dtype if (dtype is not None and param.is_floating_point()) else param.dtype
    target_device = device or sharded.shard.device
    if sharded.shard.dtype != target_dtype or sharded.shard.device != target_device:
        sharded.shard = sharded.shard.to(device=target_device, dtype=target_dtype)
        with torch.no_grad():
            param.data = torch.empty(param.shape, dtype=target_dtype, device=target_device)
        sharded.free()


def _mark_persistent(sharded: list[ShardedParameter], settings: ZeroSettings) -> None:
    budget = settings.model_persistence_numel
    for item in sharded:
        numel = item.spec.numel
        if numel <= settings.param_persistence_numel and numel <= budget:
            item.persistent = True
            budget -= numel


def _place_buffers(
    module: torch.nn.Module,
    group: DataParallelGroup,
    device: torch.device | None,
    dtype: torch.dtype | None,
) -> None:
    with torch.no_grad():
        for sub in module.modules():
            for key, buffer in sub._buffers.items():
                if buffer is None:
                    continue
                target = dtype if (dtype is not None and buffer.is_floating_point()) else None
                moved = buffer.to(device=device or buffer.device, dtype=target or buffer.dtype)
                group.broadcast_(moved, src=0)
                sub._buffers[key] = moved
