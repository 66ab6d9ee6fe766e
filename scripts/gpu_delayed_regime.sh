#!/usr/bin/env bash
# Issue 47: the delayed-scaling regime (experiments/delayed_regime.py) at the 60m size (d 512,
# 8 layers; seq 256, batch 64, 1000 steps, warmup-stable-decay), one seed per arm, on a lent
# GPU: --regimes h16gpu. By default the arms that decide the issue in one 600 s call: static fp8
# with delayed scaling (no recovery; its log is the event census and the norm-alarm check),
# the saturation-reading controller uncapped (saturation_all: every saturated unit the step
# after), the paper's rule; a second call with ARMS=bf16,alarm,hindsight,saturation and a third
# with ARMS=row,tensor,saturation_w0,last_blocks,delayed_perturb add the rest (finished arms are
# skipped on the same warm machine; an arm cut by its limit ends with SIGTERM's checkpoint and
# resumes from it).
#
# The device image has jax, flax, optax and orbax-checkpoint but neither ml_collections nor
# TFDS. Once, here, in the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl ml_collections==1.1.0
#   GNMR_JAX_DATA_DIR=$PWD/.gpu_data .venv/bin/python experiments/delayed_regime.py \
#     --part prepare --regimes h16gpu            # the byte token cache, read without TFDS
# Then, with the device tool: run(command="bash scripts/gpu_delayed_regime.sh",
# carry=[".whl", ".gpu_data/gnmr_jax_tokens"], timeout_s=600). Each arm writes
# $OUT/results/h16gpu/<arm>/seed0.json as it ends, $OUT/runs/<arm>/ its logs. Here: copy the
# JSONs into experiments/results/delayed_regime/h16gpu/ and run
# `python experiments/delayed_regime.py --report` and `python experiments/report.py`.
# $OUT/env.txt records date, device and versions; each JSON records them too.
# ARMS=a,b,... picks arms; SECONDS_PER_ARM bounds each (default 180). The exit status is 1 if
# an arm did not finish. SMALL=1 runs the arms shrunk to seconds on CPU (--smoke, in fresh temp
# dirs unless OUT / RUNS are given): a dry run here first
# (PATH=.venv/bin:$PATH SMALL=1 bash scripts/gpu_delayed_regime.sh).
set -u
if [ "${SMALL:-0}" = 1 ]; then  # never the leftovers of an earlier dry run
  OUT=${OUT:-$(mktemp -d)} RUNS=${RUNS:-$(mktemp -d)}
fi
OUT=${OUT:-/tmp/gpu_delayed_regime}
RUNS=${RUNS:-/tmp/gpu_delayed_regime_runs}
mkdir -p "$OUT"
export GNMR_JAX_DATA_DIR=${GNMR_JAX_DATA_DIR:-$PWD/.gpu_data}
. "$(dirname "$0")/device_env.sh"  # wheels, PYTHONPATH, $OUT/env.txt

ARMS=${ARMS:-delayed,saturation_all,paper}
LIMIT=${SECONDS_PER_ARM:-180}
. "$(dirname "$0")/device_arms.sh"
run_arms delayed_regime h16gpu
exit "$failed"
