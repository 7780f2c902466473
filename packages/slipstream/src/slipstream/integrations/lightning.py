"""PyTorch Lightning on Slipstream: ``SlipstreamStrategy``, the counterpart of ``DeepSpeedStrategy``.

::

    import lightning as L
    from slipstream.integrations.lightning import SlipstreamStrategy

    trainer = L.Trainer(strategy=SlipstreamStrategy(stage=3), accelerator="gpu", devices=8)
    # or, once this module is imported, by name:
    trainer = L.Trainer(strategy="slipstream_stage_2", accelerator="cpu", devices=2)

The names mirror Lightning's DeepSpeed ones: ``slipstream``, ``slipstream_stage_1``,
``slipstream_stage_2``, ``slipstream_stage_2_offload``, ``slipstream_stage_3``,
``slipstream_stage_3_offload``. As with DeepSpeed, the engine accumulates gradients
(``Trainer(accumulate_grad_batches=N)`` becomes ``gradient_accumulation_steps``), clips them
(``gradient_clip_val`` becomes ``gradient_clipping``), and owns the checkpoint: ``ckpt_path``
and ``Trainer.save_checkpoint`` take a directory of per-rank shards. It runs on CPUs (gloo) as
well as GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from slipstream.integrations.auto_values import read_config
from slipstream.runtime.engine import SlipstreamEngine

__all__ = ["SlipstreamPrecision", "SlipstreamStrategy"]

logger = logging.getLogger(__name__)


class SlipstreamPrecision(Precision):
    """Backward and step through the engine (its config sets fp16/bf16 and loss scaling)."""

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """``engine.backward(loss)``, reducing gradients at accumulation boundaries.

        Lightning has already divided the loss by ``accumulate_grad_batches``; the engine must
        not divide it again.
        """
        engine: SlipstreamEngine = model.trainer.strategy.model  # type: ignore[assignment]
        engine.backward(tensor, scale_wrt_gas=False)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: LightningModule, closure: Any, **kwargs: Any
    ) -> Any:
        """Run the closure (forward and backward), then ``engine.step()`` (a no-op mid-accumulation)."""
        result = closure()
        if result is None and model.automatic_optimization:
            raise RuntimeError(
                "SlipstreamStrategy: training_step returned None, so there is no loss to step on; "
                "return the loss (skipping batches is not supported with a Slipstream engine)"
            )
        engine: SlipstreamEngine = model.trainer.strategy.model  # type: ignore[assignment]
        engine.step()
        return result

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine clips to the config's ``gradient_clipping`` in its step."""


