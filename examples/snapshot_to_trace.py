"""Stand-in converter: a PyTorch memory snapshot's allocation history -> a vramsim JSON Lines trace.

Used once to make the shipped example trace from a real snapshot; `vramsim import` replaces it.
Blocks that were live when recording started (freed in the history without an alloc, or live at the end
without one) are allocated at the start of the trace, so the replay starts from the recorded live set.
Usage: python3 snapshot_to_trace.py SNAPSHOT.pickle[.gz] OUT.jsonl [DEVICE]
"""
import gzip
import json
import pickle
import sys


def load(path):
    opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def main(src, dst, device=0):
    snap = load(src)
    trace = snap["device_traces"][device]
    allocated_in_trace = set()
    live = {}
    preexisting = []
    for entry in trace:
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            allocated_in_trace.add(addr)
            live[addr] = True
        elif action == "free_requested":
            if addr not in live:
                preexisting.append((addr, entry["size"], entry["stream"]))
            live.pop(addr, None)
    for seg in snap["segments"]:
        if seg.get("device", 0) != device:
            continue
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and block["address"] not in live:
                if block["address"] not in allocated_in_trace:
                    preexisting.append((block["address"], block["requested_size"], seg["stream"]))
    out = open(dst, "w")
    meta = {"source": src.split("/")[-1], "device": device,
            "note": "allocation history of a real PyTorch memory snapshot; blocks live before recording started are allocated first"}
    out.write(json.dumps({"format": "vramsim-trace", "version": 1, "meta": meta}) + "\n")
    ids = {}
    next_id = 0

    def new_id(addr):
        nonlocal next_id
        next_id += 1
        ids[addr] = next_id
        return next_id

    out.write(json.dumps({"op": "phase", "name": "live before recording"}) + "\n")
    for addr, size, stream in preexisting:
        out.write(json.dumps({"op": "alloc", "id": new_id(addr), "size": size, "stream": stream}) + "\n")
    out.write(json.dumps({"op": "phase", "name": "recorded"}) + "\n")
    for entry in trace:
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            out.write(json.dumps({"op": "alloc", "id": new_id(addr), "size": entry["size"], "stream": entry["stream"]}) + "\n")
        elif action == "free_requested":
            out.write(json.dumps({"op": "free", "id": ids.pop(addr)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
