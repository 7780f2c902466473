#!/usr/bin/env bash
# One GPU-machine session in phases (a device command may run 10 minutes at most):
#   tests     every package's `gpu` tests, the demo on 2 GPUs, the kernels' GPU benchmark
#   train     1.3b and 7b training beside DDP and FSDP2 (ZeRO stages, docs/benchmarks.md)
#   pipeline  the 1.3b model at PP=2, each schedule
#   scale     weak scaling of the 1.3b model on 1, 2 and 4 GPUs (needs 4 GPUs)
#   offload   CPU optimizer offload of the 1.3b and 7b models on 2 GPUs; the I/O engine
#   offload1  the largest models on 1 GPU with CPU and NVMe offload
# Results go to $OUT (or ./gpu-results) as logs and JSON lines. No nox or hatchling needed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="9.0"
src=$(ls -d kernels/src packages/*/src | tr '\n' ':')
export PYTHONPATH="$src${PYTHONPATH:-}"
out=${OUT:-gpu-results}
mkdir -p "$out"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

for phase in "$@"; do
  case $phase in
    tests)
      nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
      python3 -m pytest kernels/tests packages/*/tests integration-tests -m gpu -q \
        -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -8
      python3 -m slipstream.cli run --num_procs "$(( gpus >= 2 ? 2 : 1 ))" \
        --module slipstream.examples.gpt --out /tmp/demo 2>&1 | tee "$out/demo.log" \
        | grep -E "engine:|step=(10|160) |at the first"
      python3 tools/bench/kernels_bench.py --skip-cpu --json "$out/kernels_bench.json" 2>&1 \
        | tee "$out/kernels_bench.log" | tail -25
      ;;
    train)
      python3 tools/bench/run_all.py --gpus 2 --out "$out/train.jsonl" \
        ddp@1.3b/4 fsdp2@1.3b/4 slipstream:0@1.3b/4 slipstream:1@1.3b/4 slipstream:2@1.3b/4 \
        slipstream:3@1.3b/4 fsdp2@7b/2 slipstream:3@7b/2 2>&1 | tee "$out/train.log" | tail -14
      ;;
    pipeline)
      CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node 2 \
        tools/bench/pipeline_bench.py --steps 6 --warmup 2 2>&1 | tee "$out/pipeline.log" | tail -12
      ;;
    scale)
      for n in 1 4; do
        python3 tools/bench/run_all.py --gpus "$n" --out "$out/scale.jsonl" \
          fsdp2@1.3b/4 slipstream:1@1.3b/4 slipstream:2@1.3b/4 slipstream:3@1.3b/4 2>&1 \
          | tee "$out/scale$n.log" | tail -7
      done
      ;;
    offload)
      # CPU optimizer offload on 2 GPUs beside the same run without it (the final losses must
      # agree), then the largest models on one GPU with CPU and NVMe offload, and the I/O engine.
      python3 -m slipstream.kernels.build_ops && python3 -m slipstream.offload.build
      df -h /tmp | tee "$out/disk.txt"; free -g | tee -a "$out/disk.txt"
      mkdir -p /tmp/slipstream-nvme
      python3 -m slipstream.offload.io_bench --path /tmp/slipstream-nvme --size 2GiB \
        --json "$out/io_bench.json" 2>&1 | tee "$out/io_bench.log" | tail -14
      python3 tools/bench/run_all.py --gpus 2 --steps 8 --warmup 3 --out "$out/offload.jsonl" \
        slipstream:2@1.3b/4 slipstream:2+cpu@1.3b/4 slipstream:2+cpu+noclip@1.3b/4 \
        slipstream:2+cpu@7b/2 slipstream:2+cpu+noclip@7b/2 2>&1 \
        | tee "$out/offload2.log" | tail -6
      ;;
    offload1)
      python3 -m slipstream.kernels.build_ops && python3 -m slipstream.offload.build
      mkdir -p /tmp/slipstream-nvme
      for spec in slipstream:3+cpu+param@7b/2 slipstream:3+nvme+param@7b/2 \
          slipstream:3+cpu+param@13b/2; do
        timeout 240 python3 tools/bench/run_all.py --gpus 1 --steps 3 --warmup 1 \
          --out "$out/offload.jsonl" "$spec" 2>&1 | tee -a "$out/offload1.log" | tail -2
      done
      ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
