# Sourced by the experiment device scripts (gpu_noise_fraction.sh, gpu_delayed_regime.sh) after
# they set $OUT, $RUNS, $ARMS and $LIMIT: run_arms SCENARIO REGIME trains each arm of $ARMS
# (one seed) with experiments/SCENARIO.py --regimes REGIME under a limit of $LIMIT seconds,
# writing $OUT/<arm>.txt and the run's logs under $OUT/runs/<arm>/ (not its checkpoints);
# SMALL=1 adds --smoke. Sets $failed to 1 if an arm did not finish.
run_arms() {
  local scenario=$1 regime=$2 arm status
  local extra=(--results "$OUT/results" --runs "$RUNS")
  if [ "${SMALL:-0}" = 1 ]; then
    extra+=(--smoke)
  fi
  failed=0
  for arm in ${ARMS//,/ }; do
    echo "== $arm (limit ${LIMIT}s)"
    timeout -k 30 "$LIMIT" python3 "experiments/$scenario.py" --regimes "$regime" --arms "$arm" \
      --seeds 1 "${extra[@]}" > "$OUT/$arm.txt" 2>&1
    status=$?
    [ "$status" = 0 ] || failed=1
    echo "   exit $status ; last lines:"
    tail -3 "$OUT/$arm.txt"
    mkdir -p "$OUT/runs/$arm"
    cp "$RUNS/$scenario/$regime/$arm/seed0/"*.json* "$OUT/runs/$arm/" 2>/dev/null
  done
  find "$OUT/results" -name '*.json' 2>/dev/null | sort
}
