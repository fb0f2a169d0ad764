#!/usr/bin/env bash
# One device call that does a session's GPU work: the test suite, the benchmark grid and the
# long-context run, logs under $OUT (the device tool returns at most 8 files).
#   bash benchmarks/gpu_session.sh [tests] [bench] [long] [sm90] [sm90-bwd] [sm90-bwd-fused] [decode] [tune-decode] [tests-sm90] [sanitize] [tune-fwd] [tune-bwd] [serving] [chunked] [tune-decode-graph] [racecheck-ws] [profile-fwd] [bench-fp16] [sm90-decode] [host] [profile-decode] [tune-sm90-decode] [sm90-decode-merge] [sm90-persistent] [tune-sm90] [profile-bwd] [d256] [sm90-bwd-order] [sm90-wg3p] [sm90-bwd-d256] [tests-variants] [sm90-bwd-seg] [sm90-bwd-rowstats] [host-graph] [sm90-wg3pp] [sm90-pp128] [sm90-exp-early] [sm90-bwd-exp-early] [sm90-decode-fp8] [profile-fwd64] [warm] [sm90-decode-balanced] [sm90-softcap] [softcap-bench] [padded-bench] [pad-tma-bench] [fwd16k] [pad-tests] [dmon] [decode-pdl] [sdpa-bench] [lpt] [parts] [pad-narrow] [bwd-ncu] [bwd-tma-store] [fwd-o-tma] [fwd-o-defer] [decode-prefetch] [bwd-stages] [bwd-rows] [tests-sm90file] [tests-rest] [fwd-q-bufs] [fwd-q-bufs-bench] [profile-decode-mem] [profile-decode-whole] [fwd-q-bufs-d64] [decode-grid] [tail-shapes] [profile-decode-sections] [tune-kvcache-splits] [sched-probe] [decode-claim] [loader] [read-probe] [d256-persistent] [shallow] [mma16] [early] [short] [d256-decode] [short-bench] [bind-tests] [pending] [short-timeline] [short-forms] [counters] [decode-accept] [fp8] [fp8-sm90] [tune-fp8] [cudnn-names] [fp8-sm90-forms] [q-regs]   (default: tests bench long)
# TUNE_FWD_ARGS / TUNE_BWD_ARGS replace the sweeps' shape arguments (default --seqlens 2048,8192).
# Pass IOATTN_GIT_COMMIT=<hash> literally: the device machine's copy of .git can be stale, so
# `git rev-parse` there names an older commit.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD IOATTN_GIT_COMMIT=${IOATTN_GIT_COMMIT:-unknown}
OUT=${OUT:-/tmp/ioattn_out}; mkdir -p "$OUT"
# the card in result names (nvidia-h200 / nvidia-h100): a call named for the H200 may get an H100
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h[0-9]{3}' \
  | tr 'A-Z' 'a-z'); GPU_TAG=nvidia-${GPU_TAG:-gpu}
steps=${*:-tests bench long}
# bench_with "VAR=V [VAR=V ...]" NAME ARGS...: `python -m ioattn bench ARGS` under those
# settings, cuDNN beside ioattn's sm90 backend, into $OUT/NAME.json; prints the rows
bench_with() {  # cuDNN in every setting's run: timed alone, a setting without it ran up to
  # ~10% apart in cells the switch does not reach (session 19), so each run keeps the same company
  local e=$1 name=$2; shift 2
  env $e timeout 200 python -m ioattn bench "$@" --impls ioattn_sm90,sdpa_cudnn \
    --no-plots --out "$OUT/$name.json" > "/tmp/$name.log" 2>&1
  echo "== $name $e"; grep -E "^(fwd|bwd)" "/tmp/$name.log"; }
# onoff VAR "V1 V2 ..." NAME ARGS...: bench_with once per value of VAR, into $OUT/NAME<value>.json
onoff() {
  local var=$1 values=$2 name=$3 v; shift 3
  for v in $values; do bench_with "$var=$v" "$name$v" "$@"; done; }
# timelines NAME "VAR=V ..." ["D [--causal]|..."]: the stamped 2k forward once per setting
# (default cells: d=128 non-causal and causal), into
# $OUT/fwd_timeline_NAME_<var_v>_d<D>_2048[_causal].json; prints the tile, kernel, Q-wait,
# first-block and store times
timelines() {
  local name=$1 settings=$2 cells=${3:-"128|128 --causal"} e dc d c tag
  for e in $settings; do IFS='|' read -ra dcs <<< "$cells"; for dc in "${dcs[@]}"; do
    read -r d c <<< "$dc"
    tag=$(echo "${e#IOATTN_SM90_}" | tr 'A-Z=' 'a-z_')
    env "$e" timeout 60 python benchmarks/timeline.py --kernel fwd --d "$d" --seqlen 2048 $c \
      --json "$OUT/fwd_timeline_${name}_${tag}_d${d}_2048${c:+_causal}.json" > /tmp/timeline.log 2>&1
    echo "== $e timeline d=$d 2048 $c"
    grep -E '^note:|"tile_us"|"kernel_us"|"q_wait"|"first"|"store"' /tmp/timeline.log | head -10
  done; done; }
# decode_onoff VAR NAME: graph replays of five decode cells (DECODE_CELLS, or the older name
# SHALLOW_CELLS) on the sm90 kernel,
# VAR=1 / 0 interleaved twice (each round reversed), into $OUT/tune_decode_NAME<v>_<round>.json
decode_onoff() {
  local var=$1 name=$2 r v order
  for r in 1 2; do order="1 0"; [ $r = 2 ] && order="0 1"; for v in $order; do
    env "$var=$v" timeout 100 python benchmarks/tune_decode.py --sm90 \
      --per-sm auto --block-n 64 --stages 3 --grid-extra auto \
      --cells "${DECODE_CELLS:-${SHALLOW_CELLS:-64x4096x16,16x8192x16,1x32768x16,128x2048x16,12x8192x16}}" \
      --json "$OUT/tune_decode_${name}${v}_$r.json" > "/tmp/tune_decode_${name}${v}_$r.log" 2>&1
    echo "$name $v round $r:"; grep "^== best" "/tmp/tune_decode_${name}${v}_$r.log" | sort -u
  done; done; }
