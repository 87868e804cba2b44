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
# The 1b shape (Llama-3.2-1B's decoder stack, bf16) runs on the GPU only.
# Needs only python3 with torch, numpy and pyarrow (transformers and
# nvidia-ml-py where present): no DuckDB, no store. Results go to $OUT (or
# ./gpu-check): env.txt, detect.json, probes.json, probes_1b.json, nvml_check.json,
# nvml.log, stderr.log, and a summary line each.
set -u
out=${OUT:-gpu-check}
py=${PYTHON:-python3}
dev=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi -L || echo "no nvidia-smi"
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$out/env.txt"
log="$out/stderr.log"  # every step's stderr, in order (at most 8 files come back from a lent machine)
: > "$log"
echo "== detect" >> "$log"
timeout 120 "$py" scripts/gpu_check_detect.py --device "$dev" --out "$out/detect.json" > /dev/null 2>> "$log"
echo "detect rc=$?"
echo "== probes" >> "$log"
timeout 240 "$py" -m rca.bench.probes "$dev" > "$out/probes.json" 2>> "$log"
echo "probes bench rc=$?"
# the same on Llama-3.2-1B's decoder stack in bf16 (skipped in the CPU dry run:
# on two cores it would take an hour)
if [ "$dev" != cpu ]; then
    echo "== probes 1b" >> "$log"
    timeout 240 "$py" -m rca.bench.probes "$dev" 1b > "$out/probes_1b.json" 2>> "$log"
    echo "probes bench 1b rc=$?"
fi
nvml_args=(--seconds 20 --out "$out/nvml_check.json")
[ "${FAKE:-0}" = 1 ] && nvml_args+=(--fake)
timeout 120 "$py" scripts/gpu_check_nvml.py "${nvml_args[@]}" > "$out/nvml.log" 2>&1
echo "nvml check rc=$?"
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("probes", "probes_1b"):
    if not (out / f"{name}.json").exists():
        continue
    try:
        d = json.loads((out / f"{name}.json").read_text())
        ratios = {k: v for k, v in d.items() if k.startswith("ratio_") and not isinstance(v, dict)}
        print(name, d["device"], d["model"], d.get("size"), ratios, "decode ms", {m: v["decode_step"] for m, v in d["ms"].items()})
    except Exception as exc:
        print(f"{name}: no result:", exc)
try:
    d = json.loads((out / "detect.json").read_text())
    print("detect ok" if d["ok"] else "detect FAILED", {k: d[k] for k in ("syncs_during_forward", "nan_in_row_2", "kv_flip")})
except Exception as exc:
    print("detect: no result:", exc)
tail = (out / "stderr.log").read_text()[-1500:]
if tail.strip():
    print("stderr.log ends:", tail)
try:
    n = json.loads((out / "nvml_check.json").read_text())
    print("nvml", n.get("status"), n.get("threaded"))
except Exception as exc:
    print("nvml: no result:", exc, (out / "nvml.log").read_text()[-800:])
PY
