"""Time the bf16 -> fp32 copies of ZeRO-1/2's gradient buckets: ``copy_`` vs ``_foreach_copy_``.

Every gradient of the 1.3b model of ``tools/bench/llama.py`` (bf16) is copied into an fp32
bucket laid out as stage 2 does on 2 ranks (one contiguous row per rank, [Note: row copies]
and [Note: cast copies] in ``slipstream.zero.grad_reduce``), once per parameter with
``Tensor.copy_`` per row (what the reducer did) and with one ``torch._foreach_copy_`` per
parameter (what it does now). Prints the time per step's worth of copies and the bandwidth.

    python tools/bench/cast_copy_bench.py [--model 1.3b] [--world 2] [--repeat 10]
"""

from __future__ import annotations

import argparse

import torch

SIZES = {"1.3b": (2048, 24, 5504, 32000), "7b": (4096, 32, 11008, 32000)}


def _shapes(model: str) -> list[int]:
    hidden, layers, ffn, vocab = SIZES[model]
    per_layer = [
        hidden,
        3 * hidden * hidden,
        hidden * hidden,
        hidden,
        2 * ffn * hidden,
        ffn * hidden,
    ]
    return [vocab * hidden, *(per_layer * layers), hidden, vocab * hidden]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.3b", choices=sorted(SIZES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    numels = _shapes(args.model)
    grads = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in numels]
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for grad in grads:
        n = -(-grad.numel() // args.world)
        bucket = torch.empty(args.world, n, device=device, dtype=torch.float32)
        full = grad.numel() // n
        pieces = [(bucket[r], grad[r * n : (r + 1) * n]) for r in range(full)]
        if grad.numel() > full * n:
            pieces.append((bucket[full, : grad.numel() - full * n], grad[full * n :]))
        rows.append(pieces)

    def per_row() -> None:
        for pieces in rows:
            for into, piece in pieces:
                into.copy_(piece)

    def per_parameter() -> None:
        for pieces in rows:
            torch._foreach_copy_([i for i, _ in pieces], [p for _, p in pieces])

    nbytes = sum(numels) * 6  # 2 read + 4 written per element
    for name, fn in (("copy_ per row", per_row), ("_foreach_copy_ per parameter", per_parameter)):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.repeat
        print(f"{name:30s} {ms:7.3f} ms per step  {nbytes / ms / 1e9:7.1f} GB/s")
    for pieces in rows:  # the two agree bit for bit
        for into, piece in pieces:
            assert torch.equal(into, piece.float())
    print(f"{args.model}: {sum(numels) / 1e9:.3f} B elements, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
