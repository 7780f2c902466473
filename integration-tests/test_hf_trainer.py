"""The Hugging Face Trainer on Slipstream: ZeRO-2 and ZeRO-3 configs with "auto" values.

Two gloo ranks, a tiny random-weight GPT-2 loaded with ``from_pretrained`` (partitioned by
zero.Init at stage 3), gradient accumulation 2, 4 optimizer steps with a checkpoint every 2:
ZeRO-2 matches the plain Trainer (DDP) step for step; at ZeRO-3 resuming from checkpoint-2
reproduces the uninterrupted run exactly; both saved checkpoints reload with ``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from slipstream.comm.testing import run_distributed

pytestmark = pytest.mark.slow

STAGE2 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
}
STAGE3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _base_model(folder: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    GPT2LMHeadModel(config).save_pretrained(folder)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (32, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(cls: type, out: str, config: dict | None) -> object:
    extra = {"deepspeed": config} if config is not None else {}
    return cls(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        save_steps=2,
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        **extra,
    )


def _weights(trainer: object) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}


def _worker(root: str) -> dict:
    import transformers
    from transformers import GPT2LMHeadModel

    from slipstream.integrations import transformers as slip
    from slipstream.zero import sharded_state_of

    base = f"{root}/base"
    out: dict = {}
    plain = transformers.Trainer(
        model=GPT2LMHeadModel.from_pretrained(base),
        args=_args(transformers.TrainingArguments, f"{root}/plain", None),
        train_dataset=_Tokens(),
    )
    plain.train()
    out["plain"] = {k: v.detach().clone() for k, v in plain.model.state_dict().items()}
    for stage, config in ((2, STAGE2), (3, STAGE3)):
        run = f"{root}/stage{stage}"
        args = _args(slip.TrainingArguments, run, config)
        model = slip.from_pretrained(GPT2LMHeadModel, base)
        partitioned = all(sharded_state_of(p) is not None for p in model.parameters())
        trainer = slip.Trainer(model=model, args=args, train_dataset=_Tokens())
        result = trainer.train()
        full = _weights(trainer)
        engine = trainer.accelerator.engine
        filled = engine.config.raw
        resumed_weights = None
        if stage == 3:  # resume in a fresh Trainer from the half-way checkpoint
            args = _args(slip.TrainingArguments, f"{root}/resumed{stage}", config)
            model = slip.from_pretrained(GPT2LMHeadModel, base)
            resumed = slip.Trainer(model=model, args=args, train_dataset=_Tokens())
            resumed.train(resume_from_checkpoint=f"{run}/checkpoint-2")
            resumed_weights = _weights(resumed)
        out[stage] = {
            "partitioned": partitioned,
            "full": full,
            "resumed": resumed_weights,
            "loss": result.training_loss,
            "steps": engine.global_steps,
            "filled": filled,
            "lr": engine.get_lr(),
        }
    return out


def test_trainer_zero2_zero3_resume_and_reload(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    _base_model(tmp_path / "base")
    ranks = run_distributed(_worker, 2, str(tmp_path), timeout=600.0)
    rank0 = ranks[0]
    for stage in (2, 3):
        run = rank0[stage]
        assert run["steps"] == 4
        assert run["partitioned"] == (stage == 3)
        filled = run["filled"]
        assert filled["train_batch_size"] == 2 * 2 * 2
        assert filled["gradient_clipping"] == 1.0
        assert filled["zero_optimization"]["reduce_bucket_size"] == 32 * 32
        for name, value in run["full"].items():
            if run["resumed"] is not None:
                torch.testing.assert_close(run["resumed"][name], value, rtol=0, atol=0)
            torch.testing.assert_close(ranks[1][stage]["full"][name], value, rtol=0, atol=0)
        # The last checkpoint is what from_pretrained reads back.
        reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / f"stage{stage}" / "checkpoint-4")
        for name, value in reloaded.state_dict().items():
            if name in run["full"]:
                torch.testing.assert_close(value, run["full"][name], rtol=0, atol=0)
    sched = rank0[3]["filled"]["scheduler"]["params"]
    assert sched["total_num_steps"] == 4 and sched["warmup_num_steps"] == 1
    assert sched["warmup_max_lr"] == 1e-3
    # ZeRO-2 with the Trainer's own AdamW and schedule is the plain Trainer (DDP), step for step.
    for name, value in rank0["plain"].items():
        torch.testing.assert_close(rank0[2]["full"][name], value, rtol=1e-4, atol=1e-6)
