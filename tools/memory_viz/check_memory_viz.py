#!/usr/bin/env python3
"""Check that a snapshot exported by `vramsim replay --snapshot-out` is one PyTorch's own tools accept.

    python3 tools/memory_viz/check_memory_viz.py SNAPSHOT.pickle[.gz] [--report REPORT.json]

1. Plain Python: `pickle` reads the file (gunzipped when it starts with the gzip magic); it uses only
   the opcodes and protocols the unpickler of `MemoryViz.js` (pytorch.org/memory_viz) understands; it
   has the shape of `torch.cuda.memory._snapshot()` (pytorch_allocator.md §10.2); every segment's sizes
   add up from its blocks; and the trace replays to the final segments: every alloc is freed at most
   once, free_requested/free_completed come in pairs, and the blocks still allocated at the end are
   exactly those the trace allocated and never freed.
2. PyTorch's `torch/cuda/_memory_viz.py`: `segsum` (the `stats` command), `trace`, `trace_plot` and
   `segment_plot` run on the snapshot; the HTML of the plots embeds this very snapshot; and with
   `--report` (the output of `vramsim replay --json` for the same replay) segsum's totals are the
   report's figures: `segments: N`, `total_reserved`, `total_allocated` and `total_free` (with its
   internal share), formatted by `_memory_viz` itself.

Where `_memory_viz.py` comes from, first match wins:
- `--memory-viz PATH` or the environment variable `VRAMSIM_MEMORY_VIZ=PATH`: the file, loaded on its
  own. It imports only the standard library (torch is imported only by `profile_plot`'s helper), so
  the file taken out of a torch wheel runs without torch installed, as `python _memory_viz.py stats
  FILE` does. `fetch_memory_viz.py` beside this script downloads it (this is what CI does). A path
  that is given but missing is an error, not a skip.
- `import torch.cuda._memory_viz` when torch is installed.
Otherwise step 2 is skipped: the script prints `SKIP: <reason>` and exits with status 77 after step 1
passed. Exit status 0: everything passed; 1: a check failed (the message says which); 2: bad usage.
"""

import argparse
import base64
import gzip
import importlib.util
import json
import os
import pickle
import pickletools
import re
import sys

SKIPPED = 77

SEGMENT_KEYS = (
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
    "segment_type",
    "segment_pool_id",
    "is_expandable",
    "frames",
    "blocks",
)
BLOCK_KEYS = ("address", "size", "requested_size", "state", "frames")
TRACE_KEYS = ("action", "size", "stream", "time_us", "frames")
SETTINGS_KEYS = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "max_split_size",
    "garbage_collection_threshold",
    "expandable_segments",
    "pinned_num_register_threads",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "roundup_power2_divisions",
)
ACTIONS = {
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
}


class CheckFailed(Exception):
    """A check failed; the message says which and why."""


def check(condition, message):
    if not condition:
        raise CheckFailed(message)


# The opcodes the unpickler of PyTorch's torch/utils/viz/MemoryViz.js (the page behind
# pytorch.org/memory_viz, where users drop snapshot files) handles; it throws "UNKNOWN OPCODE" on any
# other, and accepts protocols 2 to 4 only. (Names as `pickletools` spells them.)
MEMORY_VIZ_JS_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE",
    "SHORT_BINUNICODE", "BINUNICODE", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST",
    "LIST", "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
}  # fmt: skip


