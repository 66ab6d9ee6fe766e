# Sourced by the device scripts (gpu_checks.sh, gpu_noise_fraction.sh) after they set $OUT: installs
# the carried wheels (.whl/, e.g. ml_collections, which the device image lacks), puts the repo on
# PYTHONPATH, and records date, device and versions in $OUT/env.txt.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__,
"optax", optax.__version__, jax.devices())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
