#!/usr/bin/env bash
# Quantized decode GPU jobs (helper q4) on a 2-GPU host: two single-GPU jobs at once, compact
# output. Usage from the repository root: bash tools/bench/quant_decode_call.sh PHASE [TABLE]
#   profile : GPU0 int4 then bf16, GPU1 int8 then int4 + int4 LM head: infer_bench rows and
#             --profile per-kernel / per-GEMV-shape breakdowns (~3.5 min)
#   sweep   : GPU0 quant_decode_bench int4, GPU1 the fused-kernel GPU tests then int8; tables
#             in $OUT (or /tmp) as quant_decode_table_{int4,int8}.json (~3 min)
#   sweepbench: GPU0 int4 / GPU1 int8: the sweep, then infer_bench (that format + bf16, one
#             process) with the table it wrote, profiled (~4.5 min)
#   table   : GPU0 int4 / GPU1 int8 with TABLE (quant.weight.decode_gemv_table) beside the
#             same run without it, then bf16 on GPU0 (~4 min)
#   variants: one GPU: int4 step timings, a quick int4 sweep, launch variants beside bf16
#             (quant_decode_variants.py), ~3.5 min
#   variants2: one GPU: a sweep with the prologue/epilogue fields, variants on top of the
#             built-in H100 int4 launches, the final call's int4 + bf16 run, ~4 min
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\n' ':')
OUT=${OUT:-/tmp}
B=${B:-"python3 tools/bench/infer_bench.py --batch 1 --skip-hf-eager --skip-hf-compiled --new-tokens 32 --repeats 1"}
KEEP='"result": "(copy_bandwidth|slipstream|model|kv_cache_sized_for_profile|decode_profile_total|decode_profile|decode_profile_gemv|decode_profile_gemv_total|decode_profile_gemv_skipped|precompile|best|error|wrong|table)"|Error|error|passed|failed'

bench() {  # label, args...: one infer_bench run, its rows (decode_profile: the top 14 kernels)
    local label=$1
    shift
    echo "### $label: $*"
    $B "$@" 2>&1 | grep -E "$KEEP" \
        | awk '/"result": "decode_profile_total"/ { n = 0 } /"result": "decode_profile",/ { if (++n > 14) next } { print }' \
        | cut -c1-600
}

export B KEEP OUT
export -f bench
gpu0() { CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 bash -c "$1" > "$OUT/q4_gpu0.txt" 2>&1 & }
gpu1() { CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash -c "$1" > "$OUT/q4_gpu1.txt" 2>&1 & }

case "${1:-}" in
b1)  # one GPU, ~2 min: int4, int8 and bf16 from one model in one process, each profiled
    bench int4+int8+bf16 --weights int4 int8 native --profile 16
    exit 0
    ;;
b2)  # one GPU, ~3 min: a quick sweep of both formats (the block shapes), then the 8B step
    # (int4, int8, bf16 in one process) with the table it wrote
    Q=${Q:-"python3 tools/bench/quant_decode_bench.py --quick --format int4 int8 --shapes qkv out gate_up down --budget-s 45 --compile-workers 14"}
    echo "### sweep: $Q"
    $Q --table-out "$OUT/quant_decode_table.json" 2>&1 | grep -E "$KEEP" | cut -c1-900
    python3 -c "import json, sys; [print(json.dumps(e)) for e in json.load(open(sys.argv[1]))['entries']]" \
        "$OUT/quant_decode_table.json"
    bench int4+bf16+int8+table --weights int4 native int8 --quant-decode-table "$OUT/quant_decode_table.json"
    exit 0
    ;;
variants)  # one GPU, ~3.5 min: (1) the int4 + bf16 step with per-call timings (device-clock
    # decode steps beside the old difference measure), (2) a quick int4 sweep of the block
    # shapes writing a table, (3) int4 launch variants (that table whole and per part, PDL
    # modes) interleaved with bf16 in one process (quant_decode_variants.py)
    echo "### timing: --weights int4 native --repeats 3"
    $B --new-tokens 64 --repeats 3 --weights int4 native 2>&1 \
        | grep -E '"result": "(copy_bandwidth|decode_timing|slipstream)"|Error' \
        | sed -E 's/, "(preset|dtype|tp|allreduce|offload|use_triton|prompt|gemv_layout|gemv_table|decode_gemv_table|decode_pdl|quant_pdl|quant_decode_table|lm_head_quantized|end_to_end_tokens_per_s|cuda_graph|note)": [^,]*//g' \
        | cut -c1-700
    T=$OUT/quant_decode_table_int4.json
    Q=${Q:-"python3 tools/bench/quant_decode_bench.py --quick --format int4 --shapes qkv out gate_up down --budget-s 40 --compile-workers 12"}
    echo "### sweep: $Q"
    $Q --table-out "$T" 2>&1 | grep -E "$KEEP" | cut -c1-900
    # the norm statistics in one load (QKV, gate/up) and the epilogue's loads before the K loop
    EP=qkv:stats_one_pass=true,gate_up:stats_one_pass=true,qkv:early_epilogue=true
    EP=$EP,out:early_epilogue=true,down:early_epilogue=true
    echo "### variants"
    python3 tools/bench/quant_decode_variants.py --rounds 3 --repeats 2 bf16=bf16 int4= nopdl=pdl=off \
        table=table=$T l2early=pdl=l2_partial,early all=table=$T,pdl=l2_partial,early \
        t_qkv=table=$T,parts=qkv t_out=table=$T,parts=out t_gate_up=table=$T,parts=gate_up \
        t_down=table=$T,parts=down "ep=$EP" attnpdl=attnpdl "attnpdl_ep=attnpdl,$EP" \
        "all_ep=table=$T,pdl=l2_partial,early,$EP" "all_ep_attn=table=$T,pdl=l2_partial,attnpdl,$EP" 2>&1 \
        | grep -E '"result"|Error' | cut -c1-700
    if [ -n "${PROFILE:-}" ]; then  # the int4 step's kernels without PDL (no overlap)
        bench int4-nopdl-profile --weights int4 --quant-pdl off --profile 16 --new-tokens 32
    fi
    exit 0
    ;;
