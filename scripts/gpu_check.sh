#!/usr/bin/env bash
# The probes' GPU checks as one prepared command, for a session that is lent a
# GPU machine (see docs/architecture.md, "probes"): what the operator checks and
# KV fingerprints cost on CUDA (`rca bench probes --device cuda`: the default
# tier should stay at or under 1.01x there), and what the NVML poller sees and
# costs on a real driver (scripts/gpu_check_nvml.py; budget: under 1% of one
# core and 100 MB at a 1 s interval).
#
#   bash scripts/gpu_check.sh                 # on the GPU machine, from the repo root
#   DEVICE=cpu FAKE=1 bash scripts/gpu_check.sh   # dry run here: CPU, fake NVML
#
# Needs only python3 with torch, numpy and pyarrow (transformers and
# nvidia-ml-py where present): no DuckDB, no store. Results go to $OUT (or
# ./gpu-check): probes.json, nvml_check.json, the logs, and a summary line each.
set -u
out=${OUT:-gpu-check}
py=${PYTHON:-python3}
dev=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
(nvidia-smi -L || echo "no nvidia-smi") > "$out/nvidia-smi.txt" 2>&1
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' \
    | tee "$out/torch.txt"
timeout 420 "$py" -m rca.bench.probes "$dev" > "$out/probes.json" 2> "$out/probes.err"
echo "probes bench rc=$?"
nvml_args=(--seconds 20 --out "$out/nvml_check.json")
[ "${FAKE:-0}" = 1 ] && nvml_args+=(--fake)
timeout 120 "$py" scripts/gpu_check_nvml.py "${nvml_args[@]}" > "$out/nvml.log" 2>&1
echo "nvml check rc=$?"
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    d = json.loads((out / "probes.json").read_text())
    print("probes", d["device"], d["model"], {k: v for k, v in d.items() if k.startswith("ratio_") and not isinstance(v, dict)})
except Exception as exc:
    print("probes: no result:", exc, (out / "probes.err").read_text()[-800:])
try:
    n = json.loads((out / "nvml_check.json").read_text())
    print("nvml", n.get("status"), n.get("threaded"))
except Exception as exc:
    print("nvml: no result:", exc, (out / "nvml.log").read_text()[-800:])
PY
