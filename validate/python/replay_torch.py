"""Replay a vramsim trace through the real PyTorch CUDA caching allocator and compare with ``vramsim replay``.

This is the strongest check of vramsim's allocator model: the same host-side requests, in the same order,
on the same streams, with the same ``PYTORCH_CUDA_ALLOC_CONF``, go through the real allocator on a real
GPU, and what it reports (``torch.cuda.memory_stats()``, the memory snapshot) is compared field by field
with what the simulator predicts for the same trace on a device of the same size.

Usage (on a machine with a CUDA GPU and torch)::

    python validate/python/replay_torch.py replay TRACE [--alloc-conf S] [--out DIR] [--vramsim PATH]
    python validate/python/replay_torch.py compare DIR                # re-compare saved results
    python validate/python/replay_torch.py table DIR... [--readme validate/README.md]

``replay`` writes into ``--out`` (default ``validate-out/<trace name>``):

``torch.json``       what PyTorch did: device, settings, versions, ``memory_stats()`` at the end, peaks, the
                     OOM (event index and message) if one was raised;
``snapshot.pickle``  ``torch.cuda.memory._dump_snapshot()`` (history recorded with
                     ``_record_memory_history(max_entries=...)``; not available with
                     ``backend:cudaMallocAsync``, whose allocator does not record history);
``vramsim.json``     ``vramsim replay TRACE --json`` on a device of the GPU's total memory with the memory
                     already in use at the start counted as the CUDA context;
``comparison.json``  the field-by-field comparison, also printed;
``check-snapshot.json`` ``vramsim check-snapshot snapshot.pickle --json`` when the ``vramsim`` binary has
                     that command: the snapshot's own history replayed through the model, segment event by
                     segment event.

How each trace event is performed
=================================

``alloc``         ``torch.empty(size, dtype=torch.uint8, device=cuda)`` under ``torch.cuda.stream(s)``:
                  exactly one ``malloc(size, s)`` of the caching allocator, like any tensor of ``size``
                  bytes. (``torch.cuda.caching_allocator_alloc`` makes the same call, but returns a bare
                  pointer, and ``record_stream`` is only reachable through a tensor's storage, so tensors
                  are used throughout.) Size 0 allocates nothing, as in the allocator.
``free``          the last reference to that tensor is dropped: the allocator's ``free``.
``record_stream`` ``tensor.record_stream(s)``.
``compute``       ``torch.cuda._sleep(cycles)`` on the stream, ``cycles`` from a measured clock rate, so the
                  stream is busy that long (``--compute skip`` leaves it idle).
``sync``          ``torch.cuda.synchronize()`` or ``stream.synchronize()``.
``empty_cache``   ``torch.cuda.empty_cache()``.
``phase``         nothing.

Trace stream 0 is the device's default stream; every other id gets its own ``torch.cuda.Stream``, created
before the first event (in order of first use) so that stream creation does not interleave with the
replay.

The pure parts — reading traces, planning streams, the replay loop against any backend, the comparison
and the results table — import nothing beyond the standard library and are tested by
``test_replay_torch.py`` without torch or a GPU. ``torch`` is imported only by ``replay``, after
``PYTORCH_CUDA_ALLOC_CONF`` is set.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

EXIT_SKIPPED = 0  # a skip is not a failure: CI without a GPU runs this and moves on
RESULTS_BEGIN = "<!-- results:begin -->"
RESULTS_END = "<!-- results:end -->"

OPS = {
    "alloc": ({"id", "size"}, {"stream", "category", "tag"}),
    "free": ({"id"}, set()),
    "record_stream": ({"id", "stream"}, set()),
    "empty_cache": (set(), set()),
    "compute": ({"us"}, {"stream"}),
    "sync": (set(), {"stream"}),
    "phase": ({"name"}, set()),
    "segment": ({"addr", "size"}, {"stream", "pool", "expandable", "blocks"}),
}


class TraceFormatError(ValueError):
    """A trace that does not follow docs/trace-format.md."""


# --------------------------------------------------------------------------------------------------
# Reading traces (docs/trace-format.md)
# --------------------------------------------------------------------------------------------------


def _open_text(path: Path) -> str:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8")
    return text[1:] if text.startswith("\ufeff") else text


def parse_trace(text: str, name: str = "<trace>") -> tuple[dict, list[dict]]:
    """Returns (meta, events) of a trace in either encoding (a JSON document or JSON Lines)."""
    stripped = text.lstrip()
    if not stripped:
        raise TraceFormatError(f"{name}: the trace is empty")
    first_line = stripped.splitlines()[0]
    document = None
    if first_line.startswith("{"):
        try:
            candidate = json.loads(first_line)
            if isinstance(candidate, dict) and "events" in candidate:
                document = candidate
        except json.JSONDecodeError:
            # The start of an object that goes on over later lines: a pretty-printed document.
            try:
                document = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{name}:{e.lineno}:{e.colno}: {e.msg}") from None
    if document is not None:
        _check_header(document, name, 1)
        events = document["events"]
        if not isinstance(events, list):
            raise TraceFormatError(f"{name}: `events` must be an array")
        for i, event in enumerate(events):
            _check_event(event, name, None, i)
        return document.get("meta", {}), events
    meta: dict = {}
    events = []
    seen_first = False
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{name}:{lineno}:{e.colno}: {e.msg}") from None
        if not seen_first:
            seen_first = True
            if isinstance(value, dict) and "op" not in value:
                _check_header(value, name, lineno)
                meta = value.get("meta", {})
                continue
        _check_event(value, name, lineno, len(events))
        events.append(value)
    return meta, events


def read_trace(path: Path) -> tuple[dict, list[dict]]:
    """Reads a trace file (gzip detected by content)."""
    return parse_trace(_open_text(path), str(path))


def _check_header(header: Any, name: str, lineno: int) -> None:
    if header.get("format") != "vramsim-trace":
        raise TraceFormatError(f"{name}:{lineno}: the header's `format` must be \"vramsim-trace\"")
    if header.get("version") != 1:
        raise TraceFormatError(f"{name}:{lineno}: only trace format version 1 is supported")


def _check_event(event: Any, name: str, lineno: int | None, index: int) -> None:
    where = f"{name}:{lineno}" if lineno is not None else name
    if not isinstance(event, dict) or "op" not in event:
        raise TraceFormatError(f"{where}: event {index}: an event is an object with an `op`")
    op = event["op"]
    if op not in OPS:
        raise TraceFormatError(f"{where}: event {index}: unknown op {op!r}; valid ops: {', '.join(OPS)}")
    required, optional = OPS[op]
    keys = set(event) - {"op"}
    missing = required - keys
    if missing:
        raise TraceFormatError(f"{where}: event {index}: {op} needs {', '.join(sorted(missing))}")
    unknown = keys - required - optional
    if unknown:
        raise TraceFormatError(f"{where}: event {index}: {op} takes no {', '.join(sorted(unknown))}")


def alloc_id(value: Any) -> tuple[str, Any]:
    """The id as a key: ``1`` and ``"1"`` are different ids (docs/trace-format.md)."""
    return (type(value).__name__, value)


def plan_streams(events: Iterable[dict]) -> list[int]:
    """The non-default trace streams, in order of first use (each becomes a ``torch.cuda.Stream``)."""
    order: list[int] = []
    seen = {0}
    for event in events:
        stream = event.get("stream")
        if stream is not None and stream not in seen:
            seen.add(stream)
            order.append(stream)
    return order


# --------------------------------------------------------------------------------------------------
# The replay loop, against any backend
# --------------------------------------------------------------------------------------------------


class ReplayError(RuntimeError):
    """The trace's story is inconsistent (a free of an id that is not live, an id allocated twice)."""