variants2)  # one GPU, ~4 min: (1) a sweep of the int4 block shapes with the prologue /
    # epilogue fields on every candidate (Triton pipelining too), (2) variants on top of the
    # built-in H100 int4 launches (now the default): those fields whole and per part, the new
    # sweep's table whole and per part, the previous default (the rule), beside bf16, (3) the
    # int4 + bf16 step as the final call runs it (--repeats 1)
    T2=$OUT/quant_decode_table_int4_ep.json
    Q=${Q:-"python3 tools/bench/quant_decode_bench.py --quick --pipelined --format int4 --shapes qkv out down gate_up --budget-s 60 --compile-workers 12 --min-gain 1.0"}
    echo "### sweep: $Q --fields stats_one_pass=true,early_epilogue=true"
    $Q --fields stats_one_pass=true,early_epilogue=true --table-out "$T2" 2>&1 \
        | grep -E "$KEEP" | cut -c1-900
    python3 -c "import json, sys; [print(json.dumps(e)) for e in json.load(open(sys.argv[1]))['entries']]" "$T2"
    EPQ=qkv:stats_one_pass=true,qkv:early_epilogue=true
    EPG=gate_up:stats_one_pass=true
    EPO=out:early_epilogue=true,down:early_epilogue=true
    echo "### variants"
    python3 tools/bench/quant_decode_variants.py --rounds 2 --repeats 2 bf16=bf16 int4= \
        old=rule "ep=$EPQ,$EPG,$EPO" "ep_qkv=$EPQ" "ep_gate_up=$EPG" "ep_out_down=$EPO" \
        t2=table=$T2 t2_qkv=table=$T2,parts=qkv t2_out=table=$T2,parts=out \
        t2_down=table=$T2,parts=down t2_gate_up=table=$T2,parts=gate_up early=early \
        l2p=pdl=l2_partial,noearly "ep_early=$EPQ,$EPG,$EPO,early" 2>&1 \
        | grep -E '"result"|Error' | cut -c1-700
    echo "### timing: --weights int4 native --repeats 1"
    $B --new-tokens 64 --repeats 1 --weights int4 native 2>&1 \
        | grep -E '"result": "(copy_bandwidth|decode_timing|slipstream)"|Error' \
        | sed -E 's/, "(preset|dtype|tp|allreduce|offload|use_triton|prompt|gemv_layout|gemv_table|decode_gemv_table|decode_pdl|quant_pdl|quant_decode_table|lm_head_quantized|end_to_end_tokens_per_s|cuda_graph|note)": [^,]*//g' \
        | cut -c1-700
    exit 0
    ;;
profile)
    gpu0 'bench int4 --weights int4 --profile 24; bench bf16 --weights native --profile 24'
    gpu1 'bench int8 --weights int8 --profile 24; bench int4+head --weights int4 --lm-head'
    ;;
sweep)
    export S="python3 tools/bench/quant_decode_bench.py --budget-s 80 --compile-workers 14"
    gpu0 '$S --format int4 --table-out $OUT/quant_decode_table_int4.json 2>&1 | grep -E "$KEEP" | cut -c1-900'
    gpu1 'python3 -m pytest -q -m gpu kernels/tests/test_op_quant_decode_gemv.py -k split 2>&1 | tail -3
          $S --format int8 --table-out $OUT/quant_decode_table_int8.json 2>&1 | grep -E "$KEEP" | cut -c1-900' 
    ;;
sweepbench)  # per GPU: the sweep of one format, then the 8B step with its table beside bf16
    export S="python3 tools/bench/quant_decode_bench.py --budget-s 70 --compile-workers 14"
    gpu0 '$S --format int4 --table-out $OUT/quant_decode_table_int4.json 2>&1 | grep -E "$KEEP" | cut -c1-900
          bench int4+table --weights int4 native --quant-decode-table $OUT/quant_decode_table_int4.json --profile 16'
    gpu1 '$S --format int8 --table-out $OUT/quant_decode_table_int8.json 2>&1 | grep -E "$KEEP" | cut -c1-900
          bench int8+table --weights int8 native --quant-decode-table $OUT/quant_decode_table_int8.json --profile 16'
    ;;
table)
    export T=${2:?table JSON path}
    gpu0 "bench int4 --weights int4; bench int4+table --weights int4 --quant-decode-table $T --profile 24; bench bf16 --weights native"
    gpu1 "bench int8 --weights int8; bench int8+table --weights int8 --quant-decode-table $T --profile 24"
    ;;
*)
    echo "usage: $0 profile|sweep|table TABLE" >&2
    exit 2
    ;;
esac
wait
echo "=== GPU0"; cat "$OUT/q4_gpu0.txt"
echo "=== GPU1"; cat "$OUT/q4_gpu1.txt"