def load_snapshot(path):
    """The snapshot and its raw pickle bytes (gunzipped)."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return pickle.loads(raw), raw


def check_memory_viz_js_can_unpickle(raw):
    """Step 1c: pytorch.org/memory_viz reads the file with its own small unpickler."""
    for op, arg, pos in pickletools.genops(raw):
        check(
            op.name in MEMORY_VIZ_JS_OPCODES,
            f"pickle opcode {op.name} at byte {pos} is one MemoryViz.js cannot read",
        )
        if op.name == "PROTO":
            check(2 <= arg <= 4, f"pickle protocol {arg}: MemoryViz.js reads protocols 2 to 4")


def check_shape(data):
    """Step 1a: the keys and types `_snapshot()` has."""
    check(isinstance(data, dict), f"top level is {type(data).__name__}, expected dict")
    for key in ("segments", "device_traces", "allocator_settings"):
        check(key in data, f"top-level key {key!r} missing (keys: {sorted(data)})")
    check(isinstance(data["device_traces"], list), "device_traces is not a list")
    for key in SETTINGS_KEYS:
        check(key in data["allocator_settings"], f"allocator_settings lacks {key!r}")
    divisions = data["allocator_settings"]["roundup_power2_divisions"]
    check(
        list(divisions) == [str(1 << k) for k in range(16)],
        f"roundup_power2_divisions keys are {list(divisions)}, expected '1', '2', ..., '32768'",
    )
    previous_end = 0
    for i, seg in enumerate(data["segments"]):
        for key in SEGMENT_KEYS:
            check(key in seg, f"segments[{i}] lacks {key!r}")
        check(seg["segment_type"] in ("small", "large"), f"segments[{i}].segment_type")
        check(seg["address"] >= previous_end, f"segments[{i}] is out of address order or overlaps")
        previous_end = seg["address"] + seg["total_size"]
        address = seg["address"]
        sums = {"total": 0, "allocated": 0, "active": 0, "requested": 0}
        for j, b in enumerate(seg["blocks"]):
            for key in BLOCK_KEYS:
                check(key in b, f"segments[{i}].blocks[{j}] lacks {key!r}")
            check(b["address"] == address, f"segments[{i}].blocks[{j}].address is not contiguous")
            check(
                b["state"] in ("active_allocated", "active_pending_free", "inactive"),
                f"segments[{i}].blocks[{j}].state is {b['state']!r}",
            )
            address += b["size"]
            sums["total"] += b["size"]
            if b["state"] == "active_allocated":
                sums["allocated"] += b["size"]
            if b["state"].startswith("active_"):
                sums["active"] += b["size"]
                sums["requested"] += b["requested_size"]
        for name, key in (
            ("total", "total_size"),
            ("allocated", "allocated_size"),
            ("active", "active_size"),
            ("requested", "requested_size"),
        ):
            check(
                sums[name] == seg[key],
                f"segments[{i}].{key} = {seg[key]} but its blocks add up to {sums[name]}",
            )
    for d, trace in enumerate(data["device_traces"]):
        for i, e in enumerate(trace):
            for key in TRACE_KEYS:
                check(key in e, f"device_traces[{d}][{i}] lacks {key!r}")
            check(e["action"] in ACTIONS, f"device_traces[{d}][{i}].action is {e['action']!r}")
            addr_key = "device_free" if e["action"] == "oom" else "addr"
            check(addr_key in e, f"device_traces[{d}][{i}] ({e['action']}) lacks {addr_key!r}")


def check_trace_replays_to_segments(data, partial_history):
    """Step 1b: the trace, recorded from the first event, ends in the final segments' blocks.

    With `partial_history` (a replay that started from declared `segment` state, whose blocks were
    allocated before recording began), frees of blocks never allocated in the trace are allowed, and
    final blocks the trace never allocated are taken as allocated before recording.
    """
    trace = data["device_traces"][0] if data["device_traces"] else []
    hint = " (a replay from declared `segment` state needs --partial-history)"
    live = {}  # addr -> requested size of blocks allocated and not yet free_requested
    pending = {}  # addr -> size of blocks free_requested and not yet free_completed
    for i, e in enumerate(trace):
        action, addr = e["action"], e.get("addr")
        if action == "alloc":
            check(addr not in live and addr not in pending, f"trace[{i}]: alloc of live {addr:#x}")
            live[addr] = e["size"]
        elif action == "free_requested":
            known = live.pop(addr, None)
            check(
                known == e["size"] or (known is None and partial_history),
                f"trace[{i}]: free_requested of {addr:#x} without its alloc" + hint,
            )
            pending[addr] = e["size"]
        elif action == "free_completed":
            known = pending.pop(addr, None)
            check(
                known == e["size"] or (known is None and partial_history),
                f"trace[{i}]: free_completed of {addr:#x} without its free_requested" + hint,
            )
    final_allocated = {}
    final_pending = {}
    for seg in data["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                final_allocated[b["address"]] = b["requested_size"]
            elif b["state"] == "active_pending_free":
                final_pending[b["address"]] = b["requested_size"]
    if partial_history:
        final_allocated = {a: s for a, s in final_allocated.items() if a in live}
        final_pending = {a: s for a, s in final_pending.items() if a in pending}
    check(
        live == final_allocated,
        f"{len(live)} blocks allocated by the trace and never freed, "
        f"{len(final_allocated)} active_allocated blocks in the segments (or sizes differ)" + hint,
    )
    check(pending == final_pending, "pending frees in the trace differ from active_pending_free")


def load_memory_viz(path):
    """`_memory_viz` from a file, run on its own (no torch), or from an installed torch."""
    if path:
        check(os.path.isfile(path), f"_memory_viz.py not found at {path}")
        spec = importlib.util.spec_from_file_location("_memory_viz", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module, path
    try:
        from torch.cuda import _memory_viz  # noqa: PLC0415 (torch is optional)
    except Exception as e:  # ImportError, or torch failing to load its CUDA libraries
        return None, f"torch is not importable ({type(e).__name__}: {e})"
    return _memory_viz, _memory_viz.__file__


def embedded_snapshot(html):
    """The snapshot a `trace_plot`/`segment_plot` page hands to MemoryViz.js."""
    match = re.search(r"const local_files = (.*)\n", html)
    check(match is not None, "the plot HTML embeds no snapshot")
    files = json.loads(match.group(1))
    check(len(files) == 1 and files[0]["name"] == "snapshot.pickle", "unexpected local_files")
    return pickle.loads(base64.b64decode(files[0]["base64"]))


def check_memory_viz(mv, data, report):
    """Step 2: PyTorch's tools on the snapshot; their totals against the vramsim report."""
    summary = mv.segsum(data)  # raises AssertionError on inconsistent accounting
    lines = summary.splitlines()
    segments = len(data["segments"])
    expected = [f"segments: {segments}"]
    if report is not None:
        reserved = report["final_reserved_bytes"]
        allocated = report["final_allocated_bytes"]
        stats = report["stats"]
        requested = stats["requested_bytes.all.current"]
        pending = stats["active_bytes.all.current"] - allocated
        if not any(seg["is_expandable"] for seg in data["segments"]):
            check(
                segments == stats["segment.all.current"],
                f"{segments} segments in the snapshot, segment.all.current = "
                f"{stats['segment.all.current']} in the report",
            )
        expected.append(f"total_reserved: {mv.Bytes(reserved)}")
        if pending == 0:
            # segsum's total_allocated is Σ requested_size of allocated blocks; its internal free is
            # the rounding of those blocks, its external free the inactive blocks.
            expected.append(f"total_allocated: {mv.Bytes(requested)}")
            internal = allocated - requested
            external = reserved - allocated
            expected.append(f"total_free: {mv._report_free(external, internal)}")
    for line in expected:
        check(line in lines, f"segsum does not print {line!r}; it printed:\n{summary}")

    text = mv.trace(data)
    entries = len(data["device_traces"][0]) if data["device_traces"] else 0
    if entries:
        check(f"{entries} entries" in text, f"_memory_viz.trace does not report {entries} entries")

    for name, kind in (("trace_plot", "Active Memory Timeline"), ("segment_plot", "Allocator State History")):
        html = getattr(mv, name)(data)
        check(repr(kind) in html, f"{name} HTML does not ask MemoryViz.js for {kind!r}")
        check(embedded_snapshot(html) == data, f"{name} HTML embeds a different snapshot")
    html = mv.trace_plot(data, plot_segments=True)
    check("Active Cached Memory Timeline" in html, "trace_plot(plot_segments=True) failed")
    return expected


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="the exported snapshot (.pickle or .pickle.gz)")
    parser.add_argument("--report", help="`vramsim replay --json` output of the same replay")
    parser.add_argument(
        "--partial-history",
        action="store_true",
        help="the replay started from declared state: blocks may predate the recorded trace",
    )
    parser.add_argument(
        "--memory-viz",
        default=os.environ.get("VRAMSIM_MEMORY_VIZ") or None,
        help="path of torch/cuda/_memory_viz.py (default: $VRAMSIM_MEMORY_VIZ, else import torch)",
    )
    args = parser.parse_args(argv)
    try:
        data, raw = load_snapshot(args.snapshot)
        check_memory_viz_js_can_unpickle(raw)
        check_shape(data)
        check_trace_replays_to_segments(data, args.partial_history)
        entries = sum(len(t) for t in data["device_traces"])
        print(f"ok: pickle.load: {len(data['segments'])} segments, {entries} trace entries")
        report = None
        if args.report:
            with open(args.report) as f:
                report = json.load(f)
        mv, origin = load_memory_viz(args.memory_viz)
        if mv is None:
            print(f"SKIP: _memory_viz checks: {origin}; set VRAMSIM_MEMORY_VIZ to a _memory_viz.py")
            return SKIPPED
        totals = check_memory_viz(mv, data, report)
        print(f"ok: _memory_viz ({origin}): segsum, trace, trace_plot, segment_plot")
        for line in totals:
            print(f"ok:   {line}")
        return 0
    except CheckFailed as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
