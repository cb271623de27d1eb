# The options and the end of a pre-registered study's runner (sourced by experiments/paper_shape.sh;
# experiments/precision, sensitivity and tokens are specs, fldp-study):   study_args NAME PHASES "$@"   (PHASES: "tune|hsdp|pilot|judge")
#   [OUT] [--reduced] [--until PHASE] [--allow-mixed] [KEY=VALUE...]
# sets OUT (absolute; default outputs/NAME/DATE_TIME), REDUCED (0/1), UNTIL (the last phase),
# MIXED (--allow-mixed or empty) and OVERRIDES (the KEY=VALUE pairs), and enters the repository.
study_args() {
    local name=$1 phases=$2
    shift 2
    OUT= REDUCED=0 UNTIL=${phases##*|} MIXED= OVERRIDES=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --reduced) REDUCED=1 ;;
            --allow-mixed) MIXED=--allow-mixed ;;
            --until) UNTIL=${2:-}; shift
                     if [[ "|$phases|" != *"|$UNTIL|"* ]]; then echo "$name.sh: --until $phases, not '$UNTIL'" >&2; exit 2; fi ;;
            -*) echo "$name.sh: unknown option $1 (usage: [OUT] [--reduced] [--until PHASE] [--allow-mixed] [KEY=VALUE...])" >&2; exit 2 ;;
            *=*) OVERRIDES+=("$1") ;;
            *) if [ -n "$OUT" ]; then echo "$name.sh: two output directories, $OUT and $1" >&2; exit 2; fi
               OUT=$1 ;;
        esac
        shift
    done
    case "$OUT" in
        "" | /*) ;;
        *) OUT="$PWD/$OUT" ;;
    esac
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
    OUT=${OUT:-outputs/$name/$(date +%Y-%m-%d_%H-%M-%S)}
}

# study_finish NAME: the report of OUT/runs by `python -m analysis.NAME` (its --strict, the run's
# MIXED), the study's elapsed time added to OUT/elapsed_s (a study run in parts: their sum); exits
# with $status (1 if a run or the report failed)
study_finish() {
    local name=$1
    elapsed=$(( $(cat "$OUT/elapsed_s" 2>/dev/null || echo 0) + SECONDS - start ))
    mkdir -p "$OUT" && echo "$elapsed" > "$OUT/elapsed_s"
    python -m "analysis.$name" "$OUT/runs" --out "$OUT/report" --elapsed "$elapsed" --strict $MIXED || status=1
    echo "$name: $elapsed s of runs; report in $OUT/report/report.md"
    exit "$status"
}