@dataclass
class Outcome:
    """What a replay did."""

    events: int = 0
    allocs: int = 0
    frees: int = 0
    oom_event: int | None = None
    oom_message: str | None = None


def replay_events(events: Iterable[dict], backend: Any, is_oom=lambda e: False) -> Outcome:
    """Performs the events on ``backend`` (methods ``alloc(key, size, stream)``, ``free(key)``,
    ``record_stream(key, stream)``, ``compute(stream, us)``, ``sync(stream_or_None)``, ``empty_cache()``,
    ``segment(event)``) and stops at the first exception for which ``is_oom`` is true, as the program
    would have."""
    outcome = Outcome()
    live: set = set()
    for index, event in enumerate(events):
        outcome.events += 1
        op = event["op"]
        if op == "alloc":
            key = alloc_id(event["id"])
            if key in live:
                raise ReplayError(f"event {index}: alloc of id {event['id']!r}, which is already live")
            try:
                backend.alloc(key, event["size"], event.get("stream") or 0)
            except Exception as e:  # noqa: BLE001 - the backend's OOM type is torch's
                if is_oom(e):
                    outcome.oom_event = index
                    outcome.oom_message = str(e)
                    break
                raise
            live.add(key)
            outcome.allocs += 1
        elif op == "free":
            key = alloc_id(event["id"])
            if key not in live:
                raise ReplayError(f"event {index}: free of id {event['id']!r}, which is not live")
            live.discard(key)
            backend.free(key)
            outcome.frees += 1
        elif op == "record_stream":
            key = alloc_id(event["id"])
            if key not in live:
                raise ReplayError(f"event {index}: record_stream of id {event['id']!r}, which is not live")
            backend.record_stream(key, event["stream"])
        elif op == "compute":
            backend.compute(event.get("stream") or 0, float(event["us"]))
        elif op == "sync":
            backend.sync(event.get("stream"))
        elif op == "empty_cache":
            backend.empty_cache()
        elif op == "segment":
            for block in event.get("blocks") or []:
                live.add(alloc_id(block["id"]))
            backend.segment(event)
    return outcome


