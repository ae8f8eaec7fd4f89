#!/usr/bin/env bash
# Every GPU check of the project in one bounded command, for a lent GPU machine (no network):
# the CUDA tests (tests/test_gpu.py), the per-step benchmark (ops.bench.gpu_step), the engine in
# process (ops.bench.gpu_engine) and the whole stack against the stock pipeline (ops.bench.e2e_gpu).
# From the project root, after `bash ../shared/gpu/prepare.sh` here:
#   device run (carry .gpu):  source .gpu/setup.sh && bash ops/gpu_checks.sh
# Results go to $OUT (the device tool's folder; ./gpu-out elsewhere), 7 files (the tool returns 8 at
# most): summary.txt (GPU, driver, versions, each stage's exit status and seconds), tests.log, each
# benchmark's report (gpu_step.md, gpu_reuse.md, gpu_engine.md, e2e_gpu.md) and details.tar.gz (their
# .json and .log). Each stage has its own time limit (580 s together: the device allows 600 s a
# command), so one that hangs or runs long leaves the others' results; GPU_CHECKS=tests,step,reuse,engine,e2e
# selects stages.
# The add-on benchmarks (ops.bench.addons_gpu: LoRA latency and long-tail trace against diffusers'
# load_lora_weights path, one ControlNet against StableDiffusionControlNetInpaintPipeline) are stage
# `addons`, not in the default list (no room left in one command): run them as a second command,
#   device run (carry .gpu):  source .gpu/setup.sh && GPU_CHECKS=addons bash ops/gpu_checks.sh
# which leaves summary.txt, addons_gpu.md and details.tar.gz in $OUT. Stage `profile` (also only when
# named, about a minute: GPU_CHECKS=profile, or with the add-ons) fits the cost model of the true-size
# SD 1.5 UNet on the card (`stencil profile --device cuda`: graph-replayed steps, pinned host copies):
# sd15-inpaint--cuda.json in $OUT is the measured GPU cost model to ship in ops/sim/costmodels. Stage
# `arrivals` (only when named, two to three minutes) runs the mask-aware engine under Poisson arrivals
# with the engine's token buckets and coarser ones, each with steps widened to wider batches' graphs
# and without (gpu_engine_loads.md): whether fewer eager steps pay for their padded tokens. Stage
# `resnets` (only when named, about a minute) times SD 1.5's and SDXL's mask-aware step with their
# ResNets computed at the masked tokens too (gpu_resnets.md; workers/maskaware/resnets.py). The
# second command for all four:
#   device run (carry .gpu):  source .gpu/setup.sh && GPU_CHECKS=addons,profile,arrivals,resnets bash ops/gpu_checks.sh
# A lent machine's device time (15 minutes, a start included) holds the default command and about three
# minutes more: spend them, with the machine still warm, on the stage that decides the most next,
#   device run (carry .gpu):  source .gpu/setup.sh && GPU_CHECKS=resnets bash ops/gpu_checks.sh
# (whether SDXL's mask-aware step reaches 2.5x once its ResNets compute around the mask).
# Stage `compiled` (only when named; compilation takes minutes: a command of its own) times SD 1.5's
# full and mask-aware steps replayed as the engine's CUDA graphs with the eager kernels, with
# STENCIL_COMPILE=default's compiled kernels inside them, and under reduce-overhead (gpu_compiled.md):
#   device run (carry .gpu):  source .gpu/setup.sh && GPU_CHECKS=compiled bash ops/gpu_checks.sh
set -uo pipefail
# Each process of a stack would otherwise compile diffusers and the project anew where the
# environment forbids caching bytecode (device time is scarce).
unset PYTHONDONTWRITEBYTECODE
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGES=${GPU_CHECKS:-tests,step,reuse,engine,e2e}
work=$(mktemp -d)  # the benchmarks' .json and .log, packed into one file at the end
export OUT work
summary="$OUT/summary.txt"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)"
  # what the stack's processes import besides (the workers' metrics, the queue)
  python3 -c "import celery, redis, prometheus_client; print('celery', celery.__version__, 'redis-py', redis.__version__, 'prometheus_client ok')"
} > "$summary" 2>&1

