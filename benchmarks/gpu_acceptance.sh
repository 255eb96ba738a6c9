#!/usr/bin/env bash
# The GPU acceptance runs of remat, one part per command (each well inside a 10-minute limit), from the repository root:
#
#   bash benchmarks/gpu_acceptance.sh wheels      # here, with pip and the network: the wheels a bare GPU image lacks
#   bash benchmarks/gpu_acceptance.sh cuda-tests  # on the GPU machine: the CUDA-path tests (pytest -m gpus), ~1 minute
#   bash benchmarks/gpu_acceptance.sh suite       # on the GPU machine: the whole test suite (CUDA tests included)
#   bash benchmarks/gpu_acceptance.sh policies    # every checkpointing policy x loss at the seed shape (bench_gpu.py)
#   bash benchmarks/gpu_acceptance.sh loss        # the fused loss against plain, cut-cross-entropy, liger
#   bash benchmarks/gpu_acceptance.sh backends    # the seed step with each fused-loss backend forced, and auto's choice
#   bash benchmarks/gpu_acceptance.sh selective   # remat's and torch's selective checkpointing, one step profiled each
#   bash benchmarks/gpu_acceptance.sh estimate    # remat's estimate against torch.cuda.max_memory_allocated
#   bash benchmarks/gpu_acceptance.sh profile     # remat profile: auto at 15/20/25/30 GiB against the uniform policies
#   bash benchmarks/gpu_acceptance.sh long        # the long-context setting at 512k tokens and on
#   bash benchmarks/gpu_acceptance.sh context     # context parallelism over every visible GPU (2 or more; torchrun)
#   bash benchmarks/gpu_acceptance.sh trl         # prepare_trainer auto in TRL's SFTTrainer: predicted vs measured
#   bash benchmarks/gpu_acceptance.sh pareto      # memory against step time: remat's policies and auto beside every peer
#
# Several parts may be named in one call (`... policies loss`). On the GPU machine the wheels fetched by `wheels`
# (in .whl/, which git ignores: carry it along) are installed into /tmp/site and put on PYTHONPATH with src/. Every
# result file is written under benchmarks/results/ named by the GPU and torch version, and copied to $OUT when that
# is set (the project's device tool brings $OUT back). Without a CUDA device each measuring part stops with its script's own message (status 2).
# PYTHON names the interpreter (default python3: the GPU image's, which holds torch), WHEELS_DIR the wheels' folder.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHL=${WHEELS_DIR:-.whl}

# Python packages a GPU image with torch and transformers may lack (remat's config validation, the kernel packages
# the loss comparison calls, datasets for the data tests, torchao for FP8), at the versions this project tests (constraints.txt, the
# cuda-kernels extra; dill and multiprocess as datasets pulls them in).
WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
        datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5 cut-cross-entropy==25.1.1
        trl==1.16.0 accelerate==1.15.0 torchao==0.18.0)

fetch_wheels() {
  mkdir -p "$WHL"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$WHL" "${WHEELS[@]}"
}

prepare() {
  if compgen -G "$WHL/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
      || return 1
    export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONUNBUFFERED=1
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
        torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")'
}

keep_results() {  # copy this part's result files to $OUT (the device tool brings back at most 8 files)
  [ -n "${OUT:-}" ] || return 0
  local file
  for file in "$@"; do [ -f "$file" ] && cp "$file" "$OUT/"; done
  return 0
}

part() {
  local name=$1 start=$SECONDS rc
  echo "== gpu_acceptance: $name"
  case "$name" in
    cuda-tests)
      "$PY" -m pytest -q -p no:cacheprovider -m gpus -n 4 tests 2>&1 | tee "${OUT:-/tmp}/cuda_tests.log"
      rc=${PIPESTATUS[0]} ;;
    suite)
      "$PY" -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 | tee "${OUT:-/tmp}/suite.log"; rc=${PIPESTATUS[0]} ;;
    policies) "$PY" benchmarks/bench_gpu.py; rc=$?
      keep_results benchmarks/results/gpu_policies_*.md benchmarks/results/gpu_policies_*.json ;;
    backends) "$PY" benchmarks/bench_gpu.py --stem gpu_loss_backends --losses plain,fused,fused:torch,fused:liger,fused:cce \
        --rows "none;full;transformers activation_checkpointing_enable()"; rc=$?
      keep_results benchmarks/results/gpu_loss_backends_*.md benchmarks/results/gpu_loss_backends_*.json ;;
    selective) "$PY" benchmarks/bench_gpu.py --stem gpu_selective --losses plain --rows "none;full;selective;torch-sac" \
        --profile selective,torch-sac; rc=$?
      keep_results benchmarks/results/gpu_selective_*.md benchmarks/results/gpu_profile_*.md ;;
    long) "$PY" benchmarks/bench_gpu.py --long-context; rc=$?
      keep_results benchmarks/results/gpu_long_context_*.md benchmarks/results/gpu_long_context_*.json ;;
    loss) "$PY" benchmarks/bench_loss_cuda.py; rc=$?
      keep_results benchmarks/results/loss_cuda.md benchmarks/results/loss_cuda.json ;;
    estimate) "$PY" benchmarks/bench_estimate_cuda.py; rc=$?
      keep_results benchmarks/results/estimate_cuda*.md benchmarks/results/estimate_cuda*.json ;;
    profile) "$PY" benchmarks/profile_seed_cuda.py; rc=$?
      keep_results benchmarks/results/profile_seed_*.md benchmarks/results/profile_seed_*.json ;;
    pareto)  # written straight to $OUT when set: a run stopped at the call's limit keeps the rows it measured;
      # PARETO_ARGS: more options, split on spaces (row labels with spaces: run bench_pareto.py itself)
      "$PY" benchmarks/bench_pareto.py --out "${OUT:-benchmarks/results}" ${PARETO_ARGS:-}; rc=$? ;;
    trl) "$PY" benchmarks/bench_trl_auto.py --device cuda; rc=$?
      keep_results benchmarks/results/trl_auto_cuda.md benchmarks/results/trl_auto_cuda.json ;;
    context)  # one process per GPU: NCCL takes no two ranks on one device, so it needs a multi-GPU machine
      local gpus
      gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
      if [ "${gpus:-0}" -lt 2 ]; then
        echo "gpu_acceptance: context needs 2 or more GPUs; this machine has ${gpus:-0}" >&2; rc=2
      else
        "$PY" -m torch.distributed.run --standalone --nproc-per-node "$gpus" benchmarks/bench_context_parallel.py; rc=$?
        keep_results benchmarks/results/context_parallel_*.md benchmarks/results/context_parallel_*.json
      fi ;;
    *) echo "gpu_acceptance: unknown part '$name'; allowed: wheels cuda-tests suite policies loss backends selective estimate profile long context trl pareto" >&2
       return 2 ;;
  esac
  echo "== gpu_acceptance: $name ended with status $rc after $((SECONDS - start)) s"
  return "$rc"
}

if [ $# -eq 0 ]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
if [ "$1" = wheels ]; then
  fetch_wheels
  exit $?
fi
prepare || { echo "gpu_acceptance: $PY cannot import torch, or the carried wheels did not install" >&2; exit 1; }
status=0
for name in "$@"; do
  part "$name" || status=1
done
exit "$status"