class TorchBackend:
    """Performs trace events with torch (see the module documentation)."""

    def __init__(self, torch: Any, device: int, streams: list[int], compute: str) -> None:
        self.torch = torch
        self.device = torch.device("cuda", device)
        self.streams = {0: torch.cuda.default_stream(self.device)}
        for sid in streams:
            self.streams[sid] = torch.cuda.Stream(self.device)
        self.live: dict = {}
        self.compute_mode = compute
        self.cycles_per_us = self._clock() if compute == "sleep" else 0.0

    def _clock(self) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / max(start.elapsed_time(end) * 1000.0, 1e-3)

    def alloc(self, key, size: int, stream: int) -> None:
        with self.torch.cuda.stream(self.streams[stream]):
            self.live[key] = self.torch.empty(size, dtype=self.torch.uint8, device=self.device)

    def free(self, key) -> None:
        del self.live[key]

    def record_stream(self, key, stream: int) -> None:
        self.live[key].record_stream(self.streams[stream])

    def compute(self, stream: int, us: float) -> None:
        if self.compute_mode == "sleep" and us > 0:
            with self.torch.cuda.stream(self.streams[stream]):
                self.torch.cuda._sleep(max(1, int(us * self.cycles_per_us)))

    def sync(self, stream: int | None) -> None:
        if stream is None:
            self.torch.cuda.synchronize(self.device)
        else:
            self.streams[stream].synchronize()

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def segment(self, event: dict) -> None:
        # A trace starting from a snapshot's state: its live blocks become allocations of their requested
        # sizes (the real allocator decides their segments).
        for block in event.get("blocks") or []:
            size = block.get("requested", block["size"])
            self.alloc(alloc_id(block["id"]), size, event.get("stream") or 0)


# --------------------------------------------------------------------------------------------------
# Comparison and the results table
# --------------------------------------------------------------------------------------------------

# (vramsim report key, torch.json key): the headline figures.
HEADLINE = [
    ("peak_allocated_bytes", "allocated_bytes.all.peak"),
    ("peak_reserved_bytes", "reserved_bytes.all.peak"),
    ("peak_active_bytes", "active_bytes.all.peak"),
    ("peak_requested_bytes", "requested_bytes.all.peak"),
    ("final_allocated_bytes", "allocated_bytes.all.current"),
    ("final_reserved_bytes", "reserved_bytes.all.current"),
    ("device_allocations", "num_device_alloc"),
    ("device_frees", "num_device_free"),
    ("alloc_retries", "num_alloc_retries"),
]


@dataclass
class Row:
    """One compared field."""

    field: str
    torch: Any
    vramsim: Any
    diff: float | None = None
    match: bool = False


def compare(torch_result: dict, vramsim_report: dict) -> list[Row]:
    """Field by field: the headline figures, every ``memory_stats()`` key both sides have, and the OOM."""
    stats = torch_result.get("memory_stats", {})
    rows: list[Row] = []
    for vkey, tkey in HEADLINE:
        if tkey in stats and vkey in vramsim_report:
            rows.append(_row(f"{vkey} ({tkey})", stats[tkey], vramsim_report[vkey]))
    vstats = vramsim_report.get("stats", {})
    for key in sorted(set(stats) & set(vstats)):
        rows.append(_row(key, stats[key], vstats[key]))
    t_oom = torch_result.get("oom_event")
    v_oom = (vramsim_report.get("oom") or {}).get("event_index")
    rows.append(Row("oom_event_index", t_oom, v_oom, None, t_oom == v_oom))
    if torch_result.get("oom_message") is not None or vramsim_report.get("oom"):
        t_msg = (torch_result.get("oom_message") or "").splitlines()[:1]
        v_msg = ((vramsim_report.get("oom") or {}).get("message") or "").splitlines()[:1]
        rows.append(Row("oom_message_first_line", t_msg, v_msg, None, t_msg == v_msg))
    return rows