class SlipstreamStrategy(DDPStrategy):
    """Train a ``LightningModule`` on a Slipstream engine (ZeRO stages 0-3, offload).

    Args:
        stage: ``zero_optimization.stage`` when no ``config`` is given.
        offload_optimizer: optimizer states and step on the CPU (``offload_optimizer``).
        offload_parameters: parameters on the CPU at stage 3 (``offload_param``).
        config: a full DeepSpeed/Slipstream config (dict or path); the arguments above are
            then ignored. ``gradient_accumulation_steps`` must not be in it (it comes from
            ``Trainer(accumulate_grad_batches=...)``, as with Lightning's DeepSpeed).
        **kwargs: ``DDPStrategy``'s arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``process_group_backend``, ``timeout``, ...).
    """

    strategy_name = "slipstream"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: Mapping[str, Any] | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(precision_plugin=SlipstreamPrecision(), **kwargs)
        if config is None:
            zero: dict[str, Any] = {"stage": stage}
            if offload_optimizer:
                zero["offload_optimizer"] = {"device": "cpu"}
            if offload_parameters:
                zero["offload_param"] = {"device": "cpu"}
            config = {"zero_optimization": zero}
        self.config = read_config(config)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: LightningTrainer) -> None:
        """Place the module, then wrap it (and its optimizer) in a Slipstream engine."""
        assert self.accelerator is not None
        # A strategy chosen by name gets Lightning's default precision plugin: precision is
        # the config's (fp16/bf16 blocks), so only the default 32-bit one may be replaced.
        if not isinstance(self.precision_plugin, SlipstreamPrecision):
            if type(self.precision_plugin) is not Precision:
                raise ValueError(
                    f"SlipstreamStrategy: Trainer(precision=...) chose "
                    f"{type(self.precision_plugin).__name__}; leave precision at its default "
                    'and enable "bf16" or "fp16" in the Slipstream config instead'
                )
            self.precision_plugin = SlipstreamPrecision()
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_engine(trainer)
        else:
            self.model_to_device()
        self.setup_precision_plugin()
        self.barrier()

    def _build_engine(self, trainer: LightningTrainer) -> None:
        import slipstream

        module = self.lightning_module
        assert module is not None
        config = self.config
        if "gradient_accumulation_steps" in config:
            raise ValueError(
                "SlipstreamStrategy: do not set gradient_accumulation_steps in the config; it "
                "comes from Trainer(accumulate_grad_batches=...)"
            )
        config["gradient_accumulation_steps"] = trainer.accumulate_grad_batches
        # Only the throughput log reads the micro-batch; Lightning does not know it here.
        config.setdefault("train_micro_batch_size_per_gpu", 1)
        config.setdefault("gradient_clipping", float(trainer.gradient_clip_val or 0.0))
        config.pop("train_batch_size", None)
        optimizer = None
        if "optimizer" not in config:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError(
                    "SlipstreamStrategy trains one optimizer with at most one scheduler; "
                    f"configure_optimizers returned {len(optimizers)} and {len(schedulers)}"
                )
            optimizer = optimizers[0]
            # Lightning steps the scheduler itself (on the optimizer the engine steps).
            self.lr_scheduler_configs = schedulers
        engine, engine_optimizer, _, _ = slipstream.initialize(
            model=module,
            optimizer=optimizer,
            model_parameters=None if optimizer is not None else module.parameters(),
            config=config,
            dist_init_required=True,
        )
        assert isinstance(engine, SlipstreamEngine)
        self.model = engine
        self.optimizers = [engine_optimizer] if engine_optimizer is not None else []

    def setup_optimizers(self, trainer: LightningTrainer) -> None:
        """Nothing here: the optimizer is built with the engine in :meth:`setup`."""
        self.optimizers = []
        self.lr_scheduler_configs = []

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]
        return model  # no DDP wrapper: the engine reduces gradients

    @property
    def handles_gradient_accumulation(self) -> bool:
        """The engine accumulates: Lightning calls ``optimizer_step`` every batch."""
        return True

    @property
    def engine(self) -> SlipstreamEngine:
        """The Slipstream engine wrapping the LightningModule."""
        assert isinstance(self.model, SlipstreamEngine), "the engine is built in setup()"
        return self.model

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the engine, which exists only after setup."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The engine restores its optimizer itself."""
        return False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """The engine's checkpoint at ``filepath`` (a directory), every rank writing its shards.

        Lightning's own state (loops, callbacks, schedulers) travels as the client state.
        """
        if storage_options is not None:
            raise TypeError("SlipstreamStrategy.save_checkpoint does not take storage_options")
        filepath = self.broadcast(str(filepath))
        client = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        self.engine.save_checkpoint(filepath, tag="checkpoint", client_state=client)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the engine from ``checkpoint_path``; returns Lightning's state for the loops."""
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # type: ignore[union-attr]
        _, client_state = self.engine.load_checkpoint(
            str(checkpoint_path),
            load_optimizer_states=fitting,
            load_lr_scheduler_states=False,
        )
        return client_state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` restored the weights."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizer."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The ``slipstream*`` names, as Lightning registers ``deepspeed*``."""
        names: dict[str, tuple[str, dict[str, Any]]] = {
            "slipstream": ("Slipstream, ZeRO stage 2", {}),
            "slipstream_stage_1": ("Slipstream, ZeRO stage 1", {"stage": 1}),
            "slipstream_stage_2": ("Slipstream, ZeRO stage 2", {"stage": 2}),
            "slipstream_stage_2_offload": (
                "Slipstream, ZeRO stage 2 with the optimizer on the CPU",
                {"stage": 2, "offload_optimizer": True},
            ),
            "slipstream_stage_3": ("Slipstream, ZeRO stage 3", {"stage": 3}),
            "slipstream_stage_3_offload": (
                "Slipstream, ZeRO stage 3 with optimizer and parameters on the CPU",
                {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
            ),
        }
        for name, (description, init_params) in names.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)


SlipstreamStrategy.register_strategies(StrategyRegistry)
