#!/usr/bin/env bash
# Re-runs what issue 18 invalidated (every seed had trained on data seed 0), as two streams
# pinned to one core each: `experiments/rerun_per_seed_data.sh a` and `... b` side by side
# (about 110 minutes each on a 2-core CPU). Each (regime, arm, seed) run is reused when
# complete, so an interrupted stream resumes where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ARMS="static_low,static_rec,gnmr,random,norm,gaprec_every50_from0,gapuni_every50_from0,hindsight"
FLOOR="static_low_perturb,norm_perturb,gaprec_every50_from0_perturb,gapuni_every50_from0_perturb"
S1_MAIN="bf16,static8,static4,gnmr4_8,static2,gnmr2_8,random2_8,static4_paper,static2_paper"
S1_ABLATIONS="gnmr2_8_score_only,gnmr2_8_delta_only,gnmr2_8_no_lock,gnmr2_8_max_o2,gnmr2_8_max_o8"
S1_ABLATIONS="$S1_ABLATIONS,gnmr2_8_max_o28,static2_global_clip,static2_zclip,static2_adagc"
S1_ABLATIONS="$S1_ABLATIONS,gnmr2_8_global_clip"
case "${1:?stream a or b}" in
  a) taskset -c 0 $PY experiments/selection.py --part e2e --regimes tensor4 --seeds 5 \
       --arms "$ARMS,gap_every50_from0"
     taskset -c 0 $PY experiments/selection.py --part e2e --regimes tensor4 --seeds 2 --arms "$FLOOR"
     taskset -c 0 $PY experiments/scenario3_lora.py --scale cpu --no_report
     taskset -c 0 $PY experiments/scenario1_saved_activation.py --scale cpu --no_report \
       --arms "$S1_ABLATIONS" ;;
  b) taskset -c 1 $PY experiments/selection.py --part e2e --regimes block4 --seeds 5 --arms "$ARMS"
     taskset -c 1 $PY experiments/selection.py --part e2e --regimes block4 --seeds 2 --arms "$FLOOR"
     taskset -c 1 $PY experiments/scenario2_blockwise.py --scale cpu --no_report
     taskset -c 1 $PY experiments/scenario1_saved_activation.py --scale cpu --no_report \
       --arms "$S1_MAIN" ;;
esac