def _row(name: str, torch_value: Any, vramsim_value: Any) -> Row:
    diff = None
    if isinstance(torch_value, (int, float)) and isinstance(vramsim_value, (int, float)):
        diff = vramsim_value - torch_value
    return Row(name, torch_value, vramsim_value, diff, torch_value == vramsim_value)


def comparison_text(rows: list[Row], only_differences: bool = False) -> str:
    """The comparison for people."""
    lines = [f"{'field':<58} {'torch':>16} {'vramsim':>16} {'diff':>14}"]
    for r in rows:
        if only_differences and r.match:
            continue
        diff = "" if r.diff is None else f"{r.diff:+}"
        mark = "" if r.match else "  <- differs"
        lines.append(f"{r.field:<58} {str(r.torch):>16} {str(r.vramsim):>16} {diff:>14}{mark}")
    differing = sum(not r.match for r in rows)
    lines.append(f"{len(rows)} fields compared, {differing} differ")
    return "\n".join(lines) + "\n"


def result_row(torch_result: dict, vramsim_report: dict) -> dict:
    """One line of the results table."""
    meta = torch_result.get("meta", {})
    stats = torch_result.get("memory_stats", {})
    return {
        "model": str(meta.get("model") or meta.get("source") or Path(torch_result.get("trace", "?")).name),
        "recipe": recipe_of(meta, torch_result.get("alloc_conf") or ""),
        "gpu": torch_result.get("device", {}).get("name", "?"),
        "pred_alloc": vramsim_report.get("peak_allocated_bytes"),
        "meas_alloc": stats.get("allocated_bytes.all.peak"),
        "pred_res": vramsim_report.get("peak_reserved_bytes"),
        "meas_res": stats.get("reserved_bytes.all.peak"),
    }


def recipe_of(meta: dict, alloc_conf: str) -> str:
    """The recipe column: the trace's recipe, batch and sequence length, and the allocator settings."""
    parts = [str(meta["recipe"])] if meta.get("recipe") else []
    if meta.get("batch"):
        parts.append(f"b{meta['batch']}")
    if meta.get("seq"):
        parts.append(f"s{meta['seq']}")
    if alloc_conf:
        parts.append(alloc_conf)
    return " ".join(parts) or "default"


def _gib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def _err(pred: Any, meas: Any) -> str:
    if pred is None or meas is None:
        return "-"
    if meas == 0:
        return "0.00%" if pred == 0 else "inf"
    return f"{(pred - meas) / meas * 100:+.2f}%"


def render_table(rows: list[dict]) -> str:
    """The README's results table (GiB; error = (predicted − measured) / measured)."""
    out = [
        "| model | recipe | GPU | peak allocated predicted / measured (GiB) | error | "
        "peak reserved predicted / measured (GiB) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['recipe']} | {r['gpu']} | {_gib(r['pred_alloc'])} / {_gib(r['meas_alloc'])} | "
            f"{_err(r['pred_alloc'], r['meas_alloc'])} | {_gib(r['pred_res'])} / {_gib(r['meas_res'])} | "
            f"{_err(r['pred_res'], r['meas_res'])} |"
        )
    return "\n".join(out) + "\n"


