"""AutoTP on the GPU: a random Llama trained with ``tensor_parallel.autotp_size`` beside the
unsharded model, step by step (fp32, TF32 off), on NCCL.

``torchrun --standalone --nproc_per_node 2 tools/bench/autotp_check.py`` (any world divisible by
``--tp``; the data-parallel size is world / tp). Rank 0 prints one ``AUTOTP {json}`` line with
the worst relative loss difference and exits 1 if it exceeds ``--rtol``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage 0, 1 or 2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    import slipstream

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    slipstream.init_distributed()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model).to(device)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
        "zero_optimization": {"stage": args.stage},
        "tensor_parallel": {"autotp_size": args.tp},
    }
    engine, *_ = slipstream.initialize(model=model, config=ds_config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    dp = engine.dp_world_size
    dp_rank = dist.get_rank(engine.dp_group)
    worst = 0.0
    losses = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)
        batch = torch.randint(0, config.vocab_size, (2 * dp, 128), generator=gen).to(device)
        mine = batch[2 * dp_rank : 2 * dp_rank + 2]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        ref_loss = reference(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=engine.dp_group)
        mean /= dp
        worst = max(worst, float((mean - ref_loss).abs() / ref_loss.abs()))
        losses.append(round(float(mean), 5))
    ok = worst <= args.rtol
    if dist.get_rank() == 0:
        print(
            "AUTOTP "
            + json.dumps(
                {
                    "tp": args.tp,
                    "dp": dp,
                    "stage": args.stage,
                    "losses": losses,
                    "worst_rel": worst,
                    "ok": ok,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
