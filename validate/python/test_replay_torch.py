"""Tests of replay_torch.py's pure parts: no torch, no GPU needed (``python -m pytest validate/python``).

The GPU part is ``replay``; here it is only checked that it skips, with a reason, where CUDA is missing.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import replay_torch as rt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

DOC_EXAMPLE_JSONL = """{"format":"vramsim-trace","version":1,"meta":{"model":"tiny-mlp","batch":8}}
{"op":"phase","name":"forward"}
{"op":"alloc","id":1,"size":4096,"stream":0,"category":"parameter","tag":"fc1.weight"}
{"op":"alloc","id":"fc1.out","size":1048576,"category":"activation"}
{"op":"record_stream","id":"fc1.out","stream":7}
{"op":"compute","stream":7,"us":12.5}
{"op":"phase","name":"backward"}
{"op":"free","id":"fc1.out"}
{"op":"sync"}
{"op":"empty_cache"}
{"op":"free","id":1}
"""


def test_module_does_not_import_torch():
    source = (Path(__file__).parent / "replay_torch.py").read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not any("torch" in line for line in top_level), top_level


def test_both_encodings_of_the_documented_example_read_the_same(tmp_path):
    meta, events = rt.parse_trace(DOC_EXAMPLE_JSONL)
    assert meta == {"model": "tiny-mlp", "batch": 8}
    assert [e["op"] for e in events] == [
        "phase", "alloc", "alloc", "record_stream", "compute", "phase", "free", "sync", "empty_cache", "free",
    ]
    lines = DOC_EXAMPLE_JSONL.splitlines()
    document = json.loads(lines[0])
    document["events"] = [json.loads(line) for line in lines[1:]]
    pretty = json.dumps(document, indent=2)
    assert rt.parse_trace(pretty) == (meta, events)
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(DOC_EXAMPLE_JSONL.encode()))
    assert rt.read_trace(path) == (meta, events)


def test_headerless_json_lines_and_blank_lines():
    meta, events = rt.parse_trace('\n{"op":"alloc","id":1,"size":8}\n\n{"op":"free","id":1}\n')
    assert meta == {}
    assert len(events) == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "the trace is empty"),
        ('{"format":"other","version":1}\n', "`format` must be \"vramsim-trace\""),
        ('{"format":"vramsim-trace","version":2}\n', "only trace format version 1"),
        ('{"op":"malloc","id":1}\n', "unknown op 'malloc'"),
        ('{"op":"alloc","id":1}\n', "alloc needs size"),
        ('{"op":"free","id":1,"size":3}\n', "free takes no size"),
        ('{"op":"alloc","id":1,"size":8}\n{"op":\n', "t.jsonl:2:"),
    ],
)
def test_bad_traces_say_where(text, message):
    with pytest.raises(rt.TraceFormatError, match=None) as info:
        rt.parse_trace(text, "t.jsonl")
    assert message in str(info.value)


def test_trace_stems_keep_inner_dots():
    assert rt.trace_stem(Path("tinyllama-1.1b__b2s128__bf16-adamw.jsonl.gz")) == "tinyllama-1.1b__b2s128__bf16-adamw"
    assert rt.trace_stem(Path("step.json")) == "step"


def test_streams_are_planned_in_order_of_first_use():
    events = [
        {"op": "alloc", "id": 1, "size": 1, "stream": 3},
        {"op": "compute", "stream": 0, "us": 1},
        {"op": "record_stream", "id": 1, "stream": 7},
        {"op": "sync", "stream": 3},
        {"op": "alloc", "id": 2, "size": 1},
        {"op": "compute", "stream": 5, "us": 1},
    ]
    assert rt.plan_streams(events) == [3, 7, 5]


class FakeBackend:
    """Records what the replay asks of the allocator."""

    def __init__(self, oom_at_size=None):
        self.calls = []
        self.oom_at_size = oom_at_size

    def alloc(self, key, size, stream):
        if size == self.oom_at_size:
            raise MemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        self.calls.append(("alloc", key, size, stream))

    def free(self, key):
        self.calls.append(("free", key))

    def record_stream(self, key, stream):
        self.calls.append(("record_stream", key, stream))

    def compute(self, stream, us):
        self.calls.append(("compute", stream, us))

    def sync(self, stream):
        self.calls.append(("sync", stream))

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def segment(self, event):
        self.calls.append(("segment", event["addr"]))


def test_the_replay_performs_every_event_in_order():
    _, events = rt.parse_trace(DOC_EXAMPLE_JSONL)
    backend = FakeBackend()
    outcome = rt.replay_events(events, backend)
    one, out = ("int", 1), ("str", "fc1.out")
    assert backend.calls == [
        ("alloc", one, 4096, 0),
        ("alloc", out, 1048576, 0),
        ("record_stream", out, 7),
        ("compute", 7, 12.5),
        ("free", out),
        ("sync", None),
        ("empty_cache",),
        ("free", one),
    ]
    assert (outcome.events, outcome.allocs, outcome.frees, outcome.oom_event) == (10, 2, 2, None)


def test_ids_1_and_string_1_are_different_and_reuse_after_free_is_fine():
    events = [
        {"op": "alloc", "id": 1, "size": 1},
        {"op": "alloc", "id": "1", "size": 2},
        {"op": "free", "id": 1},
        {"op": "alloc", "id": 1, "size": 3},
    ]
    backend = FakeBackend()
    rt.replay_events(events, backend)
    assert [c[2] for c in backend.calls if c[0] == "alloc"] == [1, 2, 3]


@pytest.mark.parametrize(
    "events, message",
    [
        ([{"op": "free", "id": 9}], "event 0: free of id 9, which is not live"),
        ([{"op": "alloc", "id": 1, "size": 1}, {"op": "alloc", "id": 1, "size": 1}], "event 1: alloc of id 1"),
        ([{"op": "record_stream", "id": "x", "stream": 1}], "event 0: record_stream of id 'x'"),
    ],
)
def test_inconsistent_traces_are_errors(events, message):
    with pytest.raises(rt.ReplayError) as info:
        rt.replay_events(events, FakeBackend())
    assert message in str(info.value)


def test_the_replay_stops_at_the_first_out_of_memory_error():
    events = [
        {"op": "alloc", "id": 1, "size": 10},
        {"op": "alloc", "id": 2, "size": 1 << 30},
        {"op": "free", "id": 1},
    ]
    backend = FakeBackend(oom_at_size=1 << 30)
    outcome = rt.replay_events(events, backend, lambda e: isinstance(e, MemoryError))
    assert outcome.oom_event == 1
    assert outcome.oom_message.startswith("CUDA out of memory.")
    assert backend.calls == [("alloc", ("int", 1), 10, 0)]
    with pytest.raises(MemoryError):
        rt.replay_events(events, FakeBackend(oom_at_size=1 << 30))  # not an OOM by the predicate


def _torch_result(**stats):
    return {
        "trace": "examples/x.jsonl",
        "meta": {"model": "gpt2", "recipe": "bf16 bs8"},
        "alloc_conf": "",
        "device": {"name": "NVIDIA H100 80GB HBM3"},
        "oom_event": None,
        "oom_message": None,
        "memory_stats": stats,
    }


def _vramsim(**fields):
    base = {"oom": None, "stats": {}}
    base.update(fields)
    return base


def test_comparison_is_field_by_field():
    torch_result = _torch_result(**{
        "allocated_bytes.all.peak": 1000,
        "reserved_bytes.all.peak": 2097152,
        "num_device_alloc": 1,
        "segment.all.peak": 1,
        "only_in_torch": 5,
    })
    report = _vramsim(
        peak_allocated_bytes=1000,
        peak_reserved_bytes=4194304,
        device_allocations=1,
        stats={"segment.all.peak": 1, "reserved_bytes.all.peak": 4194304, "only_in_vramsim": 1},
    )
    rows = {r.field: r for r in rt.compare(torch_result, report)}
    assert rows["peak_allocated_bytes (allocated_bytes.all.peak)"].match
    reserved = rows["peak_reserved_bytes (reserved_bytes.all.peak)"]
    assert (reserved.match, reserved.diff) == (False, 2097152)
    assert rows["segment.all.peak"].match
    assert rows["reserved_bytes.all.peak"].diff == 2097152
    assert "only_in_torch" not in rows and "only_in_vramsim" not in rows
    assert rows["oom_event_index"].match
    text = rt.comparison_text(list(rows.values()), only_differences=True)
    assert "reserved_bytes.all.peak" in text and "segment.all.peak" not in text
    assert text.endswith("6 fields compared, 2 differ\n")


def test_ooms_are_compared_by_event_and_first_line():
    torch_result = _torch_result()
    torch_result.update(oom_event=4, oom_message="CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 ...\nmore")
    report = _vramsim(oom={"event_index": 4, "message": "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 ..."})
    rows = {r.field: r for r in rt.compare(torch_result, report)}
    assert rows["oom_event_index"].match and rows["oom_message_first_line"].match


def test_results_table_and_readme_update():
    row = rt.result_row(
        _torch_result(**{"allocated_bytes.all.peak": 2**30, "reserved_bytes.all.peak": 2 * 2**30}),
        {"peak_allocated_bytes": 2**30, "peak_reserved_bytes": 2**31 + 2**29},
    )
    assert row["model"] == "gpt2" and row["recipe"] == "bf16 bs8"
    assert rt.recipe_of({"recipe": "fp32-sgd", "batch": 2, "seq": 128}, "expandable_segments:True") == (
        "fp32-sgd b2 s128 expandable_segments:True"
    )
    assert rt.recipe_of({}, "") == "default"
    table = rt.render_table([row])
    assert table.splitlines()[2] == (
        "| gpt2 | bf16 bs8 | NVIDIA H100 80GB HBM3 | 1.000 / 1.000 | +0.00% | 2.500 / 2.000 | +25.00% |"
    )
    readme = f"intro\n{rt.RESULTS_BEGIN}\nold table\n{rt.RESULTS_END}\nafter\n"
    updated = rt.update_readme(readme, table)
    assert updated == f"intro\n{rt.RESULTS_BEGIN}\n{table}{rt.RESULTS_END}\nafter\n"
    assert rt.update_readme(updated, table) == updated, "idempotent"
    with pytest.raises(ValueError):
        rt.update_readme("no markers", table)
    assert rt.render_table([]).count("\n") == 2, "no results: the header alone"


def test_the_committed_readme_has_the_markers_and_only_measured_rows():
    """The table holds what ``table --readme`` wrote from a GPU run (2026-11-24, an H100: the example trace
    with the default settings and with expandable segments), nothing typed by hand: each row names the GPU
    it ran on and is the row the table renderer makes of such a result."""
    readme = (ROOT / "validate/README.md").read_text()
    block = readme[readme.index(rt.RESULTS_BEGIN):readme.index(rt.RESULTS_END)]
    rows = [line for line in block.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| model | recipe | GPU |"), "the header first"
    assert [r.split(" | ")[1] for r in rows[1:]] == ["default", "expandable_segments:True"]
    for r in rows[1:]:
        assert " | NVIDIA H100 80GB HBM3 | " in r, r


def test_the_example_trace_reads():
    meta, events = rt.read_trace(ROOT / "examples/cs336-medium-train-step.jsonl")
    assert "source" in meta and len(events) > 10000
    assert rt.plan_streams(events) == []


def test_replay_skips_with_a_reason_without_cuda(capsys):
    if rt.cuda_unavailable_reason() is None:
        pytest.skip("CUDA is available here: the skip path does not apply")
    code = rt.main(["replay", str(ROOT / "examples/cs336-medium-train-step.jsonl")])
    assert code == rt.EXIT_SKIPPED
    out = capsys.readouterr().out
    assert out.startswith("skipped: ") and out.rstrip().endswith("replaying through PyTorch needs a CUDA GPU")


def test_a_bad_trace_fails_before_looking_for_a_gpu(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op":"alloc","id":1}\n')
    assert rt.main(["replay", str(bad)]) == 2
    assert "alloc needs size" in capsys.readouterr().err
