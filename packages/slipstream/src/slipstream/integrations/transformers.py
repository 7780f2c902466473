"""The Hugging Face ``Trainer`` on Slipstream: change one import, keep ``deepspeed="ds_config.json"``.

::

    # from transformers import Trainer, TrainingArguments
    from slipstream.integrations.transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir="out", deepspeed="ds_config.json", ...)
    model = from_pretrained(AutoModelForCausalLM, "gpt2", args)  # zero.Init at stage 3
    Trainer(model=model, args=args, train_dataset=dataset).train()

``TrainingArguments`` takes the DeepSpeed config as Transformers does and fills its ``"auto"``
values the same way (batch sizes, clipping, optimizer and scheduler parameters, precision;
the ZeRO bucket sizes from the model and the scheduler's step counts once training starts),
but hands it to Slipstream instead of DeepSpeed: ``args.deepspeed`` is None afterwards and
the completed config is ``args.slipstream_config``. ``Trainer`` trains through a
:class:`~slipstream.integrations.accelerate.SlipstreamAccelerator`; its checkpoints hold the
engine's (sharded) checkpoint beside the consolidated ``model.safetensors`` that
``from_pretrained`` reads, and ``resume_from_checkpoint`` restores the engine exactly.
See docs/integrations.md for what is covered and the tested versions.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME

from slipstream.integrations.accelerate import (
    SlipstreamAccelerator,
    SlipstreamOptimizerWrapper,
    SlipstreamSchedulerWrapper,
)
from slipstream.integrations.auto_values import fill_auto, hidden_size_values, read_config

__all__ = ["Trainer", "TrainingArguments", "active_config", "from_pretrained"]

logger = logging.getLogger(__name__)

# The config of the latest TrainingArguments with a Slipstream config, for from_pretrained
# (Transformers keeps the same kind of global for DeepSpeed's zero.Init).
_ACTIVE: weakref.ref[TrainingArguments] | None = None


def active_config() -> dict[str, Any] | None:
    """The completed config of the latest live ``TrainingArguments(deepspeed=...)``, or None."""
    args = _ACTIVE() if _ACTIVE is not None else None
    return args.slipstream_config if args is not None else None


def _argument_values(args: transformers.TrainingArguments) -> dict[str, Any]:
    """The ``"auto"`` values Transformers fills from ``TrainingArguments`` for DeepSpeed."""
    micro = args.per_device_train_batch_size
    gas = args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * args.world_size,
        "gradient_clipping": args.max_grad_norm,
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": args.learning_rate,
        "fp16.enabled": bool(args.fp16 or args.fp16_full_eval),
        "bf16.enabled": bool(args.bf16 or args.bf16_full_eval),
    }


def _training_length_values(
    args: transformers.TrainingArguments, num_training_steps: int
) -> dict[str, Any]:
    return {
        "scheduler.params.total_num_steps": num_training_steps,
        "scheduler.params.warmup_num_steps": args.get_warmup_steps(num_training_steps),
    }


class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose ``deepspeed`` config runs on Slipstream.

    After construction ``slipstream_config`` holds the config with the ``"auto"`` values known
    from these arguments filled in, and ``deepspeed`` is None (so that Transformers and
    Accelerate do not look for DeepSpeed).
    """

    slipstream_config: dict[str, Any] | None

    def __post_init__(self) -> None:
        global _ACTIVE
        source, self.deepspeed = self.deepspeed, None
        super().__post_init__()
        self.slipstream_config = None
        if source is not None:
            self.slipstream_config = read_config(source)
            fill_auto(self.slipstream_config, _argument_values(self))
            _ACTIVE = weakref.ref(self)

    @property
    def place_model_on_device(self) -> bool | None:
        """False with a Slipstream config: the engine places the model (as for DeepSpeed)."""
        return False if getattr(self, "slipstream_config", None) is not None else None


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` training through a Slipstream engine when the args carry a config.

    Without ``args.slipstream_config`` it is exactly ``transformers.Trainer``. With one:

    - the optimizer is the config's ``optimizer`` block if it has one, else the Trainer's own
      (``args.optim``), and the scheduler likewise (``scheduler`` block, else ``args``);
    - gradient accumulation, clipping (``gradient_clipping``) and precision are the engine's;
    - each checkpoint holds ``model.safetensors`` (gathered at ZeRO-3, for
      ``from_pretrained``) and the engine's checkpoint (every rank's shards, for resuming).
    """

    args: TrainingArguments

    def _slipstream(self) -> dict[str, Any] | None:
        return getattr(self.args, "slipstream_config", None)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        self._accelerator_args = dict(built)
        return built

    def create_accelerator_and_postprocess(self) -> None:
        """Build the Trainer's accelerator, then swap in a SlipstreamAccelerator with its arguments."""
        super().create_accelerator_and_postprocess()
        config = self._slipstream()
        if config is None:
            return
        kwargs = {k: v for k, v in self._accelerator_args.items() if k != "deepspeed_plugin"}
        self.accelerator = SlipstreamAccelerator(config=config, **kwargs)
        self.gather_function = self.accelerator.gather_for_metrics

    def _prepare_for_training(self, max_steps: int, *args: Any, **kwargs: Any) -> Any:
        accelerator = self.accelerator
        if isinstance(accelerator, SlipstreamAccelerator):
            accelerator.auto_values.update(hidden_size_values(self.model))
            accelerator.auto_values.update(_training_length_values(self.args, max_steps))
        return super()._prepare_for_training(max_steps, *args, **kwargs)

    def create_optimizer(self, model: Any = None) -> Any:
        """The Trainer's optimizer, unless the config's ``optimizer`` block makes the engine's."""
        config = self._slipstream()
        if config is not None and "optimizer" in config and self.optimizer is None:
            return None  # the engine builds it; prepare() returns its wrapper
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The config's ``scheduler`` if it has one, else the Trainer's own (``args``); either
        way the engine steps it, after taken updates only (as the Trainer would: it skips its
        scheduler's step when the update was skipped), and ``lr_scheduler.step()`` from the
        Trainer does nothing. The engine's checkpoint holds it. A metric-driven scheduler
        (``reduce_lr_on_plateau``, ``greedy``) stays the Trainer's to step."""
        engine = getattr(self.accelerator, "engine", None)
        if self._slipstream() is None or engine is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        wrapper = next(
            o for o in self.accelerator._optimizers if isinstance(o, SlipstreamOptimizerWrapper)
        )
        if engine.lr_scheduler is None:
            scheduler = super().create_scheduler(num_training_steps, optimizer)
            if not _steps_without_metrics(scheduler):
                return scheduler  # ReduceLROnPlateau, GreedyLR: the Trainer steps them on metrics
            engine.lr_scheduler = scheduler
        self.lr_scheduler = SlipstreamSchedulerWrapper(engine.lr_scheduler, wrapper)
        self._created_lr_scheduler = True
        # The Trainer asks optimizer_step_was_skipped after every update only to hold this
        # scheduler back, which the engine does itself: the answer need not wait for the
        # device (a host sync per update). A scheduler passed to the Trainer keeps the wait.
        self.accelerator.skip_answer_waits = False
        return self.lr_scheduler

    # ------------------------------------------------------------------ checkpoints
    def _engine_owns_scheduler(self) -> bool:
        return isinstance(self.lr_scheduler, SlipstreamSchedulerWrapper)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._slipstream() is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Every rank writes its shards (model, optimizer, the engine's scheduler, RNG).
        self.accelerator._engine().save_checkpoint(output_dir)  # type: ignore[attr-defined]
        if self.args.should_save and not self._engine_owns_scheduler():
            assert self.lr_scheduler is not None  # created before the first save
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._slipstream() is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # Nothing before prepare(): the engine's checkpoint restores the model exactly after it.

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._slipstream() is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.accelerator._engine().load_checkpoint(checkpoint)  # type: ignore[attr-defined]
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            # Written before the engine stepped the Trainer's scheduler (now in its checkpoint).
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated weights for ``from_pretrained`` (every rank gathers at ZeRO-3; rank 0 writes)."""
        if self._slipstream() is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")


def _steps_without_metrics(scheduler: Any) -> bool:
    """Whether ``scheduler.step()`` needs no argument (every torch ``LRScheduler`` but
    ``ReduceLROnPlateau``; not Transformers' ``GreedyLR``), so the engine can step it."""
    return isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and not isinstance(
        scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
    )


def from_pretrained(
    model_class: Any, name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any
) -> Any:
    """``model_class.from_pretrained(name_or_path, ...)``, partitioned as it loads at ZeRO-3.

    With a live ``TrainingArguments`` whose config has ``zero_optimization.stage`` 3, the model
    is built inside ``slipstream.zero.Init`` (each rank holds 1/N of every parameter) and each
    module's weights are read from the safetensors files on rank 0 and scattered, one module
    at a time, as Transformers does for DeepSpeed. Otherwise it is ``from_pretrained``.
    """
    config = active_config()
    stage = ((config or {}).get("zero_optimization") or {}).get("stage", 0)
    if stage != 3:
        return model_class.from_pretrained(name_or_path, *args, **kwargs)
    if args:
        raise TypeError("from_pretrained at ZeRO-3 takes keyword arguments only (e.g. dtype=...)")
    return _from_pretrained_zero3(model_class, name_or_path, config, **kwargs)


def _from_pretrained_zero3(
    model_class: Any, name_or_path: str | os.PathLike[str], config: Any, **kwargs: Any
) -> Any:
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.utils import cached_file

    from slipstream import comm
    from slipstream.zero import GatheredParameters, Init

    comm.init_distributed()
    model_config = AutoConfig.from_pretrained(name_or_path)
    # Auto classes build with from_config, model classes with _from_config (Transformers' API).
    build = getattr(model_class, "from_config", None) or model_class._from_config
    # No random initialisation: partitioned parameters have no full storage to fill, and
    # every weight is read from the checkpoint next (what Transformers does for DeepSpeed).
    with _no_init_weights(), Init(config_dict_or_path=config):
        model = build(model_config, **kwargs)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # tied embeddings share one (partitioned) parameter before loading
    files = _safetensors_files(name_or_path, cached_file)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    handles = [safe_open(f, framework="pt") for f in files] if rank0 else []
    where = {key: h for h in handles for key in h.keys()}
    prefix = getattr(model, "base_model_prefix", "")
    loaded: set[str] = set()
    for module_name, module in model.named_modules():
        tensors = dict(module.named_parameters(recurse=False))
        tensors.update(dict(module.named_buffers(recurse=False)))
        if not tensors:
            continue
        params = [t for t in tensors.values() if isinstance(t, torch.nn.Parameter)]
        with GatheredParameters(params, modifier_rank=0), torch.no_grad():
            if not rank0:
                continue
            for name, tensor in tensors.items():
                key = f"{module_name}.{name}" if module_name else name
                source = _find_key(where, key, prefix)
                if source is not None:
                    tensor.copy_(where[source].get_tensor(source).to(tensor.dtype))
                    loaded.add(key)
    missing = [k for k, _ in model.named_parameters() if k not in loaded] if rank0 else []
    if dist.is_initialized():
        shared: list[Any] = [missing]
        dist.broadcast_object_list(shared, src=0)
        missing = shared[0]
    if missing:
        # Nothing initialised them (see above): training on them would read garbage.
        raise ValueError(
            f"from_pretrained at ZeRO-3: {name_or_path} has no weights for {missing}; "
            "load this model without a stage-3 config, or complete the checkpoint"
        )
    return model


def _no_init_weights() -> Any:
    try:
        from transformers.initialization import no_init_weights  # Transformers 5
    except ImportError:  # Transformers 4
        from transformers.modeling_utils import (  # type: ignore[attr-defined,no-redef]
            no_init_weights,
        )
    return no_init_weights()


def _find_key(where: dict[str, Any], key: str, prefix: str) -> str | None:
    if key in where:
        return key
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1 :] in where:
        return key[len(prefix) + 1 :]
    if prefix and f"{prefix}.{key}" in where:
        return f"{prefix}.{key}"
    return None


def _safetensors_files(name_or_path: str | os.PathLike[str], cached_file: Any) -> list[str]:
    import json

    folder = str(name_or_path)
    index = cached_file(
        folder, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False
    )
    if index is not None:
        with open(index) as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        return [cached_file(folder, shard) for shard in shards]
    single = cached_file(folder, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if single is None:
        raise FileNotFoundError(
            f"from_pretrained at ZeRO-3 reads safetensors weights; {folder!r} has no "
            "model.safetensors (or index): convert the checkpoint to safetensors first"
        )
    return [single]
