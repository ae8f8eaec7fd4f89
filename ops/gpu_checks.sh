#!/usr/bin/env bash
# Every GPU check of the project in one bounded command, for a lent GPU machine (no network):
# the CUDA tests (tests/test_gpu.py), the per-step benchmark (ops.bench.gpu_step) and the engine in
# process (ops.bench.gpu_engine). From the project root, after `bash ../shared/gpu/prepare.sh` here:
#   device run (carry .gpu):  source .gpu/setup.sh && bash ops/gpu_checks.sh
# Results go to $OUT (the device tool's folder; ./gpu-out elsewhere), at most 8 files:
# summary.txt (GPU, driver, versions, each stage's exit status and seconds), tests.log, and each
# benchmark's .md, .json and .log. Each stage has its own time limit, so one that hangs or runs
# long leaves the others' results; GPU_CHECKS=tests,step,engine selects stages.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
STAGES=${GPU_CHECKS:-tests,step,engine}
summary="$OUT/summary.txt"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)"
} > "$summary" 2>&1

stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  case ",$STAGES," in *",$name,"*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "$name rc=$? ${limit}s-limit took=$((SECONDS - t0))s" >> "$summary"
}

stage tests 180 bash -c "python3 -m pytest -m gpu -p no:xdist -q -rA tests/test_gpu.py > '$OUT/tests.log' 2>&1"
stage step 240 bash -c "python3 -m ops.bench.gpu_step --out '$OUT/gpu_step.md' --json '$OUT/gpu_step.json' > '$OUT/gpu_step.log' 2>&1"
stage engine 150 bash -c "python3 -m ops.bench.gpu_engine --out '$OUT/gpu_engine.md' --json '$OUT/gpu_engine.json' > '$OUT/gpu_engine.log' 2>&1"
cat "$summary"
