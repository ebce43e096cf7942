#!/usr/bin/env bash
# Session 7, last H200 call: (1) the sampler defaults A/B (issue #7): today's default vs
# hash/sort/floor vs + two-stage row reductions (REDUCE_CHUNKS), with the row_reduce device
# check first; (2) the Mosaic swap-AB decode GEMM on the large shapes (issue #4); (3) the
# 256-row engine-step profile (1000/1000 step time question).  OUT=... bash scripts/gpu_call_s7d.sh
set -u
source scripts/gpu_call_lib.sh
TAIL=8 run row-reduce 60 python3 -u benchmarks/row_reduce_check.py --chunks 64,128,256
TAIL=40 run sampling 120 python3 -u benchmarks/sampling_cost.py --out "$OUT/records" \
  --modes variant --mixes top_p top_k_top_p all greedy temperature half_greedy_half_all logprobs \
  --batches 256 1 --iters 10 --trace-iters 5 --step-ms-b1 4.8 --step-ms-b256 16 \
  --buffer-method sort --draw-method threefry,hash --select-method topk,sort --nucleus-floor 0,1 \
  --reduce-chunks 0,128 --configs threefry/topk,hash/sort/floor,hash/sort/floor/rc128 \
  --breakdown top_p:256 --deadline-s 95
TAIL=30 run mdec 150 python3 -u benchmarks/kernels/bench_matmul.py --plan mdec --ms 1,64 \
  --shapes 8b_gate_up,70b_up,8b_down --ceilings bw --budget 110 --out "$OUT/records/mm"
ENG="--model dummy:llama-3.1-8b --load-format dummy --dtype bfloat16 --attention-backend pallas
  --max-model-len 4352 --max-num-seqs 256 --decode-buckets 256 --max-num-batched-tokens 1024
  --prefill-buckets 1024 --max-prefill-seqs 1 --num-kv-pages 36000"
# shellcheck disable=SC2086
run compile-prof 60 $JI compile $ENG --cache-dir /tmp/pc --jobs 14
TAIL=70 run profile-b256 ${PROF_SECS:-200} python3 -u benchmarks/profile_decode.py \
  --out "$OUT/records/prof" --batch 256 --ctx 1024 --steps 10 --max-model-len 4352 \
  --num-kv-pages 36000 --host-profile --cache-dir /tmp/pc
