"""The Hugging Face Trainer asks about every update without waiting for the device.

After each update the Trainer reads ``accelerator.clip_grad_norm_`` (the norm it logs) and
``accelerator.optimizer_step_was_skipped`` (to hold its scheduler back). With a fused
optimizer the engine decides an inf/nan skip on the device; neither question may read a tensor
on the host (each read is a device sync on a GPU; counted here on CPU by wrapping every
Python-level host read). What the Trainer records stays as it was: one spawned rank, a tiny
GPT-2, the Trainer's own fused AdamW and linear schedule, an inf gradient at update 2 of 5:
the update is skipped, the schedule does not advance on it (the logged learning rate repeats)
and the logged norm of the skipped update is the previous one's, as ``get_global_grad_norm``
gives.
"""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from slipstream.comm.testing import count_host_reads, run_distributed

CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 10_000,
}
STEPS, BAD = 5, 2


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _worker(root: str) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    from slipstream.integrations import transformers as slip

    reads = [0]

    def counted(call: Any) -> Any:
        with count_host_reads(reads):
            return call()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    args = slip.TrainingArguments(
        output_dir=root,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        deepspeed=CONFIG,
    )

    class Poison(TrainerCallback):
        handle: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == BAD:
                weight = model.transformer.h[0].mlp.c_fc.weight
                self.handle = weight.register_hook(lambda g: g * float("inf"))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    trainer = slip.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[Poison()])
    cls = type(trainer.accelerator)
    skipped_property, clip = cls.optimizer_step_was_skipped, cls.clip_grad_norm_
    cls.optimizer_step_was_skipped = property(  # type: ignore[method-assign]
        lambda self: counted(lambda: skipped_property.fget(self))
    )
    cls.clip_grad_norm_ = lambda self, *a, **k: counted(lambda: clip(self, *a, **k))  # type: ignore[method-assign]
    trainer.train()
    engine = trainer.accelerator.engine
    logs = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    return {
        "reads": reads[0],
        "skipped": engine.skipped_steps,
        "fused": bool(engine.optimizer.defaults.get("fused")),
        "lr": [entry["learning_rate"] for entry in logs],
        "norm": [entry["grad_norm"] for entry in logs],
    }


def test_trainer_reads_nothing_after_each_update_and_records_the_skip(tmp_path: Path) -> None:
    (report,) = run_distributed(_worker, 1, str(tmp_path), timeout=300.0)
    assert report["fused"], "the test needs the fused optimizer (the skip on the device)"
    assert report["reads"] == 0, f"{report['reads']} host reads after the updates"
    assert report["skipped"] == 1
    lr, norm = report["lr"], report["norm"]
    assert len(lr) == STEPS and len(norm) == STEPS
    # The update at index BAD is skipped: its schedule step is held back, so the next update
    # runs at the same learning rate, and its logged norm is the previous update's.
    assert lr[BAD + 1] == lr[BAD], lr
    assert all(a != b for i, (a, b) in enumerate(pairwise(lr)) if i != BAD), lr
    assert norm[BAD] == norm[BAD - 1], norm
    assert all(math.isfinite(n) for n in norm), norm


def test_metric_driven_schedulers_stay_the_trainers() -> None:
    from transformers.optimization import GreedyLR

    from slipstream.integrations.transformers import _steps_without_metrics

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert _steps_without_metrics(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    assert not _steps_without_metrics(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    assert not _steps_without_metrics(GreedyLR(optimizer))
