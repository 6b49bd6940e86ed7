#!/usr/bin/env bash
# One call on the GPU machine: GPU tests and benchmarks, logs and JSON under $OUT.
#
#   OUT=out bash benchmarks/run_gpu.sh [smoke] [tests] [unmarked] [tiles] [bwdtiles] [mmtiles] [bench] [short] [gluon] [gluonbwd] [gluonmm] [bwd] [train] [matmul]
#                                      [mlp] [quant] [qtiles] [host] [cluster] [clustertime] [clusterlaunch]
#                                      [flex] [window] [demo] [check] [memory] [ncu] [ncustalls]
#   (default: tests bench demo check; unmarked: the tests without the gpu mark, on the GPU; TESTS_K selects tests, TESTS_TIMEOUT limits them, TESTS_N workers,
#   MM_KINDS narrows mmtiles to some kinds of scaling,
#   MM_SHAPES="M,N,K;..." narrows the matmul stages; HEAD_DIMS narrows gluon and bwdtiles; GLUON_PROVIDERS
#   picks the gluon stage's providers; BWD_VARY and TAG narrow and
#   name the backward tile search)
#
# Runs from a checkout without installing it (the GPU image already has torch,
# triton, pytest and rich). Each stage has its own time limit, so one that hangs
# cannot take the others with it; results land in $OUT as they are made.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests bench demo check)

python3 -m qflash.cli info 2>&1 | tee "$OUT/info.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$OUT/info.txt" 2>&1

