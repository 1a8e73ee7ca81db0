#!/usr/bin/env bash
# The whole validation on a GPU machine, in one command (see validate/README.md):
#
#   validate/run-all.sh [TRACE...]
#
# Builds vramsim and vramsim-validate, probes and calibrates the GPU, runs the GPU tests, replays each trace
# on the GPU with the raw, vmm and async backends and through the real PyTorch caching allocator (default
# settings and expandable_segments:True), and regenerates the results table of validate/README.md.
# Without traces it uses examples/*.jsonl and the model-zoo captures in models/tests/fixtures/capture/.
# Everything it writes goes to $VRAMSIM_VALIDATE_OUT (default validate-out/).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${VRAMSIM_VALIDATE_OUT:-validate-out}
mkdir -p "$out"

if [ "$#" -gt 0 ]; then
    traces=("$@")
else
    traces=(examples/*.jsonl models/tests/fixtures/capture/*.jsonl.gz)
fi

# VRAMSIM_BIN_DIR: binaries built elsewhere (a GPU machine without Rust): vramsim, vramsim-validate and the
# GPU test binary (`cargo test --release -p vramsim-validate --test gpu --no-run`, copied as gpu-tests).
bin=${VRAMSIM_BIN_DIR:-}
if [ -z "$bin" ]; then
    cargo build --release -p vramsim-api -p vramsim-validate
    bin=target/release
fi
validate=$bin/vramsim-validate
vramsim=$bin/vramsim

echo "== probe"
# Without an NVIDIA driver this prints one line and exits 2: nothing else can run.
"$validate" calibrate --out "$out/calibration.json" --probe-out "$out/probe.json"

echo "== GPU tests"
if [ -n "${VRAMSIM_BIN_DIR:-}" ]; then
    "$bin/gpu-tests" --ignored
else
    cargo test --release -p vramsim-validate -- --ignored
fi

confs=("" "expandable_segments:True")
for trace in "${traces[@]}"; do
    name=$(basename "$trace"); name=${name%.gz}; name=${name%.jsonl}; name=${name%.json}
    dir="$out/$name"; mkdir -p "$dir"
    echo "== $trace"
    for backend in raw vmm async; do
        "$validate" replay "$trace" --backend "$backend" --json > "$dir/$backend.json"
        python3 - "$dir/$backend.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
pool = r.get("pool") or {}
print(f"  {r['backend']:<5} {r['events']:>7} events, {r['device_calls']:>6} device calls, "
      f"{r['events_with_deviation']:>5} differ, max deviation {r['max_abs_deviation']} B"
      + (f", reserved high {pool['predicted_reserved_high']} vs {pool['measured_reserved_high']}" if pool else "")
      + (f" (stopped: {r['stopped']})" if r.get("stopped") else ""))
PY
    done
    for conf in "${confs[@]}"; do
        tag=${conf:-default}; tag=${tag%%:*}
        python3 validate/python/replay_torch.py replay "$trace" --alloc-conf "$conf" \
            --out "$dir/torch-$tag" --vramsim "$vramsim"
    done
done

echo "== training steps"
# The capture zoo's steps run for real (validate/python/train_step_gpu.py): peaks, phases, snapshots.
python3 validate/python/train_step_gpu.py run-all --out "$out/train-steps"

echo "== results"
python3 validate/python/replay_torch.py table "$out"/*/torch-*/ --readme validate/README.md
python3 validate/python/replay_torch.py table "$out"/*/torch-*/