pack() {  # the benchmarks' .json and .log so far into one file of $OUT (again after every stage:
  # a command the device tool cuts at its limit still returns what the finished stages left)
  (cd "$work" && shopt -s nullglob && files=(*.json *.log) && ((${#files[@]})) && tar -czf "$OUT/details.tar.gz" -- "${files[@]}")
}

stage() {  # name, seconds, command...; SIGNAL=INT for pytest (it prints its summary on INT, not on TERM)
  local name=$1 limit=$2; shift 2
  case ",$STAGES," in *",$name,"*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout -s "${SIGNAL:-TERM}" -k 15 "$limit" "$@"  # to the stage's process group (a benchmark stops its stacks), KILL 15 s on
  echo "$name rc=$? ${limit}s-limit took=$((SECONDS - t0))s" >> "$summary"
  # A stack's processes lead sessions of their own: any a killed stage left would hold the GPU.
  pkill -KILL -f -- '-m app[.](cli|preloaded)( |$)' 2>/dev/null
  pack
}

bench() {  # module [options]: its report into $OUT, its JSON and log into $work
  local m=$1; shift
  exec python3 -m "ops.bench.$m" --out "$OUT/$m.md" --json "$work/$m.json" "$@" > "$work/$m.log" 2>&1
}
export -f bench

SIGNAL=INT stage tests 100 bash -c "exec python3 -m pytest -m gpu -p no:xdist -q -rA --durations=10 tests/test_gpu.py > '$OUT/tests.log' 2>&1"
# 4 interleaved rounds (the benchmark's default is 10): its three models in the stage's time.
stage step 130 bash -c "bench gpu_step --rounds 4"
# temporal reuse (turbo) per step: SD 1.5 and Flux, its own report
stage reuse 40 bash -c "exec python3 -m ops.bench.gpu_step --parts reuse --models sd15,flux --rounds 4 --out '$OUT/gpu_reuse.md' --json '$work/gpu_reuse.json' > '$work/gpu_reuse.log' 2>&1"
stage engine 110 bash -c "bench gpu_engine"
# Its defaults are sized for this stage: SD 1.5 512 px bf16, a 178 s budget here (model save, loads and warm-ups in it).
stage e2e 200 bash -c "bench e2e_gpu --budget-s 178"
# Only when named (GPU_CHECKS=addons): a 150 s budget (model save, loads, adapters and ControlNet made in it).
stage addons 200 bash -c "bench addons_gpu"
# Its raw points are written after each one: a stage cut at its limit leaves what `--refit` fits.
stage profile 120 bash -c "exec python3 -m ops.bench.profile --device cuda --model sd15-inpaint --points 48 --max-jobs 16 \
  --out '$OUT/sd15-inpaint--cuda.json' --report '$OUT/profile.md' --raw '$work/sd15-inpaint--cuda.points.json' > '$work/profile.log' 2>&1"
# The engine's configuration first (growth 1.25, widening 1.5); the report is rewritten after each run.
stage arrivals 170 bash -c "exec python3 -m ops.bench.gpu_engine --systems stencil-maskaware --jobs 32 --loads 0.8 \
  --growth 1.25,2 --widen 1.5,1 --out '$OUT/gpu_engine_loads.md' --json '$work/gpu_engine_loads.json' > '$work/gpu_engine_loads.log' 2>&1"
# SDXL first: whether it reaches 2.5x is what this stage decides (a stage cut at its limit keeps the JSON so far).
stage resnets 80 bash -c "exec python3 -m ops.bench.gpu_step --parts resnets --models sdxl,sd15 --ratios 0.1,0.2 \
  --rounds 4 --out '$OUT/gpu_resnets.md' --json '$work/gpu_resnets.json' > '$work/gpu_resnets.log' 2>&1"
# Compilations first (their times logged as they finish), then interleaved rounds.
stage compiled 290 bash -c "exec python3 -m ops.bench.gpu_step --parts compiled --models sd15 --ratios 0.2 \
  --rounds 4 --out '$OUT/gpu_compiled.md' --json '$work/gpu_compiled.json' > '$work/gpu_compiled.log' 2>&1"
rm -rf "$work"
cat "$summary"