for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case "$stage" in
    smoke)  timeout 120 python3 benchmarks/smoke.py 2>&1 | tail -n 30 ;;
    tests)  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest tests -m gpu -v -p no:cacheprovider -rf --durations=30 -n "${TESTS_N:-8}" ${TESTS_K:+-k "$TESTS_K"} \
              2>&1 | grep -v "Warning\|warner" | tee "$OUT/gpu_tests.log" | grep -v PASSED | tail -n 60 ;;
    unmarked) timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest tests -m "not gpu" -q -p no:cacheprovider -rf -n "${TESTS_N:-8}" \
              ${TESTS_K:+-k "$TESTS_K"} 2>&1 | grep -v "Warning\|warner" | tee "$OUT/gpu_tests_unmarked.log" | tail -n 30 ;;
    tiles)  timeout 300 python3 -m qflash.bench.attention --tiles --seqlens 512,4096,16384 \
              --out "$OUT/attention_tiles.json" 2>&1 | tail -n 40 ;;
    bench)  timeout 240 python3 -m qflash.cli bench attention \
              --providers qflash,sdpa_cudnn,sdpa_flash,sdpa_efficient,sdpa_math,naive --ceilings --memory \
              --out "$OUT/attention_fwd.json" 2>&1 | tail -n 70 ;;
    bwdtiles) timeout "${BWDTILES_TIMEOUT:-420}" python3 -m qflash.bench.attention --tiles --backward --seqlens 1024,8192 \
              --head-dims "${HEAD_DIMS:-64,128,256}" --vary "${BWD_VARY:-dq,dkdv}" \
              --out "$OUT/attention_bwd_tiles${TAG:-}.json" 2>&1 | tail -n 40 ;;
    mmtiles) timeout "${MMTILES_TIMEOUT:-300}" python3 -m qflash.cli bench matmul --tiles ${MM_SHAPES:+--shapes "$MM_SHAPES"} \
              ${MM_KINDS:+--kinds "$MM_KINDS"} --out "$OUT/matmul_tiles.json" 2>&1 | tail -n 60 ;;
    bwd)    timeout 200 python3 -m qflash.cli bench attention-backward --seqlens 1024,4096,16384 \
              --out "$OUT/attention_bwd.json" 2>&1 | tail -n 30 ;;
    short)  timeout 200 python3 -m qflash.cli bench attention --providers qflash,sdpa_cudnn,sdpa_flash --graph \
              --seqlens 512,1024,2048 --out "$OUT/attention_fwd_short.json" 2>&1 | tail -n 30 ;;
    gluon)  timeout 150 python3 -m pytest tests/test_attention_gluon.py -m gpu -q -p no:cacheprovider -n 8 2>&1 \
              | tee "$OUT/gpu_tests_gluon.log" | tail -n 15
            timeout 360 python3 -m qflash.cli bench attention --providers ${GLUON_PROVIDERS:-qflash_gluon,qflash_tl,sdpa_cudnn,sdpa_flash} \
              --head-dims ${HEAD_DIMS:-64,128,256} --out "$OUT/attention_fwd_gluon.json" 2>&1 | tail -n 30 ;;
    gluonbwd) timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest tests/test_attention_gluon.py -m gpu -q -p no:cacheprovider -n 8 \
              -k "backward or gradients" 2>&1 | tee "$OUT/gpu_tests_gluon_bwd.log" | tail -n 25
            timeout 300 python3 -m qflash.cli bench attention-backward --seqlens ${SEQLENS:-1024,4096,16384} \
              --providers ${GLUON_PROVIDERS:-qflash,qflash_deterministic,sdpa_cudnn,sdpa_flash} --head-dims ${HEAD_DIMS:-64,128,256} \
              --out "$OUT/attention_bwd_gluon.json" 2>&1 | tail -n 40 ;;
    gluonmm) timeout 200 python3 -m pytest tests/test_matmul_gluon.py -m gpu -q -p no:cacheprovider -n 8 2>&1 \
              | tee "$OUT/gpu_tests_gluon_matmul.log" | tail -n 15
            timeout 300 python3 -m qflash.cli bench matmul ${MM_SHAPES:+--shapes "$MM_SHAPES"} --out "$OUT/matmul_gluon.json" \
              --providers "qflash int8 (row x col),qflash gluon int8 (row x col),torch._int_mm,qflash fp8 (tensor),qflash gluon fp8 (tensor),torch._scaled_mm (tensor),qflash fp8 (row x col),qflash gluon fp8 (row x col),torch._scaled_mm (row x col)" \
              2>&1 | tail -n 40 ;;
    cluster) # the matmul in clusters of two or four CTAs (an experiment): its steps alone first, each test
            # file under a short limit (a hang in the clusters' protocol costs minutes); then clustertime
            timeout 150 python3 -m pytest tests/test_gluon_common.py -m gpu -q -p no:cacheprovider -rf 2>&1 \
              | tee "$OUT/gpu_tests_cluster_steps.log" | tail -n 15
            [ "${PIPESTATUS[0]}" -eq 0 ] && timeout 330 python3 -m pytest tests/test_matmul_gluon.py -m gpu -q \
              -p no:cacheprovider -rf -n 8 -k cluster 2>&1 | tee "$OUT/gpu_tests_cluster.log" | tail -n 15 ;;
    clustertime) # per tensor at M = 128 (pairs sharing A or B) and M = 16 (the transposed product's pairs and
            # fours, one and two CTAs an SM), cold weights, three rounds; CLUSTER_M128 / _M16 name other variants
            timeout 270 python3 benchmarks/gluon_mm_variants.py --m 128 --scales tensor --weights cold \
              --rounds 3 --variants "${CLUSTER_M128:-public,autoCA,autoCB}" --out "$OUT/matmul_fp8_cluster_m128.json" \
              2>&1 | tail -n 30
            timeout 300 python3 benchmarks/gluon_mm_variants.py --m 16 --scales tensor --weights cold \
              --rounds 3 --variants "${CLUSTER_M16:-public,wx1,wCA,wCA4,wx2CA4}" \
              --out "$OUT/matmul_fp8_cluster_m16.json" 2>&1 | tail -n 45 ;;
    clusterlaunch) # what a launch in clusters costs: chains of a near-empty kernel in and out of clusters, with and
            # without the cluster barrier and programmatic dependent launch
            timeout 120 python3 benchmarks/cluster_launch_probe.py --out "$OUT/cluster_launch_probe.json" 2>&1 | tail -n 60 ;;
    host)   timeout 120 python3 benchmarks/host_overhead.py --op matmul --out "$OUT/host_matmul.json" 2>&1 | head -n 45
            timeout 120 python3 benchmarks/host_overhead.py --op attention --out "$OUT/host_attention.json" 2>&1 | head -n 45 ;;
    train)  timeout 80 python3 benchmarks/train_gpt.py --steps 300 --out "$OUT/train_gpt.json" 2>&1 | tail -n 20 ;;
    matmul) timeout 480 python3 -m qflash.cli bench matmul ${MM_SHAPES:+--shapes "$MM_SHAPES"} --out "$OUT/matmul.json" 2>&1 | tail -n 40 ;;
    mlp)    timeout 120 python3 -m qflash.cli bench matmul --mlp --out "$OUT/mlp.json" 2>&1 | tail -n 15 ;;
    quant)  timeout 120 python3 -m qflash.cli bench quantize --out "$OUT/quantize.json" 2>&1 | tail -n 25 ;;
    qtiles) timeout 150 python3 -m qflash.cli bench quantize --tiles --out "$OUT/quantize_tiles.json" 2>&1 | tail -n 60 ;;
    flex)   timeout 120 python3 -m qflash.cli bench attention --providers qflash,flex --seqlens 2048,8192 \
              --head-dims 64,128 --out "$OUT/attention_flex.json" 2>&1 | tail -n 12 ;;
    window) timeout 150 python3 benchmarks/window_fwd.py --out "$OUT/attention_fwd_window.json" 2>&1 | tail -n 30 ;;
    demo)   timeout 120 python3 -m qflash.cli demo --plot "$OUT/demo.png" 2>&1 | tail -n 30 ;;
    check)  timeout 120 python3 -m qflash.cli check > "$OUT/check.log" 2>&1; tail -n 5 "$OUT/check.log" ;;
    memory) timeout 120 python3 -m qflash.cli bench attention --providers qflash --seqlens 1024 --head-dims 128 \
              --causal false --memory --out "$OUT/attention_memory.json" 2>&1 | tail -n 20 ;;
    ncu)    timeout 420 ncu --profile-from-start off --clock-control none --nvtx --section SpeedOfLight \
              --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats \
              --section ComputeWorkloadAnalysis --section SchedulerStats -o "$OUT/probe" \
              python3 benchmarks/ncu_probe.py ${NCU_ARGS:-} 2>&1 | tail -n 30
            ncu --import "$OUT/probe.ncu-rep" --page details --print-nvtx-rename kernel > "$OUT/ncu_details.txt" ;;
    ncustalls) # warp-stall samples by SASS instruction, one ncu process a kernel: NCU_JOBS, ';'-separated labels of
            # ncu_probe.py --cluster's jobs (the default: pairs at 8192^3 and fours at M = 16 70B down, each beside
            # the kernel without clusters); the CSVs summed by benchmarks/ncu_stalls.py
            IFS=';' read -ra ncu_jobs <<< "${NCU_JOBS:-ours M=8192 70B o tensor plain;ours M=8192 70B o tensor clusters of 2 sharing A;ours M=16 70B down tensor plain;ours M=16 70B down tensor clusters of 4 sharing A}"
            for job in "${ncu_jobs[@]}"; do
              tag=$(printf %s "$job" | tr -c 'A-Za-z0-9=' _)
              timeout 150 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
                --section SourceCounters -o "$OUT/stalls_$tag" python3 benchmarks/ncu_probe.py --cluster --only "$job" 2>&1 | tail -n 3
              ncu --import "$OUT/stalls_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/stalls_$tag.csv"
              ncu --import "$OUT/stalls_$tag.ncu-rep" --page details > "$OUT/stalls_$tag.txt"
            done
            python3 benchmarks/ncu_stalls.py "$OUT"/stalls_*.csv > "$OUT/ncu_stalls.txt"; tail -n 45 "$OUT/ncu_stalls.txt" ;;
    *) echo "unknown stage $stage (smoke, tests, unmarked, tiles, bwdtiles, mmtiles, bench, short, gluon, gluonbwd, gluonmm, bwd, train, matmul, mlp, quant, qtiles, host, cluster, clustertime, clusterlaunch, flex, window, demo, check, memory, ncu, ncustalls)"; exit 2 ;;
  esac
done
