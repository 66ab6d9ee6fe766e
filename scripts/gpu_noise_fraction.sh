#!/usr/bin/env bash
# Issue 23, item 5: the deciding NVFP4 arms of the wsd8 regime at the 60m size (d 512, 8 layers,
# 25M parameters besides the byte embeddings; seq 256, batch 64, 1000 steps, warmup-stable-decay
# with the last 20% decaying), one seed each, on a lent GPU: experiments/noise_fraction.py
# --regimes wsd8gpu. By default the three that decide issue 23 in one 600 s call: static NVFP4
# (with the pre-flight's measuring pass every 10 steps), the late switch, the noise-fraction
# controller; a second call with ARMS=static_rec,norm,late_switch_fwd,last_blocks adds the rest
# (on the same warm machine, finished arms are skipped and an arm cut by its limit resumes from
# the checkpoint its SIGTERM wrote).
#
# The device image has jax, flax, optax and orbax-checkpoint but neither ml_collections nor
# TFDS. Once, here, in the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl ml_collections==1.1.0
#   GNMR_JAX_DATA_DIR=$PWD/.gpu_data .venv/bin/python experiments/noise_fraction.py \
#     --part prepare --regimes wsd8gpu           # the byte token cache, ~10 MB, read without TFDS
# Then, with the device tool: run(command="bash scripts/gpu_noise_fraction.sh",
# carry=[".whl", ".gpu_data/gnmr_jax_tokens"], timeout_s=600). Each arm writes
# $OUT/results/wsd8gpu/<arm>/seed0.json as it ends (what finished comes back even if a later arm
# is cut by its limit), and $OUT/runs/<arm>/ its logs. Here: copy the JSONs into
# experiments/results/noise_fraction/wsd8gpu/, static_low's logs into
# experiments/runs/noise_fraction/wsd8gpu/static_low/seed0/, then
# `python experiments/noise_fraction.py --part preflight --regimes wsd8gpu --seeds 1` and
# `python experiments/report.py` (RESULTS.md).
# $OUT/env.txt records date, device and versions; each JSON records them too.
# ARMS=a,b,... picks arms; SECONDS_PER_ARM bounds each (default 180). Throughput of the emulated
# NVFP4 path at this size on an H100/H200 is not measured yet: the first arm's log says it.
# The script exits 1 if any arm did not finish. SMALL=1 runs the arms shrunk to seconds on CPU
# (--smoke, in fresh temp dirs unless OUT / RUNS are given): a dry run here first
# (PATH=.venv/bin:$PATH SMALL=1 bash scripts/gpu_noise_fraction.sh).
set -u
if [ "${SMALL:-0}" = 1 ]; then  # never the leftovers of an earlier dry run
  OUT=${OUT:-$(mktemp -d)} RUNS=${RUNS:-$(mktemp -d)}
fi
OUT=${OUT:-/tmp/gpu_noise_fraction}
RUNS=${RUNS:-/tmp/gpu_noise_fraction_runs}
mkdir -p "$OUT"
export GNMR_JAX_DATA_DIR=${GNMR_JAX_DATA_DIR:-$PWD/.gpu_data}
. "$(dirname "$0")/device_env.sh"  # wheels, PYTHONPATH, $OUT/env.txt

ARMS=${ARMS:-static_low,late_switch,noise}
LIMIT=${SECONDS_PER_ARM:-180}
. "$(dirname "$0")/device_arms.sh"
run_arms noise_fraction wsd8gpu
exit "$failed"
