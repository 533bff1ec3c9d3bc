#!/usr/bin/env bash
# One sitting of the science grid on a CUDA machine (what benchmarks/science.md's GPU runs used):
#   bash benchmarks/science/gpu_sitting.sh MINUTES [WORKERS]
# Needs the prepared data in .science_data/{mix,ood_wiki} (see science.md). Runs are resumable: the runner
# skips finished jobs and resumes stopped ones from .science_data/runs. With $OUT set (the device tool),
# the results (no weights but the kept ones) are packed into $OUT.
set -u
MINUTES=${1:-7}
WORKERS=${2:-16}
RUNS=.science_data/runs
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"

# CUDA MPS lets the many small processes' kernels share the GPU at once; stopped again at the end so the
# machine is left as it was. Without it the runs still work (time-sliced).
MPS=0
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
  if timeout 60 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    MPS=1
    echo "MPS on"
  else
    echo quit | nvidia-cuda-mps-control
    echo "MPS failed; time-sliced"
  fi
fi
trap '[ $MPS = 1 ] && echo quit | nvidia-cuda-mps-control' EXIT

KEEP="sl-mha sl-mla+rope-r128 eg-mla-kv64 tiny-mlra-4"
$PY benchmarks/science/run_grid.py --runs $RUNS --data .science_data/mix --ood .science_data/ood_wiki \
  --workers "$WORKERS" --minutes "$MINUTES" --job-minutes 2.5 \
  --keep-weights .science_data/weights --keep $KEEP

if [ -n "${OUT:-}" ]; then
  (cd $RUNS && find . \( -name summary.json -o -name metrics.jsonl -o -name config.yaml -o -name worker.log \
     -o -name runner.jsonl \) -print0 | tar czf "$OUT/results.tar.gz" --null -T -)
  for d in .science_data/weights/*/; do
    [ -d "$d" ] || continue
    name=$(basename "$d" | tr -c 'A-Za-z0-9_.\n-' '_')
    tar cf "$OUT/w_${name}.tar" -C "$d" .
  done
  ls -la "$OUT"
fi
