#!/usr/bin/env bash
# The example report of `kvlm compare --preset tiny` (the README's first command), produced on a machine with at
# least 12 free cores: its 18 runs (6 variants x seeds 0, 1, 2) as 6 processes of 2 threads each (pinned to their
# own cores), then the default command itself, which finds every run done and only aggregates, measures this
# CPU at 2 threads for the cost projection and writes the report. The runs are the default command's own (same
# configs, budget and seeds, hence the same run keys), so the result equals a sequential run's; the report's
# "training over all runs" time is what one 2-core process would spend on them.
#   bash benchmarks/compare-tiny/parallel_seeds.sh [OUT]      (default OUT: runs/compare-tiny)
set -euo pipefail
OUT=${1:-runs/compare-tiny}
KVLM=${KVLM:-python -m kvlm.cli}
export CUDA_VISIBLE_DEVICES=  # the CPU budget is the point: keep the GPU out of it
export OMP_NUM_THREADS=2
mkdir -p "$OUT"
python -c "from kvlm.data import load_or_prepare; load_or_prepare('synthetic', '$OUT/data', tokenizer='bpe', vocab_size=4096)"
tmp=$(mktemp -d)
printf 'variants:\n' > "$tmp/a.yaml"; for v in mha gqa mla mla-norope; do printf '  - {label: %s, preset: tiny/%s}\n' $v $v >> "$tmp/a.yaml"; done
printf 'variants:\n' > "$tmp/b.yaml"; for v in eg-mla mlra-4; do printf '  - {label: %s, preset: tiny/%s}\n' $v $v >> "$tmp/b.yaml"; done
core=0
pids=()
for seed in 0 1 2; do
  for part in a b; do
    taskset -c $core,$((core + 1)) $KVLM compare --variants "$tmp/$part.yaml" --out "$OUT" --seeds $seed \
      --hardware h100 --no-progress > "$tmp/$part$seed.log" 2>&1 &
    pids+=($!)
    core=$((core + 2))
  done
done
for p in "${pids[@]}"; do wait "$p" || { tail -n 20 "$tmp"/*.log; exit 1; }; done
taskset -c 0,1 $KVLM compare --preset tiny --out "$OUT"