def update_readme(text: str, table: str) -> str:
    """``text`` with everything between the results markers replaced by ``table``."""
    begin, end = text.find(RESULTS_BEGIN), text.find(RESULTS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the README has no {RESULTS_BEGIN} ... {RESULTS_END} block")
    return text[: begin + len(RESULTS_BEGIN)] + "\n" + table + text[end:]


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------


def cuda_unavailable_reason() -> str | None:
    """Why this machine cannot replay through PyTorch on CUDA, or None if it can."""
    try:
        import torch  # noqa: PLC0415 - imported only once the settings are in the environment
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def trace_stem(path: Path) -> str:
    """``gpt2__b2s128.jsonl.gz`` -> ``gpt2__b2s128`` (dots inside the name are kept)."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".ndjson", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def find_vramsim(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    root = Path(__file__).resolve().parents[2]
    for candidate in (root / "target/release/vramsim", root / "target/debug/vramsim"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("vramsim")


def cmd_replay(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    meta, events = read_trace(trace)  # fails early, without a GPU, on a bad trace
    # PyTorch reads the settings when CUDA is first initialised: set them before importing torch.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"skipped: {reason}; replaying through PyTorch needs a CUDA GPU")
        return EXIT_SKIPPED
    import torch  # noqa: PLC0415

    out = Path(args.out or Path("validate-out") / trace_stem(trace))
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    torch.cuda.init()
    torch.cuda.set_device(device)
    backend = TorchBackend(torch, device, plan_streams(events), args.compute)
    torch.cuda.synchronize(device)
    free_at_start, total = torch.cuda.mem_get_info(device)
    native = torch.cuda.get_allocator_backend() == "native"
    if native:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
    torch.cuda.reset_peak_memory_stats(device)
    outcome = replay_events(events, backend, lambda e: isinstance(e, torch.cuda.OutOfMemoryError))
    torch.cuda.synchronize(device)
    snapshot_path = None
    if native:
        snapshot_path = out / "snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(snapshot_path))
        torch.cuda.memory._record_memory_history(enabled=None)
    result = {
        "trace": str(trace),
        "meta": meta,
        "alloc_conf": args.alloc_conf,
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": {
            "index": device,
            "name": torch.cuda.get_device_name(device),
            "total_memory": total,
            "free_at_start": free_at_start,
        },
        "compute": args.compute,
        "events": outcome.events,
        "allocs": outcome.allocs,
        "frees": outcome.frees,
        "oom_event": outcome.oom_event,
        "oom_message": outcome.oom_message,
        "memory_stats": dict(torch.cuda.memory_stats(device)),
    }
    (out / "torch.json").write_text(json.dumps(result, indent=2) + "\n")
    backend.live.clear()

    vramsim = find_vramsim(args.vramsim)
    if vramsim is None:
        print("vramsim binary not found (build it with `cargo build --release`, or pass --vramsim): "
              "torch.json written, nothing compared")
        return 0
    # The simulated device: the GPU's total, and what was in use before the first event as the context.
    cmd = [vramsim, "replay", str(trace), "--json", "--alloc-conf", args.alloc_conf,
           "--capacity", str(total), "--context", str(total - free_at_start)]
    report = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    (out / "vramsim.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = compare(result, report)
    (out / "comparison.json").write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
    print(comparison_text(rows, only_differences=not args.all_fields))
    if snapshot_path is not None:
        check = subprocess.run([vramsim, "check-snapshot", str(snapshot_path), "--json",
                                "--capacity", str(free_at_start)], capture_output=True, text=True)
        if check.returncode == 0:
            (out / "check-snapshot.json").write_text(check.stdout)
            print(f"check-snapshot: {out / 'check-snapshot.json'}")
        else:
            print(f"check-snapshot did not run: {check.stderr.strip().splitlines()[-1:]}")
    return 0


def load_results(directory: Path) -> tuple[dict, dict]:
    return (json.loads((directory / "torch.json").read_text()),
            json.loads((directory / "vramsim.json").read_text()))


def cmd_compare(args: argparse.Namespace) -> int:
    torch_result, report = load_results(Path(args.dir))
    print(comparison_text(compare(torch_result, report), only_differences=not args.all_fields))
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    rows = []
    for d in args.dirs:
        d = Path(d)
        if (d / "torch.json").exists() and (d / "vramsim.json").exists():
            rows.append(result_row(*load_results(d)))
    table = render_table(rows)
    if args.readme:
        readme = Path(args.readme)
        readme.write_text(update_readme(readme.read_text(), table))
        print(f"{len(rows)} results written to {readme}")
    else:
        sys.stdout.write(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="replay a trace through PyTorch on CUDA and compare with vramsim")
    p.add_argument("trace")
    p.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for both sides")
    p.add_argument("--out", help="output directory (default validate-out/<trace name>)")
    p.add_argument("--vramsim", help="the vramsim binary (default: target/release, target/debug, PATH)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--compute", choices=["sleep", "skip"], default="sleep",
                   help="compute events: busy-wait the stream that long (default), or skip them")
    p.add_argument("--max-entries", type=int, default=10_000_000, help="_record_memory_history max_entries")
    p.add_argument("--all-fields", action="store_true", help="print every compared field, not only differences")
    p.set_defaults(func=cmd_replay)
    p = sub.add_parser("compare", help="compare the saved torch.json and vramsim.json of a replay")
    p.add_argument("dir")
    p.add_argument("--all-fields", action="store_true")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("table", help="the results table of replay directories (into a README with --readme)")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--readme")
    p.set_defaults(func=cmd_table)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TraceFormatError, ReplayError, ValueError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
