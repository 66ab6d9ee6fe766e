#!/usr/bin/env bash
# Every GPU check of issue 3 in one call, sized for one H200 lease (<= 9.5 minutes of steps).
#
# The device image has jax, flax, optax, orbax-checkpoint, chex, absl-py and pyyaml but
# not ml_collections: carry its wheel. Once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl ml_collections==1.1.0
# Then, with the device tool: run(command="bash scripts/gpu_checks.sh", carry=[".whl"],
# timeout_s=600). Each step writes $OUT/<step>.txt (what finished comes back even if a
# later step is cut by its timeout); $OUT/env.txt records date, device and versions.
# Paste the tables into BENCHMARKS.md with that header (never retype numbers).
# SMALL=1 runs the same steps at CPU sizes: a dry run here before spending device time
# (PATH=.venv/bin:$PATH SMALL=1 bash scripts/gpu_checks.sh). STEPS=a,b runs only those steps:
# on a Blackwell GPU the steps take more than one 600 s call, so run
# STEPS=microscaling_native first and the others in a second call. Issue 45's scaling_recipes
# (300 s) goes first on any GPU, in a call of its own (STEPS=scaling_recipes), then issue 44's
# fast_step (240 s, STEPS=fast_step), then the rest.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # wheels, PYTHONPATH, $OUT/env.txt

step() {  # step NAME SECONDS CMD... (skipped unless NAME is in $STEPS, when STEPS is set)
  local name=$1 seconds=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then
    echo "== $name: not in STEPS=$STEPS"
    return
  fi
  echo "== $name (limit ${seconds}s): $*"
  timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
  echo "   exit $? ; last lines:"
  tail -4 "$OUT/$name.txt"
}

# The issue's goal: static fp8 >= 1.8x and int8 >= 1.45x the bf16 step's tokens/s on the
# 1B config; routed within 3% of the faster static step (rolled or unrolled).
if [ "${SMALL:-0}" = 1 ]; then
  FAST=(--model tiny --batch 4 --seq 128)
  MODEL=(--model tiny --batch 4 --seq 64) SIZE=cpu CONFIGS=tiny
  REMAT_STEP=(--model tiny --batch 4 --seq 64)
  NATIVE=(--model tiny --batch 4 --seq 64 --native cpu_reference)
else
  FAST=(--model 1b --batch 16 --seq 1024 --vocab 32000)
  MODEL=(--model 1b --batch 32 --seq 256) SIZE=gpu CONFIGS=60m,130m
  REMAT_STEP=(--model 1b --batch 16 --seq 256)
  NATIVE=(--model 1b --batch 16 --seq 256 --only_if_native)
fi
# Issue 38, first where the GPU is a Blackwell (compute capability >= 10; elsewhere it exits at
# once): the native NVFP4 / MXFP8 steps (one cuDNN block-scaled GEMM per leg) against their
# emulation, fp8 and bf16, static, every projection on the path.
step microscaling_native 200 python3 benchmarks/microscaling_step.py "${NATIVE[@]}" \
  --variants "fp8,mxfp8,mxfp8 native,nvfp4,nvfp4 native" --rounds 3 --iters 3
# Issue 45: each fp8 / int8 scaling recipe's 1B step (precision.scaling: row, tensor, delayed;
# delayed also routed with nothing recovered) against the bf16 step, all on issue 44's fast step
# (cuDNN attention, fused loss), static unless ':gnmr'. The model's projection of the same:
# benchmarks/aot_step_time.py --part quantization (BENCHMARKS.md "Scaling recipes").
step scaling_recipes 300 python3 benchmarks/fast_step.py "${FAST[@]}" \
  --paths fp8,fp8:tensor,fp8:delayed,fp8:delayed:gnmr,int8:tensor --rounds 3 --iters 3
# Issue 44: the 1B step with cuDNN flash attention and the fused chunked loss against the
# reference (float32 scores, float32 [B, S, V] logits), each alone and together, then fp8 /
# int8 on the fast step; the AOT report's projection for it: python -m gnmr_jax.aot
# --config=configs/llama.py:1b --target=h100 --config.data.seq_len=1024 --step_time.
step fast_step 240 python3 benchmarks/fast_step.py "${FAST[@]}" --paths fp8,int8 --rounds 3 \
  --iters 3
# The issue's goal (model.remat='none': the step's own matmul cost).
step model_step 290 python3 benchmarks/model_step.py "${MODEL[@]}" --paths fp8,int8 \
  --rounds 3 --iters 3
# The routed step under remat 'full' (the 1B config's): unrolled on GPU with CSE prevention
# (model.py), which keeps its temporaries at the static step's (compiled deviceless: 9.6 vs
# 15.8 GB, BENCHMARKS.md "Routed step at scale"); this times it against static fp8, nothing
# recovered and max_o recovered, so the +0.3% of the unrolled design can be checked with remat.
# (The temporaries themselves: python -m gnmr_jax.aot compiles them here without a device.)
step model_step_remat 100 python3 benchmarks/model_step.py "${REMAT_STEP[@]}" --paths fp8 \
  --remat full --rounds 2 --iters 2
# The MLP-stack probe size of ../shared/reference/gpu-anchors.md, int8 and fp8.
step routing 130 python3 benchmarks/routing.py --size "$SIZE" --paths fp8,int8 --rounds 3 \
  --iters 3
# The controller's cost next to adamw at 60M and 130M parameters.
step controller_overhead 50 python3 benchmarks/controller_overhead.py --configs "$CONFIGS"
ls -l "$OUT"
