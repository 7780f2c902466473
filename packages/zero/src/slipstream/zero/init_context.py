"""zero.Init (partition parameters as modules are built) and GatheredParameters (gather to edit)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.stage3.model import register_external_parameter
from slipstream.zero.stage3.sharded_param import ShardedParameter, gather_full, sharded_state_of
from slipstream.zero.zeropp import full_precision_gathers

__all__ = ["GatheredParameters", "Init"]

logger = logging.getLogger(__name__)


def _all_module_classes() -> list[type[torch.nn.Module]]:
    found: list[type[torch.nn.Module]] = []
    stack: list[type[torch.nn.Module]] = [torch.nn.Module]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


def _dtype_from_config(config: Any) -> torch.dtype | None:
    if config is None:
        return None
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        raise TypeError(
            f"config_dict_or_path must be a dict or a path to a JSON config, got {type(config).__name__}"
        )
    if (config.get("fp16") or {}).get("enabled"):
        return torch.float16
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    return None


class Init:
    """Partition parameters as each module is constructed (DeepSpeed's ``zero.Init``).

    Inside the block, every ``nn.Module``'s ``__init__`` is wrapped: when it returns, the
    module's own parameters (not its children's, which were partitioned when *their*
    ``__init__`` returned) are broadcast from rank 0, cut to this rank's shard and their full
    storage freed. A rank therefore never holds more than its shards plus the parameters of
    the module being built, and the model never materialises whole. The engine (stage 3)
    adopts the shards as they are.

    Arguments follow DeepSpeed: ``module`` partitions an existing module at once instead;
    ``data_parallel_group`` (or ``mpu.get_data_parallel_group()``) is the sharding group;
    ``dtype`` (default: fp16/bf16 if ``config_dict_or_path`` enables it, else unchanged) is
    the dtype of the shards; ``enabled=False`` makes the block a no-op. ``remote_device``
    ``"cpu"``/``"nvme"`` (ZeRO-Infinity) is not implemented; ``pin_memory`` is accepted and
    has no effect without it. ``config`` is DeepSpeed's older alias of ``config_dict_or_path``;
    ``mem_efficient_linear`` is accepted and has no effect (no ``F.linear`` replacement is
    needed). Wrapped ``__init__`` methods keep their signatures (``torch.nn.utils.skip_init``
    inspects them); parameters built on the ``meta`` device are left whole, to be sharded when
    materialised and handed to the engine.

    A module that reads or re-initialises a child's parameters in its own ``__init__``
    after the child was built must do so inside :class:`GatheredParameters`, as with
    DeepSpeed (the child's parameters are already partitioned by then).

    >>> with slipstream.zero.Init():
    ...     model = GPT(config)          # each rank holds 1/N of every parameter
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
    ) -> None:
        if config is not None:
            if config_dict_or_path is not None:
                raise TypeError(
                    "zero.Init got both config= and config_dict_or_path=; pass the config once "
                    "(config_dict_or_path is the current name, config DeepSpeed's older alias)"
                )
            config_dict_or_path = config
        # DeepSpeed swaps F.linear for a variant that saves less for backward; stage 3 here
        # gathers weights per module and needs no replacement, so the flag changes nothing.
        self.mem_efficient_linear = mem_efficient_linear
        if remote_device not in (None, "none", "cuda", "cpu") or (
            remote_device == "cpu" and torch.cuda.is_available()
        ):
            raise NotImplementedError(
                f"zero.Init(remote_device={remote_device!r}): parameter offload to CPU or NVMe "
                "(ZeRO-Infinity) is not implemented in slipstream-zero yet; leave remote_device "
                "unset to keep the shards on the accelerator"
            )
        self.enabled = enabled
        if mpu is not None and data_parallel_group is None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = DataParallelGroup.of(data_parallel_group) if enabled else None
        self.dtype = dtype if dtype is not None else _dtype_from_config(config_dict_or_path)
        self._patched: list[tuple[type[torch.nn.Module], Any]] = []
        self._depth = 0
        self._saved_init_subclass: Any = None
        if module is not None and enabled:
            for param in module.parameters():
                self._partition(param)

    def _device(self) -> torch.device:
        from slipstream.kernels import get_accelerator

        return get_accelerator().device()

    def _partition(self, param: torch.nn.Parameter) -> None:
        if sharded_state_of(param) is not None or param.is_meta:
            # A meta parameter (torch.nn.utils.skip_init, device="meta") has no values to
            # shard; the engine's stage 3 shards it once it is materialised.
            return
        assert self.group is not None
        ShardedParameter.partition(param, self.group, self._device(), self.dtype)

    def _wrap(self, cls: type[torch.nn.Module]) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_slipstream_zero_wrapped", False):
            return
        context = self

        @functools.wraps(original)
        def __init__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            if type(module).__init__ is __init__ or _is_outermost(module, cls):
                for param in module.parameters(recurse=False):
                    context._partition(param)

        __init__._slipstream_zero_wrapped = True  # type: ignore[attr-defined]
        self._patched.append((cls, original))
        cls.__init__ = __init__  # type: ignore[method-assign,assignment]

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        for cls in _all_module_classes():
            self._wrap(cls)
        context = self
        self._saved_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        @classmethod  # type: ignore[misc]
        def init_subclass(cls: type[torch.nn.Module], **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            context._wrap(cls)  # classes defined inside the block

        torch.nn.Module.__init_subclass__ = init_subclass  # type: ignore[assignment]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original  # type: ignore[method-assign]
        self._patched.clear()
        if self._saved_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._saved_init_subclass  # type: ignore[assignment]


def _is_outermost(module: torch.nn.Module, cls: type[torch.nn.Module]) -> bool:
    """Whether ``cls.__init__`` is the most derived __init__ of ``module`` (not a super() call)."""
    for klass in type(module).__mro__:
        if "__init__" in klass.__dict__:
            return klass is cls
    return False


class GatheredParameters:
    """Gather partitioned parameters for reading or editing (DeepSpeed's ``GatheredParameters``).

    On entry every given parameter that stage 3 / ``zero.Init`` partitioned is gathered
    (others are left alone, so the same code runs at every stage). On exit, if
    ``modifier_rank`` is set, that rank's values are broadcast to all ranks and every rank
    re-cuts its shard (and fp32 master) from them; then the parameters are released. With
    ``modifier_rank=None`` edits are discarded. ``fwd_module`` registers the parameters as
    external parameters of that module; ``enabled=False`` makes the block a no-op.

    >>> with GatheredParameters(model.embed.weight, modifier_rank=0):
    ...     if rank == 0:
    ...         model.embed.weight[0].zero_()
    """

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.params: list[torch.Tensor] = (
            [params] if isinstance(params, torch.Tensor) else list(params)
        )
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._members: list[ShardedParameter] = []
        seen: set[int] = set()
        for param in self.params:
            sharded = sharded_state_of(param)
            if sharded is not None and id(sharded) not in seen:
                seen.add(id(sharded))
                self._members.append(sharded)
            if fwd_module is not None and isinstance(param, torch.nn.Parameter):
                register_external_parameter(fwd_module, param)

    def __enter__(self) -> GatheredParameters:
        if not self.enabled or not self._members:
            return self
        for member in self._members:
            member.holders += 1
        for member in self._members:
            if member.pending is not None:
                member.pending.wait()
        with full_precision_gathers():  # see [Note: full-precision gathers] (zeropp.py)
            for pending in gather_full(self._members):
                pending.wait()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled or not self._members:
            return
        if self.modifier_rank is not None and exc_type is None:
            for member in self._members:
                with torch.no_grad():
                    full = member.param.data
                    member.group.broadcast_(full, src=self.modifier_rank)
                member.refresh_shard()
        for member in self._members:
            member.holders -= 1
            if member.holders == 0 and not member.persistent:
                member.free(keep_views=True)
            elif self.modifier_rank is not None and member.persistent and member.holders == 0:
                member.free(keep_views=True)  # re-gathered from the new shards at the next use