for step in $steps; do
  case $step in
    tests) # 14 workers: a cold Triton cache took more than 240 s with 8 (and 450 s ran 684 of ~690, session 16;
           # 455 s for 781 in session 20, before ~90 more opt-in cases: the limit is 580 of the call's 600);
           # -v: each result on its own line as it lands, so a run cut at its limit still names
           # its failures (session 19's was cut before the summary)
           # (session 21: 780 of 784 reported at the 580 s cut, cold; tests-sm90file + tests-rest
           # run the same suite in two calls; --durations: the slowest 25 in the log, since
           # tests-rest took 472 s of its 580 at 1248a25 and the suite only grows)
           timeout 580 python -m pytest -v -n 14 -p no:cacheprovider -rf --durations=25 tests > "$OUT/tests_gpu.log" 2>&1
           grep -E "FAILED|ERROR" "$OUT/tests_gpu.log" | head -20; tail -1 "$OUT/tests_gpu.log" ;;
    tests-sm90file|tests-rest) # the suite in two calls: four of tests/dense/test_sm90.py's
           # families, then everything else (session 22: the whole file took 515 s of a 580 s
           # limit cold, the rest 95 s, before the Q_BUFS persistent cases; the names
           # selected occur in that file only)
           fam="persistent_fwd or row_stats or three_warpgroups or fused_bwd"
           if [ "$step" = tests-sm90file ]; then sel=(tests/dense/test_sm90.py -k "$fam")
           else sel=(tests -k "not ($fam)"); fi
           timeout 580 python -m pytest -v -n 14 -p no:cacheprovider -rf --durations=25 "${sel[@]}" > "$OUT/$step.log" 2>&1
           grep -E "FAILED|ERROR" "$OUT/$step.log" | head -20; tail -1 "$OUT/$step.log" ;;
    warm)  # the compile caches (Triton's, inductor's for Flex) filled by six processes at once,
           # one per head dim and mode, before a timed run: `warm bench` (WARM_DTYPES=fp16 before
           # bench-fp16, 120 + 460 s in one call); a cold bench spent its first minutes compiling
           # (waits for its own six only: `dmon` before it runs in the background too).
           # WARM_TIMEOUT (default 120 s): session 22's fp16 warm-up hit 120 s on caches warm
           # for bf16 only, and bench-fp16 then compiled the rest and ran out of its 460 s one
           # cell short; on such caches run `WARM_DTYPES=fp16 WARM_TIMEOUT=300 warm` in one call
           # and bench-fp16 in the next
           pids=(); for d in 64 128 256; do for m in fwd bwd; do
             timeout "${WARM_TIMEOUT:-120}" python -m ioattn bench --modes $m --dims $d --dtypes ${WARM_DTYPES:-bf16} \
               --warmup 1 --rep 1 --no-plots --out /tmp/warm_${m}_$d.json > /tmp/warm_${m}_$d.log 2>&1 &
             pids+=($!); done; done; wait "${pids[@]}"; echo "warm: done" ;;
    bench) # 5 rounds of 50 ms per impl and cell (BENCH_ROUNDS / BENCH_REP; 3 x 33 ms before
           # session 25): two runs of record an hour apart at 1248a25 / d27c47a moved single
           # cells' ratios by up to 8% (d=256 non-causal 2k 0.92 / 1.00), each impl's time taken
           # from ~10-30 calls a round under a power-capped clock; ~+75 s of timing
           timeout 460 python -m ioattn bench --modes fwd,bwd --dims 64,128,256 --dtypes bf16 \
             --rounds ${BENCH_ROUNDS:-5} --rep ${BENCH_REP:-250} \
             --out "$OUT/dense_${GPU_TAG}_$(date +%F).json" > "$OUT/bench.log" 2>&1
           grep -E "geomean" "$OUT/bench.log" ;;
    long)  timeout 120 python benchmarks/long_context.py --out "$OUT" > "$OUT/long.log" 2>&1
           cat "$OUT/long.log" ;;
    sm90)  timeout 200 python -m ioattn bench --modes fwd --dims 64,128 --seqlens 2048,8192,16384 --dtypes bf16 \
             --impls ioattn,ioattn_sm90,ioattn_triton,sdpa_cudnn,flex --no-plots \
             --out "$OUT/sm90_fwd_quick_${GPU_TAG}_$(date +%F).json" > "$OUT/sm90_quick.log" 2>&1
           grep -E "^fwd|geomean" "$OUT/sm90_quick.log" ;;
    sm90-bwd) timeout 240 python -m ioattn bench --modes bwd --dims 64,128 --seqlens 2048,8192,16384 --dtypes bf16 \
             --impls ioattn,ioattn_sm90,ioattn_triton,sdpa_cudnn,flex --no-plots \
             --out "$OUT/sm90_bwd_quick_${GPU_TAG}_$(date +%F).json" > "$OUT/sm90_bwd_quick.log" 2>&1
           grep -E "^bwd|geomean" "$OUT/sm90_bwd_quick.log" ;;
    decode) timeout 420 python -m ioattn bench --suite decode \
             --out "$OUT/decode_${GPU_TAG}_$(date +%F).json" > "$OUT/decode.log" 2>&1
           grep -vE "^/" "$OUT/decode.log" | tail -70 ;;
    decode-accept) # the decode suite on issue 4's acceptance cells only (64 x 4k and 1 x 32k at
           # page 16, 64 x 4k at page 1, chunked prefill 8 x 4k + 512 at page 16): ~3 min cold
           # where the whole suite takes ~7, for a call after `warm bench`
           timeout 300 python -m ioattn bench --suite decode --cells 64x4096x16,1x32768x16,64x4096x1 \
             --prefill-cells 8x4096x512x16 \
             --out "$OUT/decode_accept_${GPU_TAG}_$(date +%F).json" > "$OUT/decode_accept.log" 2>&1
           grep -vE "^/" "$OUT/decode_accept.log" | tail -40 ;;
    fp8)   # the fp8 forward (portable kernel, e4m3 wgmma): its tests and the sm90 compile
           # check, then the FA grid's forward from 2k with block and per-head descales beside
           # ioattn's bf16 call, cuDNN, FA2 and Flex on the same (bf16) data (FP8_DIMS,
           # FP8_SEQLENS, FP8_IMPLS narrow it)
           timeout 200 python -m pytest -q -n 8 -p no:cacheprovider tests/dense/test_fp8.py \
             tests/dense/test_sm90_compile.py > "$OUT/tests_fp8.log" 2>&1
           grep -E "FAILED|ERROR" "$OUT/tests_fp8.log" | head; tail -1 "$OUT/tests_fp8.log"
           timeout 380 python -m ioattn bench --modes fwd --dims "${FP8_DIMS:-64,128,256}" \
             --seqlens "${FP8_SEQLENS:-2048,4096,8192,16384}" --rounds 3 --no-plots \
             --impls "${FP8_IMPLS:-ioattn,ioattn_fp8,ioattn_fp8_head,sdpa_cudnn,sdpa_flash,flex}" \
             --out "$OUT/fp8_${GPU_TAG}_$(date +%F).json" > "$OUT/fp8.log" 2>&1
           grep -E "^fwd" "$OUT/fp8.log" | head -60; tail -3 "$OUT/fp8.log" ;;
    fp8-sm90) # the sm90 fp8 forward (IOATTN_SM90_FP8=1, opt-in): its GPU tests and the
           # compile check, then the FA grid's forward with per-head descales (ioattn_fp8_head:
           # the sm90 form) beside block descales (ioattn_fp8: the portable kernel), the bf16
           # call, cuDNN and FA2 (FP8_DIMS / FP8_SEQLENS narrow it; ~1.5 + 6 min cold)
           IOATTN_SM90_FP8=1 IOATTN_SM90_FP8_BLOCK=1 IOATTN_SM90_FP8_VARLEN=1 timeout 240 python -m pytest -q -n 12 -p no:cacheprovider -rf \
             tests/dense/test_fp8.py tests/dense/test_sm90_compile.py -k "sm90" \
             > "$OUT/tests_fp8_sm90.log" 2>&1
           grep -E "^FAILED|^ERROR" "$OUT/tests_fp8_sm90.log" | head; tail -1 "$OUT/tests_fp8_sm90.log"
           IOATTN_SM90_FP8=1 timeout 340 python -m ioattn bench --modes fwd \
             --dims "${FP8_DIMS:-64,128,256}" --seqlens "${FP8_SEQLENS:-2048,4096,8192,16384}" \
             --rounds 3 --no-plots \
             --impls "${FP8_IMPLS:-ioattn,ioattn_fp8,ioattn_fp8_head,sdpa_cudnn,sdpa_flash}" \
             --out "$OUT/fp8_sm90_${GPU_TAG}_$(date +%F).json" > "$OUT/fp8_sm90.log" 2>&1
           grep -E "^fwd" "$OUT/fp8_sm90.log" | head -60; tail -3 "$OUT/fp8_sm90.log" ;;
    tune-fp8) # the fp8 forward's tile configs (tune.py --mode fwd-fp8), cuDNN / FA2 / Flex
           # on the bf16 data beside
           timeout 400 python benchmarks/tune.py --mode fwd-fp8 --dims "${FP8_DIMS:-64,128,256}" \
             --seqlens "${FP8_SEQLENS:-2048,16384}" --json "$OUT/tune_fp8.json" > "$OUT/tune_fp8.log" 2>&1
           cat "$OUT/tune_fp8.log" | tail -80 ;;
    sm90-bwd-fused) # the fused backward (dQ writer warp): its tests, then fused / two-kernel timed
           IOATTN_SM90_FUSED_BWD=1 timeout 120 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/dense/test_sm90.py > "$OUT/tests_fused_bwd.log" 2>&1; tail -1 "$OUT/tests_fused_bwd.log"
           if [ -n "${FUSED_FULL:-}" ]; then  # the whole dense suite through it (4 more minutes)
             IOATTN_SM90_FUSED_BWD=1 IOATTN_TEST_SM90=always timeout 240 python -m pytest -q -n 8 \
               -p no:cacheprovider tests/dense >> "$OUT/tests_fused_bwd.log" 2>&1
             tail -1 "$OUT/tests_fused_bwd.log"; fi
           for f in 1 0; do IOATTN_SM90_FUSED_BWD=$f timeout 150 python -m ioattn bench --modes bwd \
             --dims 64,128 --seqlens 2048,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn --no-plots \
             --out "$OUT/sm90_bwd_fused_writer${f}_${GPU_TAG}_$(date +%F).json" > "$OUT/fused$f.log" 2>&1
             echo "fused=$f"; grep -E "^bwd" "$OUT/fused$f.log"; done ;;
    tune-decode) timeout 200 python benchmarks/tune_decode.py --json "$OUT/tune_decode.json" > "$OUT/tune_decode.log" 2>&1
           grep "^==" "$OUT/tune_decode.log"
           timeout 60 python benchmarks/tune_decode.py --profile --json "$OUT/profile_decode.json" \
             > "$OUT/profile_decode.log" 2>&1; grep "^{" "$OUT/profile_decode.log" | cut -c1-220 ;;
    tests-sm90) IOATTN_TEST_SM90=always timeout 240 python -m pytest -q -n 8 -p no:cacheprovider tests/dense \
             > "$OUT/tests_sm90_forced.log" 2>&1; tail -1 "$OUT/tests_sm90_forced.log" ;;
    sanitize) for tool in memcheck racecheck; do
               timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python benchmarks/sanitize_cases.py \
                 > "$OUT/sanitize_$tool.log" 2>&1; echo "$tool rc=$?"; tail -2 "$OUT/sanitize_$tool.log"; done ;;
    tune-fwd) timeout 300 python benchmarks/tune.py --mode fwd ${TUNE_FWD_ARGS:---seqlens 2048,8192} --json "$OUT/tune_fwd.json" \
                > "$OUT/tune_fwd.log" 2>&1; grep -E "^==|TFLOP|ERR" "$OUT/tune_fwd.log" ;;
    tune-bwd) timeout 300 python benchmarks/tune.py --mode bwd ${TUNE_BWD_ARGS:---seqlens 2048,8192} --json "$OUT/tune_bwd.json" \
                > "$OUT/tune_bwd.log" 2>&1; grep -E "^==|TFLOP|ERR" "$OUT/tune_bwd.log" ;;
    serving) timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/paged tests/decode \
             > "$OUT/tests_serving.log" 2>&1; tail -1 "$OUT/tests_serving.log" ;;
    chunked) timeout 150 python -m ioattn bench --suite decode --cells 128x2048x16 \
             --prefill-cells 8x4096x512x16,8x4096x512x64,8x4096x128x16 \
             --out "$OUT/chunked_${GPU_TAG}_$(date +%F).json" > "$OUT/chunked.log" 2>&1
           grep chunked "$OUT/chunked.log" ;;
    tune-decode-graph) timeout 240 python benchmarks/tune_decode.py --graph \
             --cells 1x32768x16,16x8192x16,64x4096x16 --block-n 64,128 --warps 4 --stages 2,4,5 \
             --per-sm 1,2,4 --json "$OUT/tune_decode_graph.json" > "$OUT/tune_decode_graph.log" 2>&1
           grep "^==" "$OUT/tune_decode_graph.log" ;;
    racecheck-ws) timeout 100 compute-sanitizer --tool racecheck python benchmarks/sanitize_ws_minimal.py \
             > "$OUT/racecheck_ws.log" 2>&1; tail -3 "$OUT/racecheck_ws.log" ;;
    profile-fwd) # ncu on one sm90 forward (d=128 non-causal 8k): pipe utilization, stalls per SASS line
           timeout 200 ncu --clock-control none -k regex:attn_fwd_sm90 --launch-skip 2 --launch-count 1 \
             --set full --import-source no -o "$OUT/fwd128" python benchmarks/profile_fwd.py --d 128 \
             --seqlen 8192 > "$OUT/ncu_run.log" 2>&1; tail -2 "$OUT/ncu_run.log"
           ncu --import "$OUT/fwd128.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
           ncu --import "$OUT/fwd128.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
           grep -E "Duration|Tensor is|Issue Slots|No Eligible" "$OUT/ncu_details.txt" ;;
    bench-fp16) timeout 460 python -m ioattn bench --modes fwd,bwd --dims 64,128,256 --dtypes fp16 \
             --rounds ${BENCH_ROUNDS:-5} --rep ${BENCH_REP:-250} \
             --out "$OUT/dense_fp16_${GPU_TAG}_$(date +%F).json" > "$OUT/bench_fp16.log" 2>&1
           grep -E "geomean" "$OUT/bench_fp16.log" ;;
    sm90-decode) # the Gluon decode kernel (default on Hopper): its tests, then the decode suite on / off
           IOATTN_SM90_DECODE=1 timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/decode/test_decode_sm90.py > "$OUT/tests_sm90_decode.log" 2>&1
           tail -1 "$OUT/tests_sm90_decode.log"
           for dec in 1 0; do IOATTN_SM90_DECODE=$dec timeout 200 python -m ioattn bench --suite decode \
             --out "$OUT/decode_sm90dec${dec}_${GPU_TAG}_$(date +%F).json" > "$OUT/decode_sm90dec$dec.log" 2>&1
             echo "sm90 decode=$dec"; grep -vE "^/" "$OUT/decode_sm90dec$dec.log" | grep -E "x4096|x8192|x32768" | head -12; done ;;
    host)  # host time per call (eager): public calls, op layers, decode run()
           timeout 120 python benchmarks/host_overhead.py --json "$OUT/host_overhead_${GPU_TAG}.json" \
             > "$OUT/host.log" 2>&1; head -38 "$OUT/host.log" ;;
    counters) # (session 38) the sm90 forward's host time: its GPU tests (kept launches keyed
           # by the op's signature, the stream counters), the host rows (fwd_sm90_opkey0/1,
           # _counters1), then the 512 / 1k cells with IOATTN_SM90_FWD_STREAM_COUNTERS=0 / 1
           # (cuDNN beside both), d=128 512 through auto, and the d=128 512 cells eager against
           # graph replays (~6 min)
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             tests/dense/test_bind.py -k "bind or stream_counters or wiring" > "$OUT/tests_counters.log" 2>&1
           grep -E "FAILED|ERROR" "$OUT/tests_counters.log" | head; tail -1 "$OUT/tests_counters.log"
           timeout 120 python benchmarks/host_overhead.py --json "$OUT/host_overhead_${GPU_TAG}.json" \
             > "$OUT/host.log" 2>&1; grep -E "sm90|triton_bind1|sdpa" "$OUT/host.log" | head -30
           onoff IOATTN_SM90_FWD_STREAM_COUNTERS "0 1" counters --modes fwd --dims 64,128 \
             --seqlens 512,1024 --dtypes bf16 --rounds 3
           # `auto` (the portable kernel at d=128 512) beside sm90 and cuDNN: the rule's question
           timeout 120 python -m ioattn bench --modes fwd --dims 128 --seqlens 512 --dtypes bf16 \
             --impls ioattn,ioattn_sm90,sdpa_cudnn --no-plots --rounds 3 \
             --out "$OUT/short_auto_${GPU_TAG}.json" > /tmp/short_auto.log 2>&1
           grep -E "^fwd" /tmp/short_auto.log
           for c in 0 1; do IOATTN_SM90_FWD_STREAM_COUNTERS=$c timeout 90 python \
             benchmarks/host_overhead.py --graph --graph-seqlens 512 --graph-backend sm90 \
             --graph-dims 128 --graph-modes fwd --json "$OUT/host_graph_counters$c.json" \
             > "/tmp/host_graph_counters$c.log" 2>&1; echo "== counters $c"
             grep -E "^fwd d" "/tmp/host_graph_counters$c.log"; done ;;
    host-graph) # the FA-grid 2k cells under the benchmark's timer and as graph replays (host share)
           timeout 300 python benchmarks/host_overhead.py --graph \
             --json "$OUT/host_graph_${GPU_TAG}.json" > "$OUT/host_graph.log" 2>&1
           grep -E "^(fwd|bwd) d" "$OUT/host_graph.log" ;;
    d256-decode) # head dim 256 on the sm90 decode kernel (IOATTN_SM90_DECODE_D256, the default):
           # its GPU tests, then GQA 16 / 8 heads at d=256 (the hidden size of the d=128 cells),
           # the sm90 kernel (1) against the portable one (0), cuDNN beside both (~4 min)
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/decode/test_decode_sm90.py \
             -k "d256" > "$OUT/tests_decode_d256.log" 2>&1; echo "tests: $(tail -1 "$OUT/tests_decode_d256.log")"
           # (240 s each: session 36's first try, at 150, was cut while compiling cold)
           for v in 1 0; do IOATTN_SM90_DECODE_D256=$v timeout 240 python -m ioattn bench --suite decode \
               --dim 256 --heads 16,8 --cells 64x4096x16,16x8192x16,1x32768x16,128x2048x16 \
               --prefill-cells "" --out "$OUT/decode_d256_sm90$v.json" > "$OUT/decode_d256_$v.log" 2>&1
             echo "== d256 sm90=$v"; grep -E "ioattn_paged |sdpa_cudnn |_graphloop" "$OUT/decode_d256_$v.log"; done ;;
    short) # the FA grid's short cells (s = 512 / 1k: forward 0.63-0.87x cuDNN, d=128 backward
           # 0.80x in dense_f341af4): the sm90 backend forced beside auto and cuDNN
           # (`short-bench`), then eager vs graph-replayed (host share), then the stamped d=128
           # forward at 512 and backward at 1k (`short-timeline`) (~8 min)
           bash "$0" short-bench
           timeout 300 python benchmarks/host_overhead.py --graph --graph-seqlens 512,1024 \
             --json "$OUT/host_graph_short_${GPU_TAG}.json" > "$OUT/host_graph_short.log" 2>&1
           grep -E "^(fwd|bwd) d" "$OUT/host_graph_short.log"
           bash "$0" short-timeline ;;
    short-forms) # (session 37) the sm90 forward's short-cell collapse: at d=128 512 a tile took
           # ~16 us with 4 key blocks (non-causal) and 2.5 (causal), as much as 8 blocks at 1k,
           # while d=64 non-causal (one Q buffer) and d=256 (one CTA a tile) kept their rate;
           # each suspect form switched off in turn, the sm90 backend forced, cuDNN beside the
           # default row only; then eager against graph-replayed (~7 min)
           for e in "" IOATTN_SM90_FWD_Q_BUFS=1 IOATTN_SM90_FWD_O_TMA=0 IOATTN_SM90_FWD_O_DEFER=0 \
               IOATTN_SM90_FWD_LPT=0 IOATTN_SM90_PERSISTENT=static IOATTN_SM90_PERSISTENT=0; do
             impls=ioattn_sm90; [ -z "$e" ] && impls=ioattn_sm90,sdpa_cudnn
             name=${e#IOATTN_SM90_}; name=${name//=/}; name=${name:-default}
             env $e timeout 150 python -m ioattn bench --modes fwd --dims 64,128 --seqlens 512,1024 \
               --dtypes bf16 --impls $impls --no-plots --rounds 3 \
               --out "$OUT/short_forms_${name}_${GPU_TAG}.json" > "$OUT/short_forms_$name.log" 2>&1
             echo "== $name"; grep -E "^fwd" "$OUT/short_forms_$name.log"
           done
           # the sm90 forward's default form eager (the benchmark's timer, host time included
           # where the GPU waits for it) against graph replays (kernel time only)
           timeout 240 python benchmarks/host_overhead.py --graph --graph-seqlens 512,1024 \
             --graph-backend sm90 --graph-dims 64,128 --graph-modes fwd \
             --json "$OUT/host_graph_short_sm90_${GPU_TAG}.json" > "$OUT/host_graph_short_sm90.log" 2>&1
           grep -E "^fwd d" "$OUT/host_graph_short_sm90.log" ;;
    short-timeline) # (session 36's short-cell findings) the stamped sm90 forward at d=128 512
           # (278 / 148 TFLOP/s non-causal / causal against cuDNN's 490 / 327: tile, Q-wait,
           # first-block and store times) and the stamped d=128 backward at 1k, non-causal and
           # causal (417 against 172: CTA phases, gaps between CTAs) (~3 min)
           for c in "" --causal; do timeout 60 python benchmarks/timeline.py --kernel fwd --d 128 \
               --seqlen 512 $c --json "$OUT/fwd_timeline_short_d128_512${c:+_causal}.json" \
               > /tmp/timeline_short.log 2>&1
             echo "== fwd timeline d=128 512 $c"
             grep -E '^note:|"tile_us"|"kernel_us"|"q_wait"|"first"|"store"' /tmp/timeline_short.log | head -10
             timeout 60 python benchmarks/timeline.py --kernel bwd --d 128 --seqlen 1024 $c \
               --json "$OUT/bwd_timeline_short_d128_1024${c:+_causal}.json" > /tmp/timeline.log 2>&1
             echo "== bwd timeline d=128 1k $c"; grep -A6 '"wg0_us"' /tmp/timeline.log | head -7
             grep -E '"cta_us"|"kernel_us"' /tmp/timeline.log | head -2
           done ;;
    profile-decode) # ncu: the planned decode's kernels and cuDNN's on the same cells (time, DRAM)
           for cell in 64x4096x16 1x32768x16; do
             timeout 150 ncu --clock-control none --csv --metrics \
               gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_read.sum.per_second \
               python benchmarks/profile_decode.py --cell $cell > "$OUT/ncu_decode_$cell.csv" 2>&1
             echo "== $cell"; grep -E "gpu__time|dram__bytes_read" "$OUT/ncu_decode_$cell.csv" \
               | awk -F'","' '{print $5, $(NF-2), $NF}' | cut -c1-150 | tail -24; done ;;
    profile-decode-mem) # issue 4's 64 x 4k cell (1.6% behind cuDNN in the kernel): ours and
           # cuDNN's kernels under ncu with where-the-time-goes metrics: DRAM throughput as a
           # share of its peak over the kernel, SM busy share (a tail shows as SMs idle while
           # the kernel runs), L2 read sectors and hit rate, occupancy, grid (~60 s)
           timeout 200 ncu --clock-control none --csv --metrics \
             gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,gpc__cycles_elapsed.max,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic \
             python benchmarks/profile_decode.py --cell 64x4096x16 > "$OUT/ncu_decode_mem_64x4096x16.csv" 2>&1
           grep -E '"(_decode_sm90|cudnn)' "$OUT/ncu_decode_mem_64x4096x16.csv" \
             | awk -F'","' '{print substr($5, 1, 24), $(NF-2), $NF}' | tail -40 ;;
    profile-decode-whole) # the 64 x 4k cell's kernels as in profile-decode-mem, plus ours over
           # the same K/V in other layouts, 4 launches each in this order: ours paged (NHD, page
           # 16, shuffled), cuDNN, ours over cuDNN's own K/V (HND, one page a request: the same
           # bytes in the same order), ours over a contiguous NHD cache (one page a request),
           # ours over HND pages of 16 (same table). Same DRAM share on cuDNN's layout as
           # paged: the kernel; higher: the layout, and the other two say which part (~90 s)
           timeout 200 ncu --clock-control none --csv --metrics \
             gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,gpc__cycles_elapsed.max,launch__grid_size \
             python benchmarks/profile_decode.py --cell 64x4096x16 --layouts hnd-whole,nhd-whole,hnd-paged > "$OUT/ncu_decode_whole_64x4096x16.csv" 2>&1
           grep -E '"(_decode|_worklist|_kvcache|_combine|cudnn)' "$OUT/ncu_decode_whole_64x4096x16.csv" \
             | awk -F'","' '{print $1, substr($5, 1, 16), $(NF-2), $NF}' | tail -80 ;;
    profile-decode-sections) # the 64 x 4k cell's gap is our kernel's request stream (session 25:
           # 91% of DRAM peak on every layout against cuDNN's 93-94%): ncu's memory, scheduler
           # and warp-state sections for ours (paged) and cuDNN's (sm80, cp.async), three
           # launches each, as text, to compare L2 / DRAM traffic and what the warps wait on (~90 s)
           timeout 240 ncu --clock-control none -k 'regex:_decode_sm90|cudnn' -c 6 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis \
             --section MemoryWorkloadAnalysis_Tables --section LaunchStats --section Occupancy \
             --section SchedulerStats --section WarpStateStats \
             python benchmarks/profile_decode.py --cell 64x4096x16 --reps 2 \
             > "$OUT/ncu_decode_sections_64x4096x16.txt" 2>&1
           grep -E "^  [_a-z]|Duration|DRAM Throughput|Mem(ory)? Busy|Max Bandwidth|L2 Hit Rate|Mem Pipes|Achieved Occupancy|No Eligible|Issued Warp|Warp Cycles Per Issued" \
             "$OUT/ncu_decode_sections_64x4096x16.txt" | head -120 ;;
    tune-kvcache-splits) # flash_attn_with_kvcache's decode (the portable split-KV kernel): its
           # split count timed per cell, eager and replayed (session 26 fitted num_splits_for,
           # one wave of 4 programs per SM, to it; ~1.5 min)
           # (KV_SPLITS / KV_CELLS replace the split counts and cells)
           timeout 200 python benchmarks/tune_decode.py --kvcache --splits "${KV_SPLITS:-0,1,2,3,4,8}" \
             --cells "${KV_CELLS:-16x8192x16,12x8192x16,8x8192x16,4x8192x16,64x4096x16,1x32768x16}" \
             --json "$OUT/tune_kvcache_splits.json" > "$OUT/tune_kvcache_splits.log" 2>&1
           grep "^== best" "$OUT/tune_kvcache_splits.log" ;;
    tune-sm90-decode) # the sm90 decode kernel's ring (keys per tile, stages) and items per SM
           timeout 300 python benchmarks/tune_decode.py --sm90 --cells 1x32768x16,16x8192x16,64x4096x16 \
             --block-n 32,64,128 --stages 2,3,4,6 --per-sm 1,2,4 --json "$OUT/tune_sm90_decode.json" \
             > "$OUT/tune_sm90_decode.log" 2>&1; grep "^==" "$OUT/tune_sm90_decode.log" ;;
    sm90-decode-merge) # split requests merged inside the sm90 decode kernel: tests, then on / off
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/decode/test_decode_sm90.py \
             > "$OUT/tests_decode_merge.log" 2>&1; tail -1 "$OUT/tests_decode_merge.log"
           for m in 1 0; do IOATTN_SM90_DECODE_MERGE=$m timeout 150 python -m ioattn bench --suite decode \
             --cells 1x32768x16,16x8192x16,64x4096x16 --prefill-cells "" \
             --out "$OUT/decode_merge${m}_${GPU_TAG}_$(date +%F).json" > "$OUT/decode_merge$m.log" 2>&1
             echo "merge=$m"; grep -E "ioattn_paged|cudnn" "$OUT/decode_merge$m.log"; done ;;
    sm90-persistent) # the persistent forward (dynamic scheduler / snake order): tests, then timed vs off
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/dense/test_sm90.py -k persistent \
             > "$OUT/tests_persistent.log" 2>&1; tail -1 "$OUT/tests_persistent.log"
           for pers in dynamic 1 0; do IOATTN_SM90_PERSISTENT=$pers timeout 150 python -m ioattn bench --modes fwd \
             --dims 64,128 --seqlens 2048,4096,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn --no-plots \
             --out "$OUT/sm90_fwd_persistent_snake${pers}_${GPU_TAG}_$(date +%F).json" > "$OUT/pers$pers.log" 2>&1
             echo "persistent=$pers"; grep -E "^fwd" "$OUT/pers$pers.log"; done ;;
    tune-sm90) # pipeline depths of the sm90 backward kernels (and the d=64 forward's)
           timeout 300 python benchmarks/tune_sm90.py --mode bwd --dims 64,128 --seqlens 2048,16384 \
             --json "$OUT/tune_sm90_bwd.json" > "$OUT/tune_sm90_bwd.log" 2>&1; grep "^==" "$OUT/tune_sm90_bwd.log"
           timeout 150 python benchmarks/tune_sm90.py --mode fwd --dims 64 --seqlens 2048,16384 \
             --json "$OUT/tune_sm90_fwd.json" > "$OUT/tune_sm90_fwd.log" 2>&1; grep "^==" "$OUT/tune_sm90_fwd.log" ;;
    profile-bwd) # ncu on the sm90 backward (fused dK/dV + dQ kernel, d=128 non-causal 16k)
           timeout 240 ncu --clock-control none -k regex:bwd_dkdv_sm90 --launch-skip 2 --launch-count 1 \
             --set full --import-source no -o "$OUT/bwd128" python benchmarks/profile_fwd.py --d 128 \
             --seqlen 16384 --backward > "$OUT/ncu_bwd_run.log" 2>&1; tail -2 "$OUT/ncu_bwd_run.log"
           ncu --import "$OUT/bwd128.ncu-rep" --page details > "$OUT/ncu_bwd_details.txt" 2>&1
           ncu --import "$OUT/bwd128.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_bwd_sass.csv" 2>&1
           grep -E "Duration|Tensor is|Issue Slots|No Eligible|Stall" "$OUT/ncu_bwd_details.txt" | head -30 ;;
    d256)  # the d=256 causal 2k cell (bf16 took as long as non-causal in two runs of record): the
           # sm90 forward by default, without pingpong, and on the dynamic scheduler; both dtypes
           for v in default pp0 dynamic; do
             case $v in pp0) e=IOATTN_SM90_PINGPONG=0 ;; dynamic) e=IOATTN_SM90_PERSISTENT=dynamic ;; *) e=X=1 ;; esac
             env $e timeout 150 python -m ioattn bench --modes fwd --dims 256 --seqlens 1024,2048,4096 \
               --dtypes bf16,fp16 --impls ioattn_sm90,ioattn_triton,sdpa_cudnn --no-plots \
               --out "$OUT/sm90_fwd_d256_$v.json" > "$OUT/d256_$v.log" 2>&1
             echo "== $v"; grep -E "^fwd" "$OUT/d256_$v.log"; done
           for dt in bf16 fp16; do  # the kernel's own time (ncu), without the timer's host effects
             timeout 120 ncu --clock-control none -k regex:attn_fwd_sm90 --launch-skip 2 --launch-count 3 \
               --metrics gpu__time_duration.sum python benchmarks/profile_fwd.py --d 256 --seqlen 2048 \
               --causal --dtype $dt --calls 5 > "$OUT/ncu_d256_$dt.log" 2>&1
             echo "ncu $dt"; grep -E "gpu__time_duration" "$OUT/ncu_d256_$dt.log"; done ;;
    sm90-bwd-order) # the fused backward's dQ partial: by head dim and mask (default), after dK,
           # first, one step late, (d=64) one warpgroup a step in turn
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/dense/test_sm90.py -k fused \
             > "$OUT/tests_bwd_order.log" 2>&1; tail -1 "$OUT/tests_bwd_order.log"
           for v in default after first lag alt; do
             case $v in default) e=X=1 ;; *) e=IOATTN_SM90_BWD_DQ_ORDER=$v ;; esac
             env $e timeout 150 python -m ioattn bench --modes bwd --dims 64,128 --seqlens 2048,8192,16384 \
               --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn --no-plots \
               --out "$OUT/sm90_bwd_order_$v.json" > "$OUT/bwd_order_$v.log" 2>&1
             echo "== $v"; grep -E "^bwd" "$OUT/bwd_order_$v.log"; done ;;
    sm90-wg3p) # the d=64 persistent forward on three consumer warpgroups vs two
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/dense/test_sm90.py -k persistent \
             > "$OUT/tests_wg3p.log" 2>&1; tail -1 "$OUT/tests_wg3p.log"
           for w in 1 0; do IOATTN_SM90_WG3_PERSISTENT=$w timeout 150 python -m ioattn bench --modes fwd \
             --dims 64 --seqlens 2048,4096,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn --no-plots \
             --out "$OUT/sm90_fwd_wg3p$w.json" > "$OUT/wg3p$w.log" 2>&1
             echo "== wg3p=$w"; grep -E "^fwd" "$OUT/wg3p$w.log"; done ;;
    sm90-bwd-d256) # the d=256 backward: its tests, then timed against the portable one
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/dense/test_sm90.py -k "d256 or compiles" > "$OUT/tests_d256.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_d256.log"; tail -1 "$OUT/tests_d256.log"
           timeout 200 python -m ioattn bench --modes bwd --dims 256 \
             --seqlens 2048,8192,16384 --dtypes bf16 --impls ioattn_sm90,ioattn_triton,sdpa_cudnn \
             --no-plots --out "$OUT/sm90_bwd_d256.json" > "$OUT/bwd_d256.log" 2>&1
           grep -E "^bwd" "$OUT/bwd_d256.log" ;;
    tests-variants) # the dense suite with sm90 forced and opt-in variants on (VARIANT_ENV, e.g.
           # "IOATTN_SM90_BWD_SEGMENTS=1"): the check before making them defaults
           env ${VARIANT_ENV:-X=1} IOATTN_TEST_SM90=always timeout 450 python -m pytest \
             -q -n 14 -p no:cacheprovider -rf tests/dense > "$OUT/tests_variants.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_variants.log"; tail -1 "$OUT/tests_variants.log" ;;
    sm90-bwd-seg) # the backward's steps in masked / unmasked loops (opt-in): its tests, then on / off
           IOATTN_SM90_BWD_SEGMENTS=1 timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/dense/test_sm90.py -k "fused or varlen" > "$OUT/tests_seg.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_seg.log"; tail -1 "$OUT/tests_seg.log"
           for g in 1 0; do IOATTN_SM90_BWD_SEGMENTS=$g timeout 150 python -m ioattn bench --modes bwd \
             --dims 64,128 --seqlens 2048,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn --no-plots \
             --out "$OUT/sm90_bwd_seg$g.json" > "$OUT/bwd_seg$g.log" 2>&1
             echo "== segments=$g"; grep -E "^bwd" "$OUT/bwd_seg$g.log"; done ;;
    sm90-bwd-rowstats) # LSE / delta staged in shared memory (opt-in): tests, then on / off (JSONs), the
           # dQ orders again with it on (after / first became spill-free) and the step loops (logs: the
           # device returns 8 files)
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/dense/test_sm90.py \
             -k rowstats > "$OUT/tests_rowstats.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_rowstats.log"; tail -1 "$OUT/tests_rowstats.log"
           for r in 1 0; do IOATTN_SM90_BWD_ROW_STATS=$r timeout 150 python -m ioattn bench --modes bwd \
             --dims 64,128,256 --seqlens 2048,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn --no-plots \
             --out "$OUT/sm90_bwd_rowstats$r.json" > "$OUT/bwd_rowstats$r.log" 2>&1
             echo "== row_stats=$r"; grep -E "^bwd" "$OUT/bwd_rowstats$r.log"; done
           for v in after first; do IOATTN_SM90_BWD_ROW_STATS=1 IOATTN_SM90_BWD_DQ_ORDER=$v timeout 150 \
             python -m ioattn bench --modes bwd --dims 128 --seqlens 2048,8192,16384 --dtypes bf16 \
             --impls ioattn_sm90,sdpa_cudnn --no-plots --out "/tmp/rowstats_$v.json" > "$OUT/rowstats_$v.log" 2>&1
             echo "== row_stats=1 order=$v"; grep -E "^bwd" "$OUT/rowstats_$v.log"; done
           # with the masked / unmasked step loops too (spill-free in the loop with row stats:
           # the d=128 causal unmasked step 620 -> 453 SASS instructions)
           IOATTN_SM90_BWD_ROW_STATS=1 IOATTN_SM90_BWD_SEGMENTS=1 timeout 150 python -m ioattn bench \
             --modes bwd --dims 64,128 --seqlens 2048,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn \
             --no-plots --out /tmp/rowstats_seg.json > "$OUT/rowstats_seg.log" 2>&1
           echo "== row_stats=1 segments=1"; grep -E "^bwd" "$OUT/rowstats_seg.log" ;;
    sm90-wg3pp) # (session 11; since 7484f8a its default / wg3p / pp3p rows take the 192x128 tile
           # for causal cells from 4k: add IOATTN_SM90_WG3_BLOCK_N=64 to rerun them as they ran)
           # the d=64 forward on three consumer warpgroups taking turns round robin (FA3's
           # warp-scheduler barrier at d=64), persistent and not, and on FA3's 192x128 tile
           # (wide_): tests, then timed against the three-warpgroup form without turns and the
           # default (two warpgroups, dynamic). Logs in /tmp (the device returns 8 files)
           timeout 200 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/dense/test_sm90.py -k "wg3" > "$OUT/tests_wg3pp.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_wg3pp.log"; tail -1 "$OUT/tests_wg3pp.log"
           for v in pp3p wide_pp3p wide_wg3p wg3p default pp3; do
             case $v in pp3p) e="IOATTN_SM90_WG3_PERSISTENT=1 IOATTN_SM90_PINGPONG=1" ;;
               wide_pp3p) e="IOATTN_SM90_WG3_PERSISTENT=1 IOATTN_SM90_PINGPONG=1 IOATTN_SM90_WG3_BLOCK_N=128" ;;
               wide_wg3p) e="IOATTN_SM90_WG3_PERSISTENT=1 IOATTN_SM90_WG3_BLOCK_N=128" ;;
               wg3p) e=IOATTN_SM90_WG3_PERSISTENT=1 ;; pp3) e="IOATTN_SM90_PERSISTENT=0 IOATTN_SM90_PINGPONG=1" ;;
               *) e=X=1 ;; esac
             env $e timeout 150 python -m ioattn bench --modes fwd --dims 64 \
               --seqlens 2048,4096,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn --no-plots \
               --out "$OUT/sm90_fwd_wg3pp_$v.json" > "/tmp/wg3pp_$v.log" 2>&1
             echo "== $v"; grep -E "^fwd" "/tmp/wg3pp_$v.log"; done ;;
    sm90-pp128) # pingpong at d=128 again, in today's persistent form (FA3 runs its scheduler
           # barrier there; measured within noise in session 3, before the persistent form)
           for v in 1 auto; do IOATTN_SM90_PINGPONG=$v timeout 150 python -m ioattn bench --modes fwd \
             --dims 128 --seqlens 2048,4096,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn \
             --no-plots --out "$OUT/sm90_fwd_pp128_$v.json" > "$OUT/pp128_$v.log" 2>&1
             echo "== pingpong=$v"; grep -E "^fwd" "$OUT/pp128_$v.log"; done ;;
    sm90-exp-early) # each key block's exponentials before the wait for PV_{j-1} (opt-in,
           # IOATTN_SM90_FWD_EXP_EARLY): the forward's tests with it, then timed on / off
           # (step total within the 600 s of a call: 150 + 100 + 2 x 120 + 90)
           IOATTN_SM90_FWD_EXP_EARLY=1 timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/dense/test_sm90.py -k "fwd or persistent or wg3 or varlen" \
             > "$OUT/tests_exp_early.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_exp_early.log"; tail -1 "$OUT/tests_exp_early.log"
           IOATTN_SM90_FWD_EXP_EARLY=1 timeout 100 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/decode/test_kvcache_sm90.py > "$OUT/tests_exp_early_paged.log" 2>&1  # (paged fwd)
           grep -E "^FAILED" "$OUT/tests_exp_early_paged.log"; tail -1 "$OUT/tests_exp_early_paged.log"
           for v in 1 0; do IOATTN_SM90_FWD_EXP_EARLY=$v timeout 120 python -m ioattn bench --modes fwd \
             --dims 64,128,256 --seqlens 2048,4096,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn \
             --no-plots --out "$OUT/sm90_fwd_exp_early$v.json" > "/tmp/exp_early_$v.log" 2>&1
             echo "== exp_early=$v"; grep -E "^fwd" "/tmp/exp_early_$v.log"; done
           # the 192x128 tile everywhere at d=64 with them early (non-causal it ran 0.78x before)
           IOATTN_SM90_WG3_BLOCK_N=128 IOATTN_SM90_FWD_EXP_EARLY=1 timeout 90 python -m ioattn bench \
             --modes fwd --dims 64 --seqlens 2048,4096,8192,16384 --dtypes bf16 \
             --impls ioattn_sm90,sdpa_cudnn --no-plots --out "$OUT/sm90_fwd_exp_early1_wide.json" \
             > /tmp/exp_early_wide.log 2>&1
           echo "== exp_early=1 192x128 at d=64"; grep -E "^fwd" /tmp/exp_early_wide.log ;;
    sm90-bwd-exp-early) # each step's exponentials before the wait for dPᵀ (opt-in,
           # IOATTN_SM90_BWD_EXP_EARLY): the backward's tests with it, then timed on / off
           # (150 + 2 x 190 s: within a call's 600)
           IOATTN_SM90_BWD_EXP_EARLY=1 timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/dense/test_sm90.py -k "bwd or fused or varlen or segments or rowstats" \
             > "$OUT/tests_bwd_exp_early.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_bwd_exp_early.log"; tail -1 "$OUT/tests_bwd_exp_early.log"
           for v in 1 0; do IOATTN_SM90_BWD_EXP_EARLY=$v timeout 190 python -m ioattn bench --modes bwd \
             --dims 64,128 --seqlens 2048,4096,8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn \
             --no-plots --out "$OUT/sm90_bwd_exp_early$v.json" > "/tmp/bwd_exp_early_$v.log" 2>&1
             echo "== bwd exp_early=$v"; grep -E "^bwd" "/tmp/bwd_exp_early_$v.log"; done ;;
    sm90-decode-fp8) # fp8 caches on the sm90 decode kernel (opt-in, IOATTN_SM90_DECODE_FP8):
           # its tests, then the decode cells on / off (the _fp8 rows)
           IOATTN_SM90_DECODE_FP8=1 timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/decode/test_decode_sm90.py tests/paged/test_flashinfer.py -k "fp8 or sm90_decode" \
             > "$OUT/tests_decode_fp8.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_decode_fp8.log"; tail -1 "$OUT/tests_decode_fp8.log"
           for v in 1 0; do IOATTN_SM90_DECODE_FP8=$v timeout 150 \
             python -m ioattn bench --suite decode \
             --cells 1x32768x16,16x8192x16,64x4096x16,128x2048x16 --prefill-cells "" \
             --out "$OUT/decode_fp8_sm90$v.json" > "/tmp/decode_fp8_$v.log" 2>&1
             echo "== sm90 fp8=$v"; grep -E "ioattn_paged |_fp8|cudnn " "/tmp/decode_fp8_$v.log"; done ;;
    sm90-softcap) # softcap in the sm90 kernels: their tests in the exact form
           # (IOATTN_SM90_SOFTCAP_APPROX=0) and with tanh.approx (the default), and the dense
           # suite's softcap cases forced through sm90 (3 x ~150 s)
           for v in 0 1; do IOATTN_SM90_SOFTCAP_APPROX=$v timeout 200 python -m pytest -q -n 14 \
             -p no:cacheprovider tests/dense/test_sm90.py -k "softcap or refuses or preference" \
             > "$OUT/tests_softcap$v.log" 2>&1
             echo "== approx=$v"; grep -E "^FAILED" "$OUT/tests_softcap$v.log"; tail -1 "$OUT/tests_softcap$v.log"
           done
           IOATTN_TEST_SM90=always timeout 200 python -m pytest -q -n 14 -p no:cacheprovider \
             tests/dense -k "cap" > "$OUT/tests_softcap_forced.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_softcap_forced.log"; tail -1 "$OUT/tests_softcap_forced.log" ;;
    softcap-bench) # forward and backward at cap 30: the sm90 kernels against the portable ones
           # and Flex (SDPA has no softcap), then the sm90 kernels with tanh.approx (300 + 200 s)
           timeout 300 python -m ioattn bench --modes fwd,bwd --dims 64,128 --seqlens 2048,8192 \
             --dtypes bf16 --softcap 30 --impls ioattn_sm90,ioattn_triton,flex --rounds 2 --no-plots \
             --out "$OUT/softcap.json" > /tmp/softcap.log 2>&1
           grep -E "^(fwd|bwd)" /tmp/softcap.log
           IOATTN_SM90_SOFTCAP_APPROX=1 timeout 200 python -m ioattn bench --modes fwd,bwd \
             --dims 64,128 --seqlens 2048,8192 --dtypes bf16 --softcap 30 \
             --impls ioattn_sm90,ioattn_triton --rounds 2 --no-plots --out "$OUT/softcap_approx.json" \
             > /tmp/softcap_approx.log 2>&1
           echo "== approx"; grep -E "^(fwd|bwd)" /tmp/softcap_approx.log ;;
    padded-bench) # d = 96 / 192 on the sm90 kernels through zero-padded copies (as 128 / 256;
           # backend='sm90' only until timed) against the portable kernels, cuDNN and FA2, hidden
           # 1536 (16 / 8 heads), fwd and bwd (~250 s)
           timeout 300 python -m ioattn bench --modes fwd,bwd --dims 96,192 --hidden 1536 \
             --seqlens 2048,8192 --dtypes bf16 --impls ioattn_sm90,ioattn_triton,sdpa_cudnn,sdpa_flash \
             --rounds 2 --no-plots --out "$OUT/padded.json" > /tmp/padded.log 2>&1
           grep -E "^(fwd|bwd)" /tmp/padded.log ;;
    sm90-decode-balanced) # FlashInfer's balanced split on the sm90 decode kernel (opt-in,
           # IOATTN_SM90_DECODE_BALANCED): its tests, then the decode cells on / off (120 + 2 x 200 s)
           IOATTN_SM90_DECODE_BALANCED=1 timeout 120 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/decode/test_decode_sm90.py tests/paged/test_flashinfer.py -k "balanced or sm90_decode" \
             > "$OUT/tests_decode_balanced.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_decode_balanced.log"; tail -1 "$OUT/tests_decode_balanced.log"
           for v in 1 0; do IOATTN_SM90_DECODE_BALANCED=$v timeout 200 python -m ioattn bench --suite decode \
             --cells 64x4096x16,16x8192x16,1x32768x16,128x2048x16 --prefill-cells "" \
             --out "$OUT/decode_balanced$v.json" > "/tmp/decode_bal_$v.log" 2>&1
             echo "== balanced=$v"; grep -E "ioattn_paged |ioattn_paged_graph|cudnn" "/tmp/decode_bal_$v.log"; done ;;
    pad-tma-bench) # forward and backward at 96 / 192 / 192x128 (V and O at 128 columns, MLA
           # prefill) in place vs copied, 1k-8k (the crossovers for auto's thresholds), next to
           # the portable kernels and cuDNN (~250 s in place with its peers, ~120 s copied alone)
           for m in tma copy; do impls=ioattn_sm90; [ $m = tma ] && impls=ioattn_sm90,ioattn_triton,sdpa_cudnn
             IOATTN_SM90_PAD=$m timeout 280 python -m ioattn bench --modes fwd,bwd \
             --dims 96,192,192x128 --hidden 1536 --seqlens 1024,2048,4096,8192 --dtypes bf16 \
             --impls $impls --rounds 2 --no-plots \
             --out "$OUT/pad_$m.json" > "/tmp/pad_$m.log" 2>&1
             echo "== $m"; grep -E "^(fwd|bwd)" "/tmp/pad_$m.log"; done ;;
    profile-fwd64) # ncu sections (pipes, warp stalls) of the d=64 non-causal 8k forward: two
           # warpgroups (default), the 192x128 tile (0.78x of it non-causal, 1.1x causal), and
           # both with the exponentials early
           for v in default wide wide_causal early wide_early; do
             a="--seqlen 8192"; e=X=1
             case $v in wide) e=IOATTN_SM90_WG3_BLOCK_N=128 ;;
               wide_causal) e=IOATTN_SM90_WG3_BLOCK_N=128; a="$a --causal" ;;
               early) e=IOATTN_SM90_FWD_EXP_EARLY=1 ;;
               wide_early) e="IOATTN_SM90_WG3_BLOCK_N=128 IOATTN_SM90_FWD_EXP_EARLY=1" ;; esac
             env $e timeout 100 ncu --clock-control none -k regex:attn_fwd_sm90 --launch-skip 2 \
               --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
               --section WarpStateStats --section Occupancy python benchmarks/profile_fwd.py --d 64 \
               $a > "/tmp/ncu64_$v.txt" 2>&1
             echo "== $v"; grep -E "Duration|Issue Slots Busy|Executed Ipc A|Stall|Warp Cycles Per Issued" \
               "/tmp/ncu64_$v.txt" | head -12; done
           cat /tmp/ncu64_*.txt > "$OUT/ncu_fwd64.txt" ;;
    fwd16k) # why d=128 non-causal 16k runs below 8k (635 vs 673 TFLOP/s in dense_35fdf4d while
           # cuDNN rises): ncu of both (speed of light, memory, clocks), then both timed in each
           # persistent mode (dynamic, the default; static snake; one CTA per tile), ~400 s
           for s in 8192 16384; do timeout 90 ncu --clock-control none -k regex:attn_fwd_sm90 \
               --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
               --section LaunchStats --section Occupancy python benchmarks/profile_fwd.py --d 128 \
               --seqlen $s > "/tmp/ncu128_$s.txt" 2>&1; echo "== $s"
             grep -E "Duration|SM Frequency|DRAM Throughput|L2 Hit Rate|Memory Throughput|Compute \(SM\)|Grid Size" \
               "/tmp/ncu128_$s.txt" | head -12; done
           cat /tmp/ncu128_*.txt > "$OUT/ncu_fwd128_8k16k.txt"
           for m in dynamic static 0; do IOATTN_SM90_PERSISTENT=$m timeout 80 python -m ioattn bench \
               --modes fwd --dims 128 --seqlens 8192,16384 --dtypes bf16 --impls ioattn_sm90,sdpa_cudnn \
               --no-plots --out "$OUT/fwd128_pers_$m.json" > "/tmp/pers_$m.log" 2>&1
             echo "== $m"; grep -E "^fwd" "/tmp/pers_$m.log"; done ;;
    dmon)  # clocks and power sampled each second under the steps after it (`dmon warm bench`):
           # whether a sustained run holds the SM clock ncu saw on one launch (1.70 GHz)
           nvidia-smi dmon -s pc -d 1 -o T > "$OUT/dmon.log" 2>&1 & DMON=$! ;;
    decode-pdl) # the sm90 decode kernel with programmatic dependent launch and / or its grid as
           # (KV heads, items) (opt-in IOATTN_SM90_DECODE_PDL / _HEADS_FIRST): their tests, then
           # the two acceptance cells in each combination, graphloop rows included (~120 + 4 x 100 s)
           timeout 120 python -m pytest -q -n 8 -p no:cacheprovider tests/decode/test_decode_sm90.py \
             -k "pdl or graph_capture" > "$OUT/tests_decode_pdl.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_decode_pdl.log"; tail -1 "$OUT/tests_decode_pdl.log"
           for v in 00 10 01 11; do IOATTN_SM90_DECODE_PDL=${v:0:1} IOATTN_SM90_DECODE_HEADS_FIRST=${v:1:1} \
             timeout 110 python -m ioattn bench --suite decode --cells 64x4096x16,1x32768x16 \
             --prefill-cells "" --out "$OUT/decode_pdl$v.json" > "/tmp/decode_pdl_$v.log" 2>&1
             echo "== pdl,heads_first=$v"; grep -E "ioattn_paged |ioattn_paged_graph|cudnn" "/tmp/decode_pdl_$v.log"; done ;;
    lpt) # the grouped heaviest-first order of the forward's tiles and the backward's grids
           # (opt-in IOATTN_SM90_FWD_LPT / _BWD_LPT): its tests, then the bf16 grid's causal and
           # non-causal cells with it on (and cuDNN) and off (~80 + 230 + 200 s at the default
           # LPT_DIMS=64,128 LPT_SEQLENS=2048,4096,8192,16384; LPT_DIMS=256 LPT_SEQLENS=2048,4096,8192:
           # ~80 + 2 x 130 s)
           timeout 100 python -m pytest -q -n 8 -p no:cacheprovider tests/dense/test_sm90.py \
             -k "grouped or head_group" > "$OUT/tests_lpt.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_lpt.log"; tail -1 "$OUT/tests_lpt.log"
           dims=${LPT_DIMS:-64,128}
           for v in 1 0; do impls=ioattn_sm90; [ $v = 1 ] && impls=ioattn_sm90,sdpa_cudnn
             IOATTN_SM90_FWD_LPT=$v IOATTN_SM90_BWD_LPT=$v timeout 240 python -m ioattn bench \
               --modes fwd,bwd --dims $dims --seqlens ${LPT_SEQLENS:-2048,4096,8192,16384} \
               --dtypes bf16 --impls $impls --no-plots --out "$OUT/lpt${v}_d${dims/,/_}.json" \
               > "/tmp/lpt$v.log" 2>&1
             echo "== lpt=$v"; grep -E "^(fwd|bwd)" "/tmp/lpt$v.log"; done ;;
    sdpa-bench) # ioattn's SDPA call on SDPA's [b, h, s, d] tensors (heads folded into the batch)
           # beside flash_attn_func on [b, s, h, d] and cuDNN (~120 s)
           timeout 170 python -m ioattn bench --modes fwd,bwd --dims 64,128 --seqlens 2048,8192 \
             --dtypes bf16 --impls ioattn,ioattn_sdpa,sdpa_cudnn --no-plots \
             --out "$OUT/sdpa_entry.json" > "/tmp/sdpa_entry.log" 2>&1
           grep -E "^(fwd|bwd)" "/tmp/sdpa_entry.log" ;;
    pad-tests) # the padded head dims' sm90 tests at the default (read in place) and the copies
           timeout 170 python -m pytest -q -n 14 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "pad" > "$OUT/tests_pad.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_pad.log"; tail -1 "$OUT/tests_pad.log" ;;
    pad-narrow) # 96 / 192 / (192, 128) with QKᵀ (S, dP in the backward's dQ and column-split
           # dK/dV kernels) over d's / d_v's own columns and the forward's V / O at d_v's own
           # width (IOATTN_SM90_PAD_NARROW, the default since 999186c): its tests, then forward
           # and backward on (with cuDNN) / off, hidden 1536, 1k and 8k (~60 + 2 x 150 s)
           timeout 150 python -m pytest -q -n 14 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "padded_in_place" > "$OUT/tests_pad_narrow.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_pad_narrow.log"; tail -1 "$OUT/tests_pad_narrow.log"
           for v in 1 0; do impls=ioattn_sm90; [ $v = 1 ] && impls=ioattn_sm90,sdpa_cudnn
             IOATTN_SM90_PAD_NARROW=$v timeout 200 python -m ioattn bench --modes fwd,bwd \
               --dims 96,192,192x128 --hidden 1536 --seqlens 1024,8192 --dtypes bf16 \
               --impls $impls --no-plots --out "$OUT/pad_narrow$v.json" > /tmp/pad_narrow$v.log 2>&1
             echo "== narrow=$v"; grep -E "^(fwd|bwd)" /tmp/pad_narrow$v.log; done ;;
    bwd-ncu) # the main backward kernel (ours: _bwd_dkdv_sm90, cuDNN's bprop) of one d=128
           # non-causal call at 2k and 16k under ncu: speed of light, warp stall reasons, memory
           # workload; what makes ours lose 9% to cuDNN's at 2k but 1.5% at 16k (~60 s each)
           for s in ${NCU_SEQLENS:-2048 16384}; do for be in ${NCU_BACKENDS:-auto sdpa_cudnn}; do
             timeout 120 ncu --clock-control none --profile-from-start off \
               -k regex:"bwd_dkdv_sm90|bprop" --launch-count 1 --section SpeedOfLight \
               --section WarpStateStats --section MemoryWorkloadAnalysis \
               --section ComputeWorkloadAnalysis --section LaunchStats \
               python benchmarks/profile_fwd.py --d 128 --seqlen $s --backward --calls 3 \
               --backend $be > "$OUT/ncu_bwd_${be}_$s.txt" 2>&1
             echo "== $be $s"; grep -E "Duration|Throughput|Stall|Issue|Hit Rate|Executed Ipc|Warp Cycles" \
               "$OUT/ncu_bwd_${be}_$s.txt" | head -40; done; done ;;
    parts) # each dense call's GPU time kernel by kernel (torch.profiler), ours and cuDNN's: how much
           # of the 2k cells' gap is side passes against the main kernel (~90 s)
           timeout 200 python benchmarks/kernel_parts.py --dims ${PARTS_DIMS:-64,128} \
             --seqlens ${PARTS_SEQLENS:-2048,4096,16384} --json "$OUT/kernel_parts.json" \
             > "$OUT/kernel_parts.log" 2>&1; cat "$OUT/kernel_parts.log" | cut -c1-200
           # DRAM bytes a kernel of one d=128 non-causal 2k forward + backward (the last call;
           # ours: fwd, preprocess, dQ buffer zeroing, dK/dV(+dQ), dQ conversion), then cuDNN's
           for be in auto sdpa_cudnn; do
             timeout 150 ncu --clock-control none --profile-from-start off --metrics \
               gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
               python benchmarks/profile_fwd.py --d 128 --seqlen 2048 --backward --calls 4 \
               --backend $be > "$OUT/ncu_parts_$be.txt" 2>&1
             grep -E "^  [a-zA-Z_]|duration|dram__bytes|lts__t_bytes" "$OUT/ncu_parts_$be.txt" | head -60; done ;;
    bwd-tma-store) # dK / dV stored by TMA from the Q / dO stages (IOATTN_SM90_BWD_TMA_STORE, default
           # on): the sm90 tests (not the compile check: CI runs it, and it alone takes ~4 min),
           # the CTA timeline (d=128 2k), then the backward on (with cuDNN) / off at d = 64 / 128,
           # 2k-16k (~200 + 40 + 2 x 120 s)
           timeout 230 python -m pytest -q -n 14 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "not kernel_compiles" > "$OUT/tests_sm90.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_sm90.log"; tail -1 "$OUT/tests_sm90.log"
           for c in "2048" "2048 --causal"; do set -- $c ""
             timeout 60 python benchmarks/timeline.py --kernel bwd --d 128 --seqlen $1 ${2:-} \
               --json "$OUT/timeline_$1${2:+_causal}.json" > /tmp/timeline.log 2>&1
             echo "== timeline $c"; grep -A6 '"wg0_us"' /tmp/timeline.log | head -7
             grep -E '"cta_us"|"kernel_us"' /tmp/timeline.log | head -2; done
           onoff IOATTN_SM90_BWD_TMA_STORE "1 0" bwd_tma_store --modes bwd --dims 64,128 \
             --seqlens 2048,4096,8192,16384 --dtypes bf16 ;;
    fwd-o-tma) # the persistent forward's O by TMA from the tile's last V stage (IOATTN_SM90_FWD_O_TMA,
           # opt-in): the persistent / forward tests with it on, the tile timeline (d=128 2k, on
           # and off), then the forward on (with cuDNN) / off at d = 64 / 128, 2k-16k
           # (~120 + 4 x 25 + 2 x 100 s)
           IOATTN_SM90_FWD_O_TMA=1 timeout 150 python -m pytest -q -n 14 -p no:cacheprovider -rf \
             tests/dense/test_sm90.py -k "persistent or fwd_bwd" > "$OUT/tests_o_tma.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_o_tma.log"; tail -1 "$OUT/tests_o_tma.log"
           timelines o_tma "IOATTN_SM90_FWD_O_TMA=1 IOATTN_SM90_FWD_O_TMA=0"
           onoff IOATTN_SM90_FWD_O_TMA "1 0" fwd_o_tma --modes fwd --dims 64,128 \
             --seqlens 2048,4096,8192,16384 --dtypes bf16 ;;
    fwd-o-defer) # the persistent forward's O stage released a block into the next tile instead
           # of waited for at the store (IOATTN_SM90_FWD_O_DEFER, the default): the persistent tests
           # with it, the d=128 2k tile timeline on / off, then d = 64 / 128 forward on / off
           # with cuDNN in both (~60 + 4 x 25 + 2 x 120 s)
           IOATTN_SM90_FWD_O_DEFER=1 timeout 150 python -m pytest -q -n 14 -p no:cacheprovider -rf \
             tests/dense/test_sm90.py -k "persistent or fwd_bwd" > "$OUT/tests_o_defer.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_o_defer.log"; tail -1 "$OUT/tests_o_defer.log"
           timelines o_defer "IOATTN_SM90_FWD_O_DEFER=1 IOATTN_SM90_FWD_O_DEFER=0"
           onoff IOATTN_SM90_FWD_O_DEFER "1 0" fwd_o_defer --modes fwd --dims 64,128 \
             --seqlens 2048,4096,16384 --dtypes bf16 ;;
    decode-prefetch) # L2 prefetches of each decode CTA's first tiles before its PDL wait
           # (IOATTN_SM90_DECODE_PREFETCH, opt-in): the PDL tests with it, then the two acceptance
           # cells on (with cuDNN) / off, graphloop rows included (~90 + 2 x 100 s)
           timeout 120 python -m pytest -q -n 8 -p no:cacheprovider tests/decode/test_decode_sm90.py \
             -k "pdl or graph_capture" > "$OUT/tests_decode_prefetch.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_decode_prefetch.log"; tail -1 "$OUT/tests_decode_prefetch.log"
           for v in 1 0; do IOATTN_SM90_DECODE_PREFETCH=$v \
             timeout 110 python -m ioattn bench --suite decode --cells 64x4096x16,1x32768x16 \
             --prefill-cells "" --out "$OUT/decode_prefetch$v.json" > "/tmp/decode_pf_$v.log" 2>&1
             echo "== prefetch=$v"; grep -E "ioattn_paged |ioattn_paged_graph|cudnn" "/tmp/decode_pf_$v.log"; done ;;
    bwd-stages) # the d=64 dK/dV kernel's Q/dO ring at 3 / 4 stages (IOATTN_SM90_BWD_STAGES, 2 by
           # default since session 20): its tests, then the d=64 backward at 2 / 3 / 4 with cuDNN
           # in each run (~90 + 3 x 70 s)
           timeout 120 python -m pytest -q -n 14 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "stages" > "$OUT/tests_bwd_stages.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_bwd_stages.log"; tail -1 "$OUT/tests_bwd_stages.log"
           onoff IOATTN_SM90_BWD_STAGES "2 3 4" bwd_stages --modes bwd --dims 64 \
             --seqlens 2048,4096,8192,16384 --dtypes bf16 ;;
    bwd-rows) # the fused d=64 backward on 128-row steps (IOATTN_SM90_BWD_ROWS, default since
           # session 21) and on 64-row steps: the 128-row tests, then both with cuDNN beside each
           # (~60 + 2 x 50 s). (Session 21's `bwd-regs` step at 736b182 also timed K / V and dSᵀ
           # as register operands, removed after it: results/bwd_regs_*_736b182_*.json)
           timeout 150 python -m pytest -q -n 14 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "rows128 or rows_rule" > "$OUT/tests_bwd_rows.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_bwd_rows.log" | head -20; tail -1 "$OUT/tests_bwd_rows.log"
           onoff IOATTN_SM90_BWD_ROWS "128 64" bwd_rows --modes bwd --dims 64 \
             --seqlens 2048,4096,8192,16384 --dtypes bf16 ;;
    fwd-q-bufs) # Q in two buffers in the persistent forward (IOATTN_SM90_FWD_Q_BUFS, "auto": two
           # up to 8k keys): its tests (the persistent cases on 3 CTAs, qbufs1 / qbufs2 forced),
           # then the stamped 2k tiles (d=64 causal, d=128 causal and not; q_wait = the tile's
           # wait for its Q) by default and with one buffer (~90 + 6 x 25 s)
           timeout 180 python -m pytest -q -n 14 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "qbufs or q_bufs" > "$OUT/tests_q_bufs.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_q_bufs.log" | head -20; tail -1 "$OUT/tests_q_bufs.log"
           timelines q_bufs "IOATTN_SM90_FWD_Q_BUFS=auto IOATTN_SM90_FWD_Q_BUFS=1" "64 --causal|128 --causal|128" ;;
    fwd-q-bufs-bench) # the d = 64 / 128 forward 2k-16k with Q_BUFS 2 / 1 forced, cuDNN beside
           # each (~2 x 100 s)
           onoff IOATTN_SM90_FWD_Q_BUFS "2 1" fwd_q_bufs --modes fwd --dims 64,128 \
             --seqlens 2048,4096,8192,16384 --dtypes bf16 ;;
    fwd-q-bufs-d64) # why two Q buffers cost d=64 non-causal 4-10% (fwd_q_bufs{2,1}_be5d13b):
           # its 192-row tile with one buffer (O from registers), two buffers with O from
           # registers (O_TMA=0), two with O by TMA from the Q piece (the form auto dropped);
           # cuDNN beside each (~3 x 60 s), then the causal 2k tile (~2 x 40 s)
           for e in "IOATTN_SM90_FWD_Q_BUFS=1" "IOATTN_SM90_FWD_Q_BUFS=2 IOATTN_SM90_FWD_O_TMA=0" \
                    "IOATTN_SM90_FWD_Q_BUFS=2"; do
             bench_with "$e" "fwd_d64_$(echo "$e" | tr -d ' ' | sed 's/IOATTN_SM90_FWD_//g' | tr 'A-Z=' 'a-z_')" \
               --modes fwd --dims 64 --seqlens 2048,4096,8192,16384 --causal false --dtypes bf16 --rounds 3
           done
           # and causal 2k / 4k: the two-warpgroup 128-row tile below 4k (auto) against FA3's
           # 192x128 tile there too (WG3_BLOCK_N=128; it lost at 2k with one Q buffer, 331 vs
           # 349, and gains +3.6% at 4k from the second buffer)
           onoff IOATTN_SM90_WG3_BLOCK_N "auto 128" fwd_d64c_wg3_block_n_ --modes fwd --dims 64 \
             --seqlens 2048,4096 --causal true --dtypes bf16 --rounds 3 ;;
    tail-shapes) # whether a partial last wave of tiles costs the short non-causal cells (the FA
           # grid has 2048 128-row tiles at d=128 and 1024 at d=256 whatever s: 15.5 / 7.8 waves
           # on 132 SMs): the grid's shape, a tile count that fills the last wave (11 heads over
           # 12288 tokens: 1056 tiles, 8 waves) and one a little over it (17 heads over 8192:
           # 1088, 8.24 waves), at 2k and 4k alike (tokens divisible by 4096), ours against
           # cuDNN (~90 s). Session 25 ran it with 22528 / 14336 tokens, which hold 5 / 3
           # batches at 4k: its 4k "exact" / "over" rows were neither
           for cfg in "128 16384 2048 std" "128 12288 1408 exact" "128 8192 2176 over" \
                      "256 16384 2048 std" "256 12288 2816 exact" "256 8192 4352 over"; do
             read -r d t h name <<< "$cfg"
             bench_with "" "tail_d${d}_$name" --modes fwd --dims $d --seqlens 2048,4096 \
               --causal false --dtypes bf16 --tokens $t --hidden $h --rounds 5
           done ;;
    decode-grid) # the decode grid's CTAs past the plan's items (session 25: 16 x 8k unsplit ran
           # 3.89 TB/s on a 32-item grid, 3.56 on the plan's bound of 49; 12 x 8k 3.3 / 2.85):
           # graph replays with the grid at the plan's items plus 0 / 16 / 64 / 136 and at the
           # bound (~1 min; session 26 ran the fixed grid of columns, IOATTN_SM90_DECODE_LOOP,
           # here too, since removed: tune_sm90_decode_loop_9af71c4_*)
           timeout 200 python benchmarks/tune_decode.py --sm90 --per-sm auto --block-n 64 --stages 3 \
             --cells 16x8192x16,12x8192x16,64x4096x16,1x32768x16 --grid-extra auto,0,16,64,136 \
             --json "$OUT/tune_sm90_decode_grid.json" > "$OUT/tune_sm90_decode_grid.log" 2>&1
           grep "^== best" "$OUT/tune_sm90_decode_grid.log" ;;
    decode-claim) # the sm90 decode's CTAs claiming their units on a graph's bound grid
           # (IOATTN_SM90_DECODE_CLAIM, on by default): the decode kernel's GPU tests, then the
           # grid sweep (the plan's own items, the bound) with claims on / off (~3 min; run
           # `decode-claim decode` for the decode suite after it)
           timeout 200 python -m pytest -q -n 8 -p no:cacheprovider tests/decode/test_decode_sm90.py \
             > "$OUT/tests_decode_sm90.log" 2>&1; grep -E "FAILED|ERROR" "$OUT/tests_decode_sm90.log" | head; tail -1 "$OUT/tests_decode_sm90.log"
           # (CLAIM_CELLS / CLAIM_VARIANTS replace the cells and the switches: claim, prefetch
           # and, optionally, the spread claim (default on), one digit each: "111 110 01")
           for v in ${CLAIM_VARIANTS:-11 01}; do
             sp=${v:2:1}
             IOATTN_SM90_DECODE_CLAIM=${v:0:1} IOATTN_SM90_DECODE_PREFETCH=${v:1:1} \
               IOATTN_SM90_DECODE_CLAIM_SPREAD=${sp:-1} timeout 150 \
               python benchmarks/tune_decode.py --sm90 --per-sm auto --block-n 64 --stages 3 \
               --cells "${CLAIM_CELLS:-16x8192x16,12x8192x16,24x8192x16,64x4096x16,1x32768x16}" \
               --grid-extra auto,0 --json "$OUT/tune_decode_claim$v.json" > "$OUT/tune_decode_claim$v.log" 2>&1
             echo "claim ${v:0:1} prefetch ${v:1:1} spread ${sp:-1}:"; grep "^== best" "$OUT/tune_decode_claim$v.log"
           done ;;
    sched-probe) # where the block scheduler puts a grid's working CTAs when the rest exit at
           # once (benchmarks/sched_probe.py: why a graph's bound grid cost the decode ~10%), eager and in a graph (~20 s)
           timeout 120 python benchmarks/sched_probe.py --json "$OUT/sched_probe.json" 2>&1 | tail -12
           # then where the decode's claims put 12 x 8k's 96 units on its bound grid of 45 items
           # (first come first served against the even SM subset, IOATTN_SM90_DECODE_CLAIM_SPREAD)
           timeout 120 python benchmarks/sched_probe.py --work 12 --items 12,45 \
             --modes positions,claim,spread --json "$OUT/sched_probe_claims.json" 2>&1 | tail -12 ;;
    loader) # the sm90 decode's producer: TMA (default) against cp.async
           # (IOATTN_SM90_DECODE_LOADER=cpasync, a producer warpgroup; cuDNN's cp.async kernel
           # read the same bytes at 2 points more of DRAM peak): the decode GPU tests with it,
           # then graph replays of four cells, the forms interleaved twice, then pages 16 / 64 /
           # 4096 at 64 x 4k with each loader (~4 min; session 27's run also timed a page-table
           # prefetch, since replaced by ROWS_AHEAD)
           IOATTN_SM90_DECODE_LOADER=cpasync timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
             tests/decode/test_decode_sm90.py > "$OUT/tests_decode_cpasync.log" 2>&1
           grep -E "FAILED|ERROR" "$OUT/tests_decode_cpasync.log" | head -5
           echo "tests cpasync: $(tail -1 "$OUT/tests_decode_cpasync.log")"
           for r in 1 2; do for f in ${LOADER_FORMS:-tma:0 cpasync:0}; do
             IOATTN_SM90_DECODE_LOADER=${f%%:*} timeout 100 \
               python benchmarks/tune_decode.py --sm90 --per-sm auto --block-n 64 --stages 3 \
               --grid-extra auto --cells "${LOADER_CELLS:-64x4096x16,16x8192x16,1x32768x16,128x2048x16}" \
               --json "$OUT/tune_decode_loader_${f%%:*}_${f##*:}_$r.json" > "/tmp/tune_decode_loader_${f}_$r.log" 2>&1
             echo "$f round $r:"; grep "^== best" "/tmp/tune_decode_loader_${f}_$r.log"
           done; done
           for l in tma cpasync; do
             IOATTN_SM90_DECODE_LOADER=$l timeout 100 python benchmarks/tune_decode.py --sm90 --per-sm auto \
               --block-n 64 --stages 3 --grid-extra auto --cells 64x4096x16,64x4096x64,64x4096x4096 \
               --json "$OUT/tune_decode_pages_$l.json" > "/tmp/tune_decode_pages_$l.log" 2>&1
             echo "pages $l:"; grep "^== best" "/tmp/tune_decode_pages_$l.log"
           done ;;
    d256-persistent) # the d=256 forward on persistent CTAs (dynamic scheduler; one CTA per
           # tile is its default): the persistent tests (d=256 cases run under every mode), then
           # d=256 forward dynamic / auto with cuDNN in both (~60 + 2 x 100 s)
           timeout 200 python -m pytest -q -n 14 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "persistent_fwd and D256" > "$OUT/tests_d256_persistent.log" 2>&1
           grep -E "^FAILED" "$OUT/tests_d256_persistent.log"; tail -1 "$OUT/tests_d256_persistent.log"
           onoff IOATTN_SM90_PERSISTENT "dynamic auto" fwd_d256_persist --modes fwd --dims 256 \
             --seqlens 2048,4096,8192,16384 --dtypes bf16 ;;
    shallow) # the sm90 decode's ring depth by the work (IOATTN_SM90_DECODE_SHALLOW) and its
           # page-table loads a tile ahead (ROWS_AHEAD): decode GPU tests with the defaults and
           # with SHALLOW=0, then graph replays of five cells, SHALLOW 1 / 0 interleaved twice
           # (~3 min)
           for sh in 1 0; do IOATTN_SM90_DECODE_SHALLOW=$sh timeout 150 python -m pytest -q -n 8 \
             -p no:cacheprovider tests/decode/test_decode_sm90.py > "$OUT/tests_decode_shallow$sh.log" 2>&1
             echo "tests shallow $sh: $(tail -1 "$OUT/tests_decode_shallow$sh.log")"; done
           decode_onoff IOATTN_SM90_DECODE_SHALLOW shallow ;;
    read-probe) # the decode ring's bare read rate (benchmarks/read_probe.py: no math, or a
           # spin standing for it), beside cuDNN and the planned decode over the same K / V,
           # 64 x 4k unless READ_CELL, our settings READ_OURS (read_probe's --ours) (~1 min)
           timeout 300 python benchmarks/read_probe.py --cell "${READ_CELL:-64x4096}" \
             ${READ_CONFIGS:+--configs "$READ_CONFIGS"} ${READ_OURS:+--ours "$READ_OURS"} \
             --json "$OUT/read_probe.json" 2>&1 | tail -40 ;;
    mma16) # the sm90 decode's consumer on mma.sync for groups <= 16 (IOATTN_SM90_DECODE_MMA16):
           # decode GPU tests (on and off), read_probe at 64 x 4k (on / off in one
           # process), then graph replays of five cells, MMA16 1 / 0 interleaved twice (~5 min)
           # (test_sm90_decode runs each case with MMA16 off and on itself)
           timeout 200 python -m pytest -q -n 8 -p no:cacheprovider tests/decode/test_decode_sm90.py \
             > "$OUT/tests_decode_mma16.log" 2>&1; echo "tests: $(tail -1 "$OUT/tests_decode_mma16.log")"
           timeout 200 python benchmarks/read_probe.py --cell 64x4096 --configs 2x64x2x0 \
             --ours 3x1x1x0,3x1x1x1,2x1x0x1 --json "$OUT/read_probe_mma16.json" 2>&1 | tail -16
           decode_onoff IOATTN_SM90_DECODE_MMA16 mma16 ;;
    early) # the sm90 decode's item read before PDL's wait (IOATTN_SM90_DECODE_EARLY):
           # read_probe at 64 x 4k (default / early / two items a CTA, one process), its GPU
           # tests, then graph replays of five cells, EARLY 1 / 0 interleaved twice (~5 min)
           timeout 200 python benchmarks/read_probe.py --cell 64x4096 --configs 2x64x2x0 \
             --ours "${READ_OURS:-3x1x1x0x0x0,3x1x1x0x0x1,2x1x0x0x0x0,2x1x0x0x2x0}" \
             --json "$OUT/read_probe_early.json" 2>&1 | tail -20
           timeout 200 python -m pytest -q -n 8 -p no:cacheprovider tests/decode/test_decode_sm90.py \
             -k "early" > "$OUT/tests_decode_early.log" 2>&1; echo "tests: $(tail -1 "$OUT/tests_decode_early.log")"
           decode_onoff IOATTN_SM90_DECODE_EARLY early ;;
    short-bench) # (`short`'s first part) the sm90 backend forced beside auto and cuDNN at 512 / 1k
           timeout 240 python -m ioattn bench --modes fwd,bwd --dims 64,128,256 --seqlens 512,1024 \
             --dtypes bf16 --impls ioattn,ioattn_sm90,sdpa_cudnn --no-plots \
             --out "$OUT/short_${GPU_TAG}_$(date +%F).json" > "$OUT/short_bench.log" 2>&1
           grep -E "^(fwd|bwd)" "$OUT/short_bench.log" ;;
    bind-tests) # (`pending`'s first part) the kept launches' GPU tests (IOATTN_SM90_FWD_BIND,
           # IOATTN_BIND, the decode's per-layer repeats) (~1-2 min)
           timeout 120 python -m pytest -q -n 8 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             tests/decode/test_decode_sm90.py tests/dense/test_bind.py -k "bind or kept or repeats" \
             > "$OUT/tests_pending.log" 2>&1
           grep -E "FAILED|ERROR" "$OUT/tests_pending.log" | head; tail -1 "$OUT/tests_pending.log" ;;
    pending) # the decisions sessions 34-35 could not measure (no device came), in one call of
           # ~500 s: `bind-tests`, then the steps `host` (fwd_sm90_bind0/1, fwd_triton_bind0/1,
           # bwd_triton_bind0/1), `d256-decode` and `short-bench`, the shortest decisions first
           # should the call's limit cut it; then `tests-rest`, `tests-sm90file`
           bash "$0" bind-tests host d256-decode short-bench ;;
    fp8-sm90-forms) # (session 43) the sm90 fp8 forms that are opt-in: block descales
           # (ioattn_fp8 rows with IOATTN_SM90_FP8_BLOCK=1 run the sm90 form; the fp8-sm90
           # step's ioattn_fp8 rows are the portable kernel's) and persistent CTAs
           # (IOATTN_SM90_FP8_PERSISTENT=1 / 0), each with Q in registers or not
           # (IOATTN_SM90_FWD_Q_REGS), cuDNN's bf16 in each run (JSONs fp8_sm90_pers<p>_qregs<q>);
           # FP8_DIMS / FP8_SEQLENS as fp8-sm90 (default 2k and 16k here; ~1.5 min a run warm,
           # more cold: each pair compiles its own forms; FP8_FORMS_PQ picks the pairs,
           # "persistent qregs|..." -- two a call if cold, e.g. FP8_FORMS_PQ="0 0|1 0")
           IFS='|' read -ra pqs <<< "${FP8_FORMS_PQ:-0 0|1 0|0 1|1 1}"
           for pq in "${pqs[@]}"; do
             read -r v qr <<< "$pq"
             IOATTN_SM90_FP8=1 IOATTN_SM90_FP8_BLOCK=1 IOATTN_SM90_FP8_PERSISTENT=$v \
               IOATTN_SM90_FWD_Q_REGS=$qr timeout 140 \
               python -m ioattn bench --modes fwd --dims "${FP8_DIMS:-64,128,256}" \
               --seqlens "${FP8_SEQLENS:-2048,16384}" --rounds 3 --no-plots \
               --impls ioattn_fp8,ioattn_fp8_head,sdpa_cudnn \
               --out "$OUT/fp8_sm90_pers${v}_qregs${qr}_${GPU_TAG}_$(date +%F).json" \
               > "/tmp/fp8_pers${v}_$qr.log" 2>&1
             echo "== persistent $v, Q in registers $qr (block descales on sm90)"
             grep -E "^fwd" "/tmp/fp8_pers${v}_$qr.log"
           done ;;
    q-regs) # (session 43) Q's first columns in registers as Q·Kᵀ's A operand
           # (IOATTN_SM90_FWD_Q_REGS, opt-in; d=128 all of Q with the exponentials early without
           # a mask, d=256 64 columns): its GPU tests, then the d = 128 / 256 forward on / off,
           # cuDNN in each run (JSONs fwd_q_regs{1,0}); FWD_SEQLENS narrows it
           timeout 150 python -m pytest -q -n 8 -p no:cacheprovider -rf tests/dense/test_sm90.py \
             -k "q_regs" > "$OUT/tests_q_regs.log" 2>&1
           grep -E "^FAILED|^ERROR" "$OUT/tests_q_regs.log" | head; tail -1 "$OUT/tests_q_regs.log"
           onoff IOATTN_SM90_FWD_Q_REGS "1 0" fwd_q_regs --modes fwd --dims 128,256 \
             --seqlens "${FWD_SEQLENS:-2048,4096,16384}" --dtypes bf16
           # (d=128 without a mask takes the exponentials early with Q in registers: 826 of its
           # 827 loop instructions are that form's, so time it alone too)
           bench_with IOATTN_SM90_FWD_EXP_EARLY=1 fwd_q_regs_early_only --modes fwd --dims 128 \
             --seqlens "${FWD_SEQLENS:-2048,4096,16384}" --dtypes bf16 ;;
    cudnn-names) # (session 43) the kernels cuDNN's SDPA runs for the FA grid's d = 64 / 128 /
           # 256 forward and backward at 2k (their names carry the tile: "..._64x128x128_..."),
           # to compare with ours where it leads (d=256 non-causal 2k / 4k)
           timeout 120 python - > "$OUT/cudnn_names.log" 2>&1 <<'PY'
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
for d in (64, 128, 256):
    for causal in (False, True):
        h, s = 2048 // d, 2048
        q, k, v = (torch.randn(8, h, s, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa(q, k, v, is_causal=causal).sum().backward()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                sdpa(q, k, v, is_causal=causal).sum().backward()
                torch.cuda.synchronize()
        names = sorted({e.name for e in prof.events() if "cudnn" in e.name and "sdpa" in e.name})
        print(f"d={d} causal={causal}:", *names, sep="\n  ")
PY
           cat "$OUT/cudnn_names.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
[ -n "${DMON:-}" ] && kill "$DMON"; true
