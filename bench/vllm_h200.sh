#!/usr/bin/env bash
# The vLLM + FCA measurements on a GPU machine, in steps of a few minutes each (bench/vllm_fca.py).
# Results go to $OUT (or ./vllm-results). vLLM 0.24.0 and its dependencies come as wheels in .vllm/
# (bench/README.md: a GPU machine without internet access); a wheel too large for the transfer
# may come in parts (vllm.partNN in /tmp/vp), which `install` joins.
#
#   bash bench/vllm_h200.sh install      # carry .vllm/deps and .whl: joins the parts, installs all
#   bash bench/vllm_h200.sh kernels      # the plain build's cost, the work builder (eager vs CUDA graph), the FCA kernel table (no vLLM)
#   bash bench/vllm_h200.sh bf16         # default then FCA: throughput, greedy, weight sync (~7 min)
#   bash bench/vllm_h200.sh bf16-default # bf16's default side, every shape three times (median; ~5.5 min) ...
#   bash bench/vllm_h200.sh bf16-fca     # ... and its FCA side with --weight-sync, then --compare (~5 min)
#   bash bench/vllm_h200.sh gate         # the shape that shares nothing and 4x64@1024, default (with weight sync) then FCA (~6 min)
#   bash bench/vllm_h200.sh spread       # 4x64@1024 three times per engine under py-spy, GPU traced: the spread within and across engines (~5 min)
#   bash bench/vllm_h200.sh fp32-fca     # greedy and weight sync without bf16 rounding (~5 min) ...
#   bash bench/vllm_h200.sh fp32-default # ... and the default side of the fp32 greedy check, then --compare
set -euo pipefail
out=${OUT:-vllm-results}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:bench PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH  # py-spy's binary (its wheel in .whl)

run() {  # run SECONDS NAME ARGS...: one engine per process; its log and JSON land in $out
  local seconds=$1 name=$2; shift 2
  timeout "$seconds" python3 bench/vllm_fca.py "$@" --out "$out/$name.json" >"$out/$name.log" 2>&1 || echo "$name: rc=$?"
  grep "^{" "$out/$name.log" | tail -1 | cut -c1-400 || true
}

trace_gpu() {  # GPU busy share, clocks and power every 100 ms into $out/gpu_NAME.csv, in the background
  # (an engine bound by its host leaves the GPU idle between steps)
  nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 \
    >"$out/gpu_$1.csv" 2>&1 &
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # the trace stops with the step

case ${1:?usage: $0 install|kernels|bf16|bf16-default|bf16-fca|gate|gate-fca|spread|fp32-fca|fp32-default} in
  install)
    cat /tmp/vp/vllm.part* >/tmp/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/vllm-0.24.0-*.whl .vllm/deps/*.whl .whl/*.whl
    python3 -c "import vllm; print('vllm', vllm.__version__)"; py-spy --version ;;
  kernels)  # also the FCA kernel table of issue 4 (Qwen3-8B heads)
    timeout 120 python3 bench/fca_device_work.py --plain-cost 2>&1 | tail -1 || echo "plain-cost: failed"
    timeout 300 python3 bench/fca_device_work.py >"$out/device_work.log" 2>&1 || echo "device-work: rc=$?"
    grep "^{'shape'\|failed" "$out/device_work.log" | cut -c1-500 || true
    timeout 300 python3 bench/fca_kernels.py >"$out/fca_kernels.log" 2>&1 || echo "fca_kernels: rc=$?"
    grep "^groups" "$out/fca_kernels.log" | cut -c1-300 || true ;;
  bf16)
    run 280 default --mode default
    run 310 fca --mode fca --weight-sync
    python3 bench/vllm_fca.py --compare "$out/default.json" "$out/fca.json" | tail -1 ;;
  bf16-default)  # as bf16, three timed runs per shape (other prompts each time), in two calls
    trace_gpu default
    run 560 default --mode default --repeat 3
    cp "$out/default.json" /tmp/default.json || true ;;  # for bf16-fca, while the machine stays warm
  bf16-fca)
    trace_gpu fca
    run 500 fca --mode fca --weight-sync --repeat 3
    python3 bench/vllm_fca.py --compare "${DEFAULT:-/tmp/default.json}" "$out/fca.json" | tail -1 ;;
  gate)  # a batch that shares nothing must cost nothing (the host's block-table check); bf16 sleep/wake without FCA
    run 250 default_gate --mode default --weight-sync --shapes 128x1@2048,4x64@1024
    run 200 fca_gate --mode fca --shapes 128x1@2048,4x64@1024
    python3 bench/vllm_fca.py --compare "$out/default_gate.json" "$out/fca_gate.json" | tail -1 ;;
  spread)  # the shape whose speedup moved most between engines, three runs in each (FCA_FIRST=1: FCA's engine first),
    # with the GPU traced and each timed run under py-spy (engine core and frontend: where the host's time goes)
    trace_gpu spread
    modes=(default fca); [ -n "${FCA_FIRST:-}" ] && modes=(fca default)
    for mode in "${modes[@]}"; do
      run 200 "${mode}_spread" --mode "$mode" --shapes 4x64@1024 --repeat 3 --py-spy "$out/py-spy-$mode"
    done
    python3 bench/vllm_fca.py --compare "$out/default_spread.json" "$out/fca_spread.json" | tail -1 ;;
  gate-fca)  # gate's FCA side alone (compare with a gate run's default_gate.json)
    run 150 fca_gate --mode fca --shapes 128x1@2048,4x64@1024 ;;
  fp32-fca)
    run 560 fca32 --mode fca --dtype float32 --greedy-only --weight-sync
    cp "$out/fca32.json" /tmp/fca32.json || true ;;  # for fp32-default, while the machine stays warm
  fp32-default)  # compares with fp32-fca's JSON (FCA32, default: its copy in /tmp)
    run 500 default32 --mode default --dtype float32 --greedy-only
    python3 bench/vllm_fca.py --compare "$out/default32.json" "${FCA32:-/tmp/fca32.json}" | tail -1 ;;
esac
