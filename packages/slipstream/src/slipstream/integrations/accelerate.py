"""Hugging Face Accelerate on Slipstream: an ``Accelerator`` whose ``prepare`` builds the engine.

A user's Accelerate loop changes one line, the accelerator's construction::

    from slipstream.integrations.accelerate import SlipstreamAccelerator

    accelerator = SlipstreamAccelerator(config="ds_config.json", cpu=not torch.cuda.is_available())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("checkpoints")

Everything but the model, optimizer and scheduler (data loaders, devices, ``gather``, ...) is
Accelerate's own. ``backward`` runs ``engine.backward`` and, when Accelerate says the
micro-batch ends an accumulation cycle, ``engine.step``; the returned optimizer and scheduler
then do nothing on ``step``/``zero_grad`` (the engine did it), as Accelerate's DeepSpeed
support does. See docs/integrations.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from slipstream.integrations.auto_values import fill_auto, hidden_size_values, read_config
from slipstream.runtime.engine import SlipstreamEngine

__all__ = ["SlipstreamAccelerator", "SlipstreamOptimizerWrapper", "SlipstreamSchedulerWrapper"]


class SlipstreamOptimizerWrapper(AcceleratedOptimizer):
    """The engine's optimizer as Accelerate expects it; ``step``/``zero_grad`` are the engine's.

    ``param_groups`` are the engine optimizer's, so a scheduler built on this wrapper (as the
    Transformers ``Trainer`` builds one) sets the learning rate the engine uses.
    """

    def __init__(self, engine: SlipstreamEngine) -> None:
        assert engine.optimizer is not None
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self._last_skipped = False
        # engine.skipped_steps before the last boundary's step, until someone asks whether
        # that step was skipped (None: answered already, in _last_skipped).
        self._skipped_before: int | None = None

    def stepped(self, skipped_before: int) -> None:
        """A boundary's ``engine.step()`` is about to run; ``skipped_before`` is the engine's
        settled ``skipped_steps`` count before it (read after ``engine.backward``, which
        settles the previous step: no sync). Whether this step was skipped is read when asked.
        """
        if self._skipped_before is not None:  # the previous boundary's answer, now settled
            self._last_skipped = skipped_before != self._skipped_before
        self._skipped_before = skipped_before

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last boundary skipped its update (fp16 overflow, or an inf/nan).

        Read lazily: the engine decides the skip on the device ([Note: the skip decided on
        the device] in slipstream.zero), so asking right after the step waits for the
        device to finish it (a host sync); nothing asks during ``accelerator.backward``.
        """
        if self._skipped_before is not None:
            self._last_skipped = self.engine.skipped_steps != self._skipped_before
            self._skipped_before = None
        return self._last_skipped

    @last_step_skipped.setter
    def last_step_skipped(self, value: bool) -> None:
        self._skipped_before = None
        self._last_skipped = bool(value)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Nothing: the engine drops gradients after its step."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing: ``accelerator.backward`` ran the engine's step at the accumulation boundary."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last boundary skipped its update (:attr:`last_step_skipped`: asking
        waits for the step on the device)."""
        return self.last_step_skipped


class SlipstreamSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine steps at each boundary; ``step()`` from the loop does nothing."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine steps its scheduler after each optimizer update."""


class SlipstreamAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose model and optimizer train on a Slipstream engine.

    Args:
        config: the DeepSpeed/Slipstream config (dict, path or JSON text). ``"auto"`` values
            are filled as Transformers fills them for DeepSpeed: the micro-batch from the
            first prepared data loader, gradient accumulation from this accelerator, the
            global batch from both and the world size, the ZeRO bucket sizes from the
            model's hidden size; ``auto_values`` adds or overrides any dotted key.
        auto_values: ``{"optimizer.params.lr": 1e-4, ...}`` for the other ``"auto"`` keys.
        skip_answer_waits: False: :attr:`optimizer_step_was_skipped` answers from what the
            host knows, never waiting for the device (a skip still being decided there reads
            as not skipped). For loops that ask only to hold back a scheduler the engine
            steps itself, on taken steps only (the Transformers ``Trainer``); the optimizer's
            ``step_was_skipped`` still gives the exact answer.
        **kwargs: ``Accelerator``'s own arguments (``cpu``, ``gradient_accumulation_steps``, ...).
            ``mixed_precision`` is left to the config's ``fp16``/``bf16`` blocks.
    """

    def __init__(
        self,
        *args: Any,
        config: Any,
        auto_values: Mapping[str, Any] | None = None,
        skip_answer_waits: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.skip_answer_waits = skip_answer_waits
        self.slipstream_config = read_config(config)
        self.auto_values: dict[str, Any] = dict(auto_values or {})
        self.engine: SlipstreamEngine | None = None

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Build the engine from the model (and optimizer, scheduler); the rest as Accelerate.

        Returns the objects in the order given: the engine for the model, a
        :class:`SlipstreamOptimizerWrapper` for the optimizer, a
        :class:`SlipstreamSchedulerWrapper` for the scheduler, Accelerate's own for the rest.
        """
        models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
        if len(models) > 1 or (models and self.engine is not None):
            raise ValueError(
                "SlipstreamAccelerator trains one model (one engine): prepare a single model"
            )
        results = list(args)
        for i, obj in enumerate(args):
            if i in models or obj is None or _is_optimizer(obj) or _is_scheduler(obj):
                continue
            results[i] = super().prepare(obj, device_placement=device_placement)
            if isinstance(results[i], torch.utils.data.DataLoader):
                self.auto_values.setdefault(
                    "train_micro_batch_size_per_gpu", getattr(obj, "batch_size", None)
                )
        optimizers = [i for i, a in enumerate(args) if _is_optimizer(a)]
        schedulers = [i for i, a in enumerate(args) if _is_scheduler(a)]
        if not models:
            if optimizers or schedulers:
                raise ValueError(
                    "prepare the optimizer and scheduler together with their model: "
                    "accelerator.prepare(model, optimizer, ...)"
                )
            return results[0] if len(results) == 1 else tuple(results)
        model = args[models[0]]
        optimizer = args[optimizers[0]] if optimizers else None
        scheduler = args[schedulers[0]] if schedulers else None
        engine = self._build_engine(model, optimizer, scheduler)
        results[models[0]] = engine
        if optimizers:
            results[optimizers[0]] = self._optimizers[-1]
        elif None in args:  # the Transformers Trainer passes optimizer=None with an optimizer block
            results[args.index(None)] = self._optimizers[-1]
        if schedulers:
            results[schedulers[0]] = self._schedulers[-1]
        return results[0] if len(results) == 1 else tuple(results)

    def _build_engine(
        self, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> SlipstreamEngine:
        import slipstream

        config = self.slipstream_config
        values = {
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            **hidden_size_values(model),
            **self.auto_values,
        }
        micro = values.get("train_micro_batch_size_per_gpu")
        if micro is not None:
            values.setdefault(
                "train_batch_size",
                micro * values["gradient_accumulation_steps"] * self.num_processes,
            )
        fill_auto(config, values)
        engine, _, _, _ = slipstream.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=None if optimizer is not None else model.parameters(),
            lr_scheduler=scheduler,
            config=config,
            dist_init_required=True,
        )
        assert isinstance(engine, SlipstreamEngine)
        self.engine = engine
        self._models.append(engine)
        if engine.optimizer is not None:
            wrapper = SlipstreamOptimizerWrapper(engine)
            self._optimizers.append(wrapper)
            if engine.lr_scheduler is not None:
                self._schedulers.append(SlipstreamSchedulerWrapper(engine.lr_scheduler, wrapper))
        return engine

    # ------------------------------------------------------------------ the loop
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward``; at an accumulation boundary also ``engine.step``.

        The loss is divided by Accelerate's gradient-accumulation steps (as ``Accelerator``
        does; 1 under the Transformers ``Trainer``, which scales it itself), never again by
        the engine's.
        """
        engine = self._engine()
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        engine.backward(loss / self.gradient_accumulation_steps, scale_wrt_gas=False, **kwargs)
        if self.sync_gradients:
            # engine.backward settled the previous step, so this count is known on the host;
            # whether the coming step is skipped is read only when asked (step_was_skipped):
            # reading it here would wait for the device every step.
            skipped_before = engine.skipped_steps
            for optimizer in self._optimizers:
                if isinstance(optimizer, SlipstreamOptimizerWrapper):
                    optimizer.stepped(skipped_before)
        engine.step()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The engine's last gradient norm (it clips to the config's ``gradient_clipping``), a
        0-d tensor on the device as torch's ``clip_grad_norm_`` returns, read by nobody here:
        asking right after a step does not wait for it (None before the first step)."""
        return self._engine().global_grad_norm_tensor()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last update was skipped; with ``skip_answer_waits=False``, as far as the
        host knows without waiting (see the class's arguments)."""
        engine = self.engine
        if not self.skip_answer_waits and engine is not None and engine.step_pending:
            return False  # the engine holds its schedulers back itself on a skipped step
        return bool(super().optimizer_step_was_skipped)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Nothing to do: the engine reduces gradients only at accumulation boundaries."""
        yield

    def unwrap_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        """The user's module inside the engine (or Accelerate's unwrapping otherwise)."""
        if isinstance(model, SlipstreamEngine):
            return model.module
        return super().unwrap_model(model, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, output_dir: str | None = None, **kwargs: Any) -> str:  # type: ignore[override]
        """``engine.save_checkpoint(output_dir)`` on every rank (model, optimizer, scheduler, RNG)."""
        if output_dir is None:
            raise ValueError("SlipstreamAccelerator.save_state needs output_dir")
        self._engine().save_checkpoint(output_dir)
        return output_dir

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:  # type: ignore[override]
        """``engine.load_checkpoint(input_dir)`` on every rank."""
        if input_dir is None:
            raise ValueError("SlipstreamAccelerator.load_state needs input_dir")
        self._engine().load_checkpoint(input_dir)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full (gathered) state dict on every rank, ZeRO-3 included."""
        from slipstream.zero import GatheredParameters

        module = model.module if isinstance(model, SlipstreamEngine) else model
        with GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def _engine(self) -> SlipstreamEngine:
        if self.engine is None:
            raise RuntimeError("prepare the model first: accelerator.prepare(model, optimizer)")
        return self.engine


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler)
