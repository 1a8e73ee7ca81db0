"""Golden memory_summary texts from PyTorch's own torch.cuda.memory_summary (no GPU needed).

torch.cuda.memory.memory_stats is monkeypatched to return a hand-made flat stats dict; the
real memory_summary then formats it. Usage: python gen_summary.py OUTDIR  (reads OUTDIR/summary_cases.json)
"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.cuda.memory as m

ARRAYS = ["allocation", "segment", "active", "inactive_split", "allocated_bytes",
          "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"]

def flat(spec):
    """spec: {array: {pool: [cur, peak, alloc, freed]}}, scalars, oversize_*: [4]."""
    d = {}
    for a in ARRAYS:
        for pool in ["all", "small_pool", "large_pool"]:
            vals = spec.get(a, {}).get(pool, [0, 0, 0, 0])
            for f, v in zip(["current", "peak", "allocated", "freed"], vals):
                d[f"{a}.{pool}.{f}"] = v
    for a in ["oversize_allocations", "oversize_segments"]:
        for f, v in zip(["current", "peak", "allocated", "freed"], spec.get(a, [0, 0, 0, 0])):
            d[f"{a}.{f}"] = v
    for k in ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
              "num_device_free"]:
        d[k] = spec.get(k, 0)
    d["max_split_size"] = spec.get("max_split_size", -1)
    return dict(sorted(d.items()))

def main():
    out = sys.argv[1]
    cases = json.load(open(os.path.join(out, "summary_cases.json")))
    for c in cases:
        stats = flat(c["stats"])
        m.memory_stats = lambda device=None, _s=stats: _s
        for abbreviated in (False, True):
            text = torch.cuda.memory_summary(device=c["device"], abbreviated=abbreviated)
            name = f"summary_{c['name']}{'_abbrev' if abbreviated else ''}.txt"
            with open(os.path.join(out, name), "w") as f:
                f.write(text)
    print("torch", torch.__version__)

main()
