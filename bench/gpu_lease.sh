#!/usr/bin/env bash
# One lent GPU, one call: the smoke suite and the GPU benches, cheapest and most needed first,
# each capped, logs under $OUT (docs/gpu_smoke.md). Run from the repository root on the device
# machine, with the wheels of docs/gpu_smoke.md in .whl/ and Meta's b91f46b in .meta/ carried:
#     bash bench/gpu_lease.sh [seconds for heavyball's Muon comparison, default 200]
# heavyball's compilation (max-autotune) took 150-250 s and more on an H200: it goes last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_lease}
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo "t $(($(date +%s) - T0)) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
elapsed
echo "== pytest -m gpu"
timeout 120 python3 -m pytest -m gpu -q -rA >"$OUT/pytest.log" 2>&1
echo "rc $?"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -30
elapsed
echo "== Muon: our step per matrix and in batches (no compilation)"
timeout 60 python3 bench/vs_heavyball.py --muon-host --device cuda --repeats 50 2>&1 | tee "$OUT/muon_host.log"
elapsed
echo "== Shampoo: host time per block, ours / Meta's"
PYTHONPATH=.meta:/tmp/site timeout 60 python3 bench/shampoo_vs_meta.py --host-blocks 73 --device cuda 2>&1 | tee "$OUT/host.log"
elapsed
echo "== Shampoo: the pf=10 run against Meta's"
PYTHONPATH=.meta:/tmp/site timeout 90 python3 bench/shampoo_vs_meta.py --device cuda --pf10-steps 40 --drift 0 --pf10-only \
    >"$OUT/pf10.log" 2>&1
echo "rc $?"
tail -14 "$OUT/pf10.log"
elapsed
echo "== Muon against heavyball's compiled one"
timeout "${1:-200}" python3 bench/vs_heavyball.py --only muon --no-muon-fp32 --device cuda >"$OUT/muon.log" 2>&1
echo "rc $?"
grep -v -E "triton_mm|AUTOTUNE|strides|dtypes|select_algorithm|Autotune|num_choices|^  mm " "$OUT/muon.log" | tail -10
elapsed
