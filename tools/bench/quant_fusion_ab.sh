#!/usr/bin/env bash
# decode_fusion on int8/int4 weights at batch 1 (Llama-3-8B shapes), beside bf16 fused and the
# unfused quantized step, on one GPU; compact lines. Run from the repo root:
#   bash tools/bench/quant_fusion_ab.sh            (GPU 0; about 3 minutes)
# With two GPUs, "bash tools/bench/quant_fusion_ab.sh split" runs the two halves side by side.
set -u
export PYTHONPATH=$(ls -d "$PWD"/kernels/src "$PWD"/packages/*/src | tr '\n' ':')
B="python3 tools/bench/infer_bench.py --batch 1 --skip-hf-eager --skip-hf-compiled --new-tokens 32 --repeats 1"
summary() {  # label, then the bench's JSON lines on stdin
  python3 -c '
import json, sys
label = sys.argv[1]
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    kind = r.get("result")
    if kind == "model":
        print(label, "model", "1tok_vs_dequant", r.get("one_token_logits_max_abs_diff_vs_dequantized"),
              "top1_vs_hf", r.get("top1_agreement_vs_hf"), "bytes/step", r.get("weight_bytes_read_per_step"))
    elif kind == "slipstream":
        print(label, "tok/s", r["decode_tokens_per_s"], "ms", r["decode_step_ms"], "bw", r["bandwidth_fraction"],
              "fusion", r["decode_fusion"], r.get("device"))
    elif kind == "decode_profile_total":
        print(label, "profile kernels/step", r["kernels_per_step"], "us/step", r["kernel_us_per_step"])
    elif kind == "decode_profile" and r["us_per_step"] >= 2:
        print(label, "  ", r["kernel"][:60], r["calls_per_step"], r["us_per_step"])
' "$1"
}
first() {
  python3 -m pytest -m gpu kernels/tests/test_op_quant_decode_gemv.py -q -x -p no:cacheprovider 2>&1 | tail -2
  python3 -m pytest -m gpu packages/inference/tests/test_gpu.py -k fused_quantized -q -x -p no:cacheprovider 2>&1 | tail -2
  $B --decode-fusion on 2>/dev/null | summary bf16-fused
  $B --weights int4 --decode-fusion off 2>/dev/null | summary int4-unfused
  $B --weights int4 --quant-pdl off --profile 16 2>/dev/null | summary int4-fused
  $B --weights int4 --quant-pdl on 2>/dev/null | summary int4-fused-pdl
  $B --weights int4 --quant-pdl basic 2>/dev/null | summary int4-fused-pdl-basic
}
second() {
  $B --weights int8 --decode-fusion off --profile 16 2>/dev/null | summary int8-unfused
  $B --weights int8 --quant-pdl off --profile 16 2>/dev/null | summary int8-fused
  $B --weights int8 --quant-pdl on 2>/dev/null | summary int8-fused-pdl
  $B --weights int4 --lm-head --quant-pdl off --profile 16 2>/dev/null | summary int4-head-fused
  $B --weights int4 --lm-head --quant-pdl on 2>/dev/null | summary int4-head-fused-pdl
}
if [ "${1:-}" = split ]; then
  CUDA_VISIBLE_DEVICES=0 first > /tmp/qfa_first.txt 2>&1 &
  CUDA_VISIBLE_DEVICES=1 second > /tmp/qfa_second.txt 2>&1 &
  wait
  cat /tmp/qfa_first.txt /tmp/qfa_second.txt
else
  first
  second
fi
