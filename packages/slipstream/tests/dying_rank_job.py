"""A rank of test_dying_rank: rank 1 dies at step 2; rank 0 reports what it saw and when.

Run as a script with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set. Rank 0 prints one line,
``FAILED <seconds> <exception type>: <message>``, and exits 5 when training raised.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import slipstream
from slipstream import comm


def main() -> None:
    comm.init_distributed(dist_backend="gloo")
    rank = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    start = time.monotonic()
    try:
        for step in range(6):
            if step == 2 and rank == 1:
                os._exit(3)  # killed: no clean-up, no goodbye to the peer
            loss = engine(torch.randn(2, 6)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    except Exception as error:  # what a user's loop would see
        print(f"FAILED {time.monotonic() - start:.1f} {type(error).__name__}: {error}", flush=True)
        sys.exit(5)


if __name__ == "__main__":
    main()
