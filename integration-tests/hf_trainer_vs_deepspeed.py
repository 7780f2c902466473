"""The Hugging Face Trainer on Slipstream beside the real DeepSpeed, same config (GPU; not a test).

Trains a randomly initialised GPT-2-shaped model (``--layers``, ``--hidden``) on random tokens for
``--steps`` optimizer steps with a ZeRO config, through ``transformers.Trainer`` + DeepSpeed or
``slipstream.integrations.transformers.Trainer``, and prints one JSON line: samples/s over the
steps after ``--warmup``, and the loss per step (the data and the initial weights are seeded, so
the two curves should overlap). Run each backend with its own launch:

    torchrun --nproc_per_node 2 integration-tests/hf_trainer_vs_deepspeed.py --backend slipstream
    torchrun --nproc_per_node 2 integration-tests/hf_trainer_vs_deepspeed.py --backend deepspeed
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
    }


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (count, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["slipstream", "deepspeed"], required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    if args.backend == "slipstream":
        from slipstream.integrations.transformers import Trainer, TrainingArguments
    else:
        Trainer, TrainingArguments = transformers.Trainer, transformers.TrainingArguments

    times: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_log(self, _args: object, _state: object, _control: object, logs=None, **__: object):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.gas,
        max_steps=args.steps,
        learning_rate=3e-4,
        warmup_steps=5,
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        deepspeed=_config(args.stage),
    )
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=args.hidden // 64,
        n_positions=args.seq,
        vocab_size=50304,
    )
    model = GPT2LMHeadModel(config)
    samples = args.micro_batch * args.gas * training.world_size * args.steps
    dataset = _Tokens(samples, args.seq, config.vocab_size)
    trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=[Clock()])
    trainer.train()
    if training.process_index == 0:
        steady = times[args.warmup :]
        per_step = args.micro_batch * args.gas * training.world_size
        rate = per_step * (len(steady) - 1) / (steady[-1] - steady[0])
        print(json.dumps({"backend": args.backend, "samples_per_s": rate, "loss": losses}))


if __name__ == "__main__":
    main()
