#!/usr/bin/env bash
# The checks one GPU can show (fldp.init on CUDA = CPU, Llama 3.1 8B pure bf16 throughput and MFU,
# the tiny model on CUDA): see experiments/gpu_check.py. Under 8 minutes on one H100/H200.
#   bash experiments/gpu_check.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python experiments/gpu_check.py ${1:+--out "$1"}
