#!/usr/bin/env bash
# The latest checkpoint of a running EAGLE-3 training, exported from a copy (the run is untouched:
# the trainer resumes the copy with max_steps = its step, so it only calibrates, exports and runs a
# short evaluation), then measured on the held-out split at static 8 (holdout_acceptance.py):
#   bash docs/bench/holdout_checkpoint.sh   # R: the run's --out, RECIPE: its recipe
# writes $OUT/holdout_eagle3_stepN.json (default OUT: results_dir.sh holdout_acceptance;
# step 400: ~4 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(bash docs/bench/results_dir.sh holdout_acceptance)}
mkdir -p "$OUT"
R=${R:-runs/eagle3-general-all}
RECIPE=${RECIPE:-recipes/eagle3_smollm2_general_all.yaml}
N=$(ls $R/checkpoints | grep -v tmp | sed 's/step_//' | sort -n | tail -1)
M=$(mktemp -d)/step-$N
rm -rf $M && mkdir -p $M/checkpoints && cp -r $R/checkpoints/step_$N $M/checkpoints/ && cp $R/regenerated.jsonl $R/vocab.pt $M/
sed "s/^eval_max_tokens: .*/eval_max_tokens: 16/; s/^holdout: 24/holdout: 24\nmax_steps: $N/" $RECIPE > $M/recipe.yaml
.venv/bin/specdec train eagle3 --config $M/recipe.yaml --out $M --resume > $M/train.log 2>&1
.venv/bin/python docs/bench/holdout_acceptance.py --recipe $RECIPE \
  --drafter eagle3=$M/drafter --json "$OUT/holdout_eagle3_step$N.json" \
  > "$OUT/holdout_eagle3_step$N.log" 2>&1
echo "step $N done"
