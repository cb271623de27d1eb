#!/usr/bin/env bash
# The tiny reproduction, end to end: 12 runs (4 algorithms x seeds 0,1,2 on netns_4x2, 4 emulated
# nodes of 2 ranks in the paper's mesh relations, joined by capped links (root, iproute2), identical
# hyper-parameters: conf/experiment/tiny_repro.yaml), then the report on them.
#   bash experiments/tiny_repro.sh [OUT]    default OUT: outputs/tiny_repro/DATE_TIME
# Writes OUT/runs/<algorithm>_seed<N>/ (the records) and OUT/report/ (tables, figure, report.md).
# About 5 minutes on 2 cores. Extra arguments after OUT go to fldp.train (Hydra overrides).
# experiments/science.sh runs the same with 5 seeds as the first part of the study.
set -uo pipefail
OUT=${1:-}
shift || true
case "$OUT" in
    "") ;;
    /*) ;;
    *) OUT="$PWD/$OUT" ;;  # relative to where it was called from, not to the repository
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/tiny_repro/$(date +%Y-%m-%d_%H-%M-%S)}
if [ -e "$OUT/runs" ]; then
    # a second sweep into the same folder would meet the first one's records
    echo "tiny_repro: $OUT/runs already exists; remove it or choose another OUT" >&2
    exit 2
fi
start=$SECONDS
python -m fldp.train +experiment=tiny_repro "hydra.sweep.dir=$OUT/runs" "$@"
train_status=$?
# The report runs even after a failed run: it names the broken runs and covers the healthy ones.
python -m analysis.report "$OUT/runs" --out "$OUT/report" --strict
report_status=$?
echo "tiny_repro: $((SECONDS - start)) s; report in $OUT/report/report.md"
[ "$train_status" -eq 0 ] && [ "$report_status" -eq 0 ]
