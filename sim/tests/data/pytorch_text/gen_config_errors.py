"""Runs every settings string through PyTorch's real parser, each in a fresh process.

Usage: python gen_config_errors.py OUT.json   (with torch importable; no GPU needed)
Each case calls torch.cuda.memory._set_allocator_settings(s) once in a new interpreter, so no
state (large_segment_size_mb persists across calls in PyTorch) leaks between cases.
"""
import json, subprocess, sys

CASES = [
    "", "expandable_segments:True", "roundup_power2_divisions:4",
    "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]",
    "garbage_collection_threshold:0.5,max_split_size_mb:40",
    "release_lock_on_cudamalloc:True", "release_lock_on_hipmalloc:True",
    "max_split_size_mb:20", "max_split_size_mb:-1", "max_split_size_mb,40",
    "expandable_segments:True,", "backend:native", "large_segment_size_mb:11",
    "large_segment_size_mb:15,max_split_size_mb:20,max_non_split_rounding_mb:40,garbage_collection_threshold:0.8",
    "per_process_memory_fraction:0.5", "per_process_memory_fraction:0", "per_process_memory_fraction:1",
    "garbage_collection_threshold:0.5x", "roundup_power2_divisions:[>:4]",
    "expandable_segments_reserve:abc", "pinned_use_background_threads:True",
    "pinned_num_register_threads:128", "pinned_reserve_segment_size_mb:1",
    "graph_capture_record_stream_reuse:True", "max_non_split_rounding_mb:20",
    # invalid
    "foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2",
    "release_lock_on_cudamalloc:none", "pinned_use_cuda_host_register:none",
    "pinned_num_register_threads:none", "pinned_num_register_threads:1024",
    "max_split_size_mb:20,large_segment_size_mb:25",
    "foo", "max_split_size_mb", "max_split_size_mb:", "max_split_size_mb=40", "max_split_size_mb 40",
    "expandable_segments:true", "backend:foo", "roundup_power2_divisions:3",
    "roundup_power2_divisions:0", "roundup_power2_divisions:[64:3]", "roundup_power2_divisions:[63:4]",
    "roundup_power2_divisions:[64:8,128:2", "per_process_memory_fraction:1.5",
    "per_process_memory_fraction:-0.1", "large_segment_size_mb:10", "pinned_reserve_segment_size_mb:0",
    "pinned_num_register_threads:3", "garbage_collection_threshold:abc", "garbage_collection_threshold:nan",
    "garbage_collection_threshold:0", "max_split_size_mb:abc", "max_split_size_mb:99999999999999999999999",
    ",expandable_segments:True", "a:[1,2]", "pinned_use_background_threads:maybe",
    "graph_capture_record_stream_reuse:x", "max_non_split_rounding_mb:19",
    "expandable_segments:True;max_split_size_mb:40", "expandable_segments:True:max_split_size_mb:40",
    # tokenizer and number-parsing edge cases
    "pinned_max_cached_size_mb:0", "pinned_max_round_threshold_mb:0", "pinned_max_cached_size_mb:x",
    "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:32",
    "roundup_power2_divisions:[1:2,>:4]", "max_split_size_mb:0x20", "garbage_collection_threshold:1e-3",
    "garbage_collection_threshold:inf", "per_process_memory_fraction:0x0.8p0", " max_split_size_mb : 40 ",
    "max_split_size_mb:+40", "max_split_size_mb:-0", "roundup_power2_divisions:[]", "roundup_power2_divisions:[64:8]extra",
    "expandable_segments:True,,", "expandable_segments", "roundup_power2_divisions", "roundup_power2_divisions:[64]",
    "roundup_power2_divisions:[64:8 128:4]", "large_segment_size_mb:25,max_non_split_rounding_mb:24",
    "large_segment_size_mb:25,max_split_size_mb:25", "backend:native,max_split_size_mb:10",
    "expandable_segments_reserve_by_class:[a:0.5,b:2G]", "expandable_segments_reserve_by_class:abc",
    "expandable_segments_reserve_by_class:[a:0.5", "\tmax_split_size_mb:40\n", "max_split_size_mb:40,foo",
    "foo:[1,2", "roundup_power2_divisions:[64:8,>:2,32:4]", "roundup_power2_divisions:[0:4]",
    "roundup_power2_divisions:[65536:4]", "roundup_power2_divisions:[64:-1]",
    "per_process_memory_fraction:nan", "pinned_num_register_threads:0", "pinned_num_register_threads:-2",
    "large_segment_size_mb:0x10", "max_split_size_mb:1e3", "max_split_size_mb:18446744073709551615",
    "max_split_size_mb:18446744073709551616", "garbage_collection_threshold:.5", "garbage_collection_threshold:1e-400",
    "expandable_segments:True:", ":", ",", "[", "]", "::", "max_split_size_mb::40",
    "roundup_power2_divisions:[64:8,", "backend:cudaMallocAsync", "backend:cudaMallocAsync,release_lock_on_cudamalloc:True",
    "pinned_num_register_threads:abc,max_split_size_mb:2", "max_split_size_mb:2,pinned_num_register_threads:abc",
]

CHILD = r'''
import sys, json, warnings
warnings.simplefilter("ignore")
import torch
s = sys.argv[1]
try:
    torch.cuda.memory._set_allocator_settings(s)
    print(json.dumps({"ok": True}))
except Exception as e:
    print(json.dumps({"ok": False, "type": type(e).__name__, "message": str(e)}))
'''

def main():
    import torch
    out = {"torch": torch.__version__, "how": "torch.cuda.memory._set_allocator_settings(s) in a fresh "
           "interpreter per case, CPU-only machine (no GPU needed for parsing)", "cases": []}
    for s in CASES:
        p = subprocess.run([sys.executable, "-c", CHILD, s], capture_output=True, text=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["settings"] = s
        out["cases"].append(r)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")

main()
