"""vramsim from Python: GPU memory of PyTorch training steps, simulated in-process.

Every function calls the Rust library behind the ``vramsim`` command line (no subprocess), with the
GIL released while it computes, and gives the same answer as the command with the same options::

    import vramsim
    p = vramsim.predict(model="gpt2-medium", batch=8, seq=1024, precision="amp-bf16", gpu="rtx4090")
    p.fits, p.peak_reserved_bytes
    w = vramsim.whatif(model="gpt2", seq=512, vary={"batch": [4, 8, 16], "checkpoint": ["none", "full"]})
    w.to_pandas()
    vramsim.max_batch(model="llama2-7b", seq=2048, precision="bf16", gpu="a100-80gb").max_batch

Keyword arguments are the command line's options in snake_case (``--alloc-conf`` is ``alloc_conf``), with
its defaults: ``vramsim.options("predict")`` lists them (read from the command line's own definition).
A flag takes ``True``/``False``; ``image_size`` also takes ``(H, W)``; ``None`` leaves an option at its
default. ``plot=True`` keeps the plot as PNG bytes (``result.png``, shown by Jupyter); a file name
writes it there, as the command line does. Bad options raise :class:`ConfigError`, unreadable traces or
snapshots :class:`TraceError`, with the command line's messages.
"""

from __future__ import annotations

import copy
import json as _json
import os
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _vramsim as _native
from ._vramsim import ConfigError, TraceError, VramsimError

__all__ = [
    "predict",
    "whatif",
    "max_batch",
    "recommend",
    "replay",
    "check_snapshot",
    "diagnose",
    "import_snapshot",
    "explain",
    "gpus",
    "from_module",
    "Model",
    "record",
    "Recording",
    "options",
    "Option",
    "Result",
    "Prediction",
    "Whatif",
    "MaxBatch",
    "Recommendation",
    "ReplayReport",
    "SnapshotCheck",
    "Diagnosis",
    "ImportedDevice",
    "Gpu",
    "Explanation",
    "VramsimError",
    "ConfigError",
    "TraceError",
]

# Options that only choose the command line's output format: a result always holds the JSON document.
_OUTPUT_ONLY = {"json", "csv", "gpu-figures"}
# Options that take a file to draw to: ``True`` keeps the PNG in the result instead.
_PLOTS = {"plot", "timeline"}


class Option:
    """One option of a command, as the command line defines it."""

    __slots__ = ("name", "flag", "kind", "default", "help", "required")

    def __init__(self, flag: str, kind: str, default: Optional[str], help: str, required: bool):
        #: The keyword argument's name (``alloc_conf``).
        self.name = flag.replace("-", "_")
        #: The command line's name (``alloc-conf``).
        self.flag = flag
        #: ``flag``, ``value``, ``values`` (repeatable) or ``positional``.
        self.kind = kind
        #: The default, as the command line writes it (``None``: none, or decided by other options).
        self.default = default
        #: The command line's help text.
        self.help = help
        #: Whether it must be given.
        self.required = required

    def __repr__(self) -> str:
        default = "" if self.default is None else f", default {self.default!r}"
        return f"Option({self.name}: {self.kind}{default})"


_OPTIONS: Dict[str, Dict[str, Option]] = {}


def options(command: str = "predict") -> Dict[str, Option]:
    """The keyword arguments ``command`` takes (``predict``, ``whatif``, ``max-batch``, ``recommend``,
    ``replay``, ``import``, ``check-snapshot``), read from the command line's definition."""
    if command not in _OPTIONS:
        found = {}
        for flag, kind, default, help_text, required in _native.options(command):
            if flag in _OUTPUT_ONLY:
                continue
            option = Option(flag, kind, default, help_text, required)
            found[option.name] = option
        _OPTIONS[command] = found
    return dict(_OPTIONS[command])


def _word(name: str, value: Any) -> str:
    """A keyword argument's value as the command line writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if (
        name == "image_size"
        and isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return f"{value[0]}x{value[1]}"
    raise ConfigError(
        f"{name}: expected a number, a string or a path, got {type(value).__name__} {value!r}"
    )


def _vary_spec(key: Any, values: Any) -> str:
    """One ``--vary KEY=V1,V2`` from a key and a list of values."""
    if not isinstance(key, str):
        raise ConfigError(f"vary: option names are strings, got {key!r}")
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        values = [values]
    words = [_word(key, v) for v in values]
    sep = ";" if any("," in w for w in words) else ","
    return f"{key.replace('_', '-')}={sep.join(words)}"


def _arguments(
    command: str, function: str, kwargs: Dict[str, Any]
) -> Tuple[List[str], Dict[str, str]]:
    """The command line's arguments for ``kwargs``, and the plots to keep as PNG (option → temp file)."""
    known = options(command)
    args: List[str] = []
    positional: List[str] = []
    pngs: Dict[str, str] = {}
    for key, value in kwargs.items():
        if value is None:
            continue
        option = known.get(key)
        if option is None:
            valid = ", ".join(sorted(known))
            raise ConfigError(f"{function}() got an unknown option {key!r}; valid: {valid}")
        if option.kind == "flag":
            if not isinstance(value, bool):
                raise ConfigError(f"{key}: a flag, takes True or False, got {value!r}")
            if value:
                args.append(f"--{option.flag}")
            continue
        if option.flag in _PLOTS and value is True:
            fd, path = tempfile.mkstemp(prefix="vramsim-", suffix=".png")
            os.close(fd)
            pngs[option.flag] = path
            value = path
        elif option.flag in _PLOTS and value is False:
            continue
        if option.kind == "positional":
            positional.append(_word(key, value))
        elif option.kind == "values":
            if key == "vary" and isinstance(value, dict):
                words = [_vary_spec(k, v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                words = [_word(key, v) for v in value]
            else:
                words = [_word(key, value)]
            args.extend(f"--{option.flag}={w}" for w in words)
        else:
            args.append(f"--{option.flag}={_word(key, value)}")
    if positional:
        args.append("--")
        args.extend(positional)
    return args, pngs


def _call(command: str, function: str, kwargs: Dict[str, Any]) -> Tuple[Any, str, Dict[str, bytes]]:
    kwargs = dict(kwargs)
    graph_file = None
    if isinstance(kwargs.get("model"), Model):
        # A captured module goes to the library as --graph FILE (the document, written once).
        if kwargs.get("graph") is not None:
            raise ConfigError(f"{function}() got both model=Model and graph=; give one")
        captured = kwargs.pop("model")
        graph_file = captured.save()
        kwargs["graph"] = graph_file
    args, pngs = _arguments(command, function, kwargs)
    try:
        try:
            document, text = _native.run(command, args)
        except ConfigError as e:
            if graph_file is None:
                raise
            # The temporary file means nothing to the caller: name the argument instead.
            raise ConfigError(str(e).replace(graph_file, f"model={captured.name!r}")) from None
        images = {}
        for flag, path in pngs.items():
            with open(path, "rb") as f:
                images[flag] = f.read()
    finally:
        if graph_file is not None:
            try:
                os.remove(graph_file)
            except OSError:
                pass
        for path in pngs.values():
            try:
                os.remove(path)
            except OSError:
                pass
    return _json.loads(document), text, images


def _size(n: Optional[float]) -> str:
    """Bytes as PyTorch's ``format_size`` writes them (binary units)."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


class Result:
    """A result: the command's ``--json`` document, its fields as attributes (``r.peak_reserved_bytes``),
    ``to_dict()`` for the document, ``table`` for the command line's text."""

    def __init__(self, data: Any, text: str = "", images: Optional[Dict[str, bytes]] = None):
        self._data = data
        #: The command line's table (or text) for this result.
        self.table = text
        self._images = images or {}

    def to_dict(self) -> Any:
        """The command line's ``--json`` document (a copy)."""
        return copy.deepcopy(self._data)

    def __getattr__(self, name: str) -> Any:
        data = self.__dict__.get("_data")
        if isinstance(data, dict) and name in data:
            return data[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __dir__(self) -> List[str]:
        keys = list(self._data) if isinstance(self._data, dict) else []
        return sorted(set(super().__dir__()) | set(keys))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._data == self._data  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    @property
    def png(self) -> Optional[bytes]:
        """The plot asked for with ``plot=True`` (else ``timeline=True``), as PNG bytes."""
        return self._images.get("plot") or self._images.get("timeline")

    def _repr_png_(self) -> Optional[bytes]:
        return self.png

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._summary()})"

    def _summary(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._data.items() if not isinstance(v, (dict, list)))


def _fit_text(d: Dict[str, Any]) -> str:
    device = d.get("device") or {}
    total = device.get("total_memory_bytes") or device.get("total_memory")
    on = f" of {_size(total)} on {device.get('name', '?')}" if total else ""
    verdict = "fits" if d.get("fits") else "OUT OF MEMORY"
    return f"peak device used {_size(d.get('peak_device_used_bytes'))}{on}: {verdict}"


class Prediction(Result):
    """What ``predict`` says: peaks (``peak_allocated_bytes``, ``peak_reserved_bytes``,
    ``peak_device_used_bytes``, ``peak_requested_bytes``), ``fits``, ``oom``, ``recipe``, ``breakdown``
    at the peak by category and module, ``attention``, ``warnings`` — every field of ``predict --json``."""

    def _summary(self) -> str:
        d = self._data
        r = d.get("recipe") or {}
        shape = f"batch {r.get('batch')}" + (f" × seq {r['seq']}" if r.get("seq") else "")
        return (
            f"{d.get('model')}, {shape}, {r.get('precision')}, checkpoint {r.get('checkpoint')}; "
            f"peak reserved {_size(d.get('peak_reserved_bytes'))}, {_fit_text(d)}"
        )


class Whatif(Result):
    """A what-if sweep: one row per configuration (a :class:`Prediction` with ``options``, the varied
    settings, ``effective_batch`` and ``step_time``; or with ``error`` when ``predict`` refused it),
    sorted as the command line sorts them (fitting ones by peak first)."""

    @property
    def rows(self) -> List[Prediction]:
        """The configurations, in the command line's order."""
        return [Prediction(row) for row in self._data]

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[Prediction]:
        return iter(self.rows)

    def __getitem__(self, i: int) -> Prediction:  # type: ignore[override]
        return Prediction(self._data[i])

    def _summary(self) -> str:
        fits = sum(1 for r in self._data if r.get("fits"))
        return f"{len(self._data)} configurations, {fits} fit"

    def records(self) -> List[Dict[str, Any]]:
        """One flat record per configuration: the varied options, then the headline figures."""
        out = []
        for row in self._data:
            rec: Dict[str, Any] = dict(row.get("options", {}))
            if "error" in row:
                rec["error"] = row["error"]
                out.append(rec)
                continue
            recipe = row.get("recipe") or {}
            step = row.get("step_time") or {}
            rec.update(
                model=row.get("model"),
                batch=recipe.get("batch"),
                seq=recipe.get("seq"),
                precision=recipe.get("precision"),
                checkpoint=recipe.get("checkpoint"),
                accum=recipe.get("accum"),
                fits=row.get("fits"),
                peak_allocated_bytes=row.get("peak_allocated_bytes"),
                peak_reserved_bytes=row.get("peak_reserved_bytes"),
                peak_device_used_bytes=row.get("peak_device_used_bytes"),
                peak_requested_bytes=row.get("peak_requested_bytes"),
                effective_batch=row.get("effective_batch"),
                step_ms=step.get("step_ms"),
                samples_per_s=step.get("samples_per_s"),
                error=None,
            )
            out.append(rec)
        return out

    def to_pandas(self):
        """The sweep as a ``pandas.DataFrame`` (one row per configuration; needs pandas)."""
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("Whatif.to_pandas() needs pandas: pip install pandas") from e
        return pd.DataFrame.from_records(self.records())


class MaxBatch(Result):
    """What ``max-batch`` found: ``max_batch`` (or ``max_seq``), the first size that does not fit
    (``first_failure``), every size ``tried``, the peaks at the answer and its ``command``."""

    def _summary(self) -> str:
        d = self._data
        key = d.get("searched", "batch")
        device = d.get("device") or {}
        return (
            f"{d.get('model')}: max {key} {d.get(f'max_{key}')} on {device.get('name')}, "
            f"peak device used {_size(d.get('peak_device_used_bytes'))}"
        )


class Recommendation(Result):
    """What ``recommend`` found: the ``recipes`` that reach ``global_batch``, fastest first."""

    def _summary(self) -> str:
        d = self._data
        best = (d.get("recipes") or [{}])[0]
        return (
            f"{d.get('model')}: {d.get('recipes_that_fit')} of {d.get('recipes_tried')} recipes reach "
            f"global batch {d.get('global_batch')}; fastest: {best.get('command', '?')}"
        )


class ReplayReport(Result):
    """What ``replay`` says of a trace or snapshot: peaks, ``stats`` (``memory_stats()`` keys),
    ``fits``, ``oom``, and for a snapshot how the replay compares with its history (``snapshot``)."""

    def _summary(self) -> str:
        d = self._data
        return f"{d.get('source')}: peak reserved {_size(d.get('peak_reserved_bytes'))}, {_fit_text(d)}"


class SnapshotCheck(Result):
    """``check-snapshot``'s report of one device: segment events matched, placements, final state and
    the first divergence."""


class Diagnosis(Result):
    """What ``diagnose`` says of a snapshot or trace: ``iterations``, ``growth_bytes_per_iteration``,
    ``leaks`` (sites and bytes), ``projected_oom_iteration``, ``oom`` and ``oom_cause`` (the shortfall
    split, ``decided_by``), and ``remedies`` (each with its ``setting``, ``avoids_oom`` and the replayed
    ``peaks``)."""

    def _summary(self) -> str:
        d = self._data
        cause = (d.get("oom_cause") or {}).get("decided_by")
        growth = d.get("growth_bytes_per_iteration")
        return (
            f"{d.get('source')}: growth {_size(growth) if growth is not None else 'unknown'} per iteration, "
            f"{'OOM decided by ' + cause if cause else 'no OOM'}"
        )


class ImportedDevice(Result):
    """One device of a snapshot imported as a trace: ``path``, ``events``, ``notes``."""


class Gpu(Result):
    """A GPU preset: ``name``, ``device``, ``total_memory_bytes``, ``compute_capability``, ``source``,
    and the CUDA ``context`` per CUDA version with its source."""

    def _summary(self) -> str:
        d = self._data
        return f"{d['name']}: {d['device']}, {_size(d['total_memory_bytes'])}"


class Explanation(Result):
    """What ``explain`` made of an out-of-memory message: ``framework``, ``device``, the figures in bytes
    (``requested_bytes``, ``capacity_bytes``, ``free_bytes``, ``pytorch_allocated_bytes``,
    ``pytorch_reserved_unallocated_bytes``, ``this_process_bytes``, ``processes``,
    ``non_pytorch_bytes``) with their rounding intervals in ``bounds``, the ``cause`` (``exceeds_device``,
    ``fragmentation``, ``capacity`` or ``undecided`` with ``possible_causes``) by ``cause_rule``,
    ``shortfall_bytes`` and the ``remedies``."""

    def _summary(self) -> str:
        d = self._data
        short = d.get("shortfall_bytes")
        extra = f", short by {_size(short)}" if short else ""
        return f"{d.get('framework')}: {d.get('cause')}, request {_size(d.get('requested_bytes'))}{extra}"


class Model:
    """A user's ``nn.Module`` captured by :func:`from_module`: pass it as ``model=`` to ``predict``,
    ``whatif`` and ``max_batch`` like a zoo model's name (the batch is a variable; every recipe option
    applies). ``document`` is the JSON graph (format ``vramsim-graph``, see ``models/README.md``)."""

    def __init__(self, document: Dict[str, Any], recorded: Optional[List[Dict[str, Any]]] = None):
        if not isinstance(document, dict):
            raise ConfigError(
                f"document: expected the graph document (a dict, format vramsim-graph), got "
                f"{type(document).__name__}"
            )
        #: The graph document.
        self.document = document
        #: The calls vramsim has no rule for, lowered from what the capture recorded of them (their
        #: outputs, the tensors autograd saved, gradients of the inputs' shapes): ``{"op", "module",
        #: "count"}`` each, in program order. Empty when every call has a rule.
        self.recorded = list(recorded or [])

    @property
    def name(self) -> str:
        """The model's name (the module's class name unless given)."""
        return str(self.document.get("name"))

    @property
    def ops(self) -> List[str]:
        """The captured calls, in program order."""
        return [op["op"] for op in self.document.get("ops", [])]

    def save(self, path: Any = None) -> str:
        """Writes the document to ``path`` (a temporary file when ``None``) and returns the path."""
        if path is None:
            fd, path = tempfile.mkstemp(prefix="vramsim-graph-", suffix=".json")
            os.close(fd)
        path = os.fspath(path)
        with open(path, "w") as f:
            _json.dump(self.document, f)
        return path

    def __repr__(self) -> str:
        n = len(self.document.get("params", []))
        rec = ""
        if self.recorded:
            names = ", ".join(f"{r['op']} × {r['count']}" for r in self.recorded)
            rec = f"; lowered from their recording (no rule for them): {names}"
        return (
            f"Model({self.name}: {len(self.ops)} calls, {n} parameters, example batch "
            f"{self.document.get('batch')}{rec})"
        )


def from_module(
    model: Any,
    example_inputs: Any,
    loss_fn: Any = None,
    targets: Any = None,
    name: Optional[str] = None,
    blocks: Any = None,
    dynamic_dims: Any = None,
    **unknown: Any,
) -> Model:
    """Captures your own ``nn.Module`` for lowering (not recording): every what-if applies to it.

    ``model`` must live on the meta device (``with torch.device("meta"): model = MyNet()``: no weights
    are materialised); ``example_inputs`` is a tensor or a list of tensors (meta) whose dim 0 is the
    batch, which becomes a variable. The step's loss is ``loss_fn(output, *targets)`` when ``loss_fn``
    is given; otherwise ``F.cross_entropy(output, labels)`` with int64 labels when the output is
    ``[B, C]`` floats (a classifier, as torchvision's reference training), else ``output.float().mean()``.
    ``blocks`` names the submodules ``checkpoint=`` wraps (default: the repeated non-leaf children of an
    ``nn.Sequential``/``nn.ModuleList``, such as ResNet blocks or transformer layers).

    transformers models: pass the inputs as a dict (``model(**inputs)``); with ``labels`` the step's loss
    is the one the model computes (``outputs.loss``), else ``outputs.logits`` is the output. Non-tensor
    entries (``use_cache=False``) are passed as they are. ``dynamic_dims`` makes the sequence length a
    variable: ``{"input_ids": {1: "seq"}, "labels": {1: "seq"}}`` (an input by keyword, or by position in
    inputs then targets); ``predict(model=m, seq=...)`` then sets it (default: the example's).

    The forward runs under a ``TorchFunctionMode``; each call (``F.linear``, ``F.conv2d``, ...) is mapped
    by the Rust models crate onto its op library. A call without a rule falls back on what the capture
    recorded of it (its outputs, views or new; the tensors autograd saved for it; its backward's
    allocations and frees): such calls are listed in ``Model.recorded``, in each prediction's
    ``warnings`` and ``recorded_calls``. Wrong argument types raise :class:`ConfigError` naming the
    argument. Example::

        with torch.device("meta"):
            net = torchvision.models.resnet18()
        m = vramsim.from_module(net, torch.empty(8, 3, 224, 224, device="meta"))
        vramsim.max_batch(model=m, gpu="rtx4090", precision="amp-bf16").max_batch
    """
    from . import _graph_capture

    if unknown:
        valid = "model, example_inputs, loss_fn, targets, name, blocks, dynamic_dims"
        raise ConfigError(f"from_module() got an unknown argument {next(iter(unknown))!r}; valid: {valid}")
    try:
        document = _graph_capture.capture(
            model,
            example_inputs,
            loss_fn=loss_fn,
            targets=targets,
            name=name,
            blocks=blocks,
            dynamic_dims=dynamic_dims,
            rules=_native.graph_rules(),
        )
    except _graph_capture.FromModuleError as e:
        raise ConfigError(str(e)) from None
    m = Model(document)
    # Parse it once now, so calls that cannot be lowered are reported here rather than at predict
    # time, and the calls lowered from their recording are known.
    path = m.save()
    try:
        result, _ = _native.run("predict", ["--graph", path, "--batch", str(document["batch"])])
    except ConfigError as e:
        raise ConfigError(str(e).replace(path, f"from_module({m.name})")) from None
    finally:
        os.remove(path)
    m.recorded = list(_json.loads(result).get("recorded_calls") or [])
    return m


def predict(**kwargs: Any) -> Prediction:
    """``vramsim predict``: a zoo model (``model=``) or a HuggingFace config.json (``hf_config=``)
    lowered to a training step (or inference) and replayed through the allocator model."""
    data, text, images = _call("predict", "predict", kwargs)
    return Prediction(data, text, images)


def whatif(vary: Any = None, **kwargs: Any) -> Whatif:
    """``vramsim whatif``: ``predict`` over a grid, ``vary={"batch": [8, 16], "precision": [...]}``
    (or a list of ``"KEY=V1,V2"`` strings), evaluated in parallel with the GIL released."""
    if vary is not None:
        kwargs["vary"] = vary
    data, text, images = _call("whatif", "whatif", kwargs)
    return Whatif(data, text, images)


def max_batch(**kwargs: Any) -> MaxBatch:
    """``vramsim max-batch``: the largest batch (``max_seq=True``: sequence) that fits."""
    data, text, images = _call("max-batch", "max_batch", kwargs)
    return MaxBatch(data, text, images)


def recommend(**kwargs: Any) -> Recommendation:
    """``vramsim recommend``: the recipes that reach ``global_batch``, fastest first."""
    data, text, images = _call("recommend", "recommend", kwargs)
    return Recommendation(data, text, images)


def replay(trace: Any = None, **kwargs: Any) -> ReplayReport:
    """``vramsim replay``: a trace (JSON or JSON Lines) or a PyTorch snapshot pickle, replayed."""
    if trace is not None:
        kwargs["trace"] = trace
    if kwargs.get("trace") is not None and not isinstance(kwargs["trace"], (str, os.PathLike)):
        raise ConfigError(f"trace: expected a path (str or os.PathLike), got {type(kwargs['trace']).__name__}")
    data, text, images = _call("replay", "replay", kwargs)
    return ReplayReport(data, text, images)


def check_snapshot(snapshot: Any = None, **kwargs: Any):
    """``vramsim check-snapshot``: replays a snapshot's history with its own settings and compares.
    One :class:`SnapshotCheck`, or a list of them when several devices are checked."""
    if snapshot is not None:
        kwargs["snapshot"] = snapshot
    data, text, _ = _call("check-snapshot", "check_snapshot", kwargs)
    if isinstance(data, list):
        return [SnapshotCheck(d) for d in data]
    return SnapshotCheck(data, text)


def diagnose(trace: Any = None, **kwargs: Any) -> Diagnosis:
    """``vramsim diagnose``: explains an OOM or a growth from a PyTorch snapshot (recorded with
    ``torch.cuda.memory._record_memory_history()``) or a trace: iterations, growth and leaking sites,
    what decided the OOM, and remedies verified by replay. A snapshot without history raises
    :class:`TraceError`."""
    if trace is not None:
        kwargs["trace"] = trace
    data, text, images = _call("diagnose", "diagnose", kwargs)
    return Diagnosis(data, text, images)


def import_snapshot(snapshot: Any = None, output: Any = None, **kwargs: Any) -> List[ImportedDevice]:
    """``vramsim import``: a snapshot's devices written as traces to ``output`` (one per device)."""
    if snapshot is not None:
        kwargs["snapshot"] = snapshot
    if output is not None:
        kwargs["output"] = output
    data, _, _ = _call("import", "import_snapshot", kwargs)
    return [ImportedDevice(d, "") for d in data]


def explain(exc_or_text: Any = None, **kwargs: Any) -> Explanation:
    """``vramsim explain``: reads an out-of-memory message — the text, or the exception object a
    ``try/except torch.OutOfMemoryError`` (or TensorFlow's ``ResourceExhaustedError``, JAX's
    ``XlaRuntimeError``) caught — and says what decided it and what would fix it. With ``model=`` (or
    ``hf_config=``) and the recipe, the remedies are replayed on the message's device."""
    if exc_or_text is None:
        raise ConfigError("explain() needs the message: an exception or its text")
    if isinstance(exc_or_text, BaseException):
        text = str(exc_or_text) or repr(exc_or_text)
        # TensorFlow's OpError keeps the text in .message
        text = getattr(exc_or_text, "message", None) or text
    elif isinstance(exc_or_text, (str, bytes)):
        text = exc_or_text.decode("utf-8", "replace") if isinstance(exc_or_text, bytes) else exc_or_text
    else:
        raise ConfigError(
            f"explain() takes an exception or its text, got {type(exc_or_text).__name__}"
        )
    kwargs["text"] = text
    data, text_out, _ = _call("explain", "explain", kwargs)
    return Explanation(data, text_out)


def gpus() -> List[Gpu]:
    """The GPU presets ``gpu=`` accepts, with their capacities, contexts and sources."""
    return [Gpu(g) for g in _json.loads(_native.gpus())]


class Recording:
    """A training step recorded by :func:`record`: the trace's ``meta`` and ``events``, ``summary()``
    (live requested bytes by phase and category), ``write(path)`` and ``replay(**options)``."""

    def __init__(self, capture: Any):
        self._capture = capture
        #: The trace header's metadata (tool, versions, recipe, parameters, capture time).
        self.meta: Dict[str, Any] = capture.meta
        #: The events (``alloc``, ``free``, ``phase``), in order.
        self.events: List[Dict[str, Any]] = capture.events

    def summary(self) -> Dict[str, Any]:
        """Peak requested bytes, its phase and categories, per-phase peaks, counts (no allocator)."""
        return self._capture.summary()

    def write(self, path: Any) -> None:
        """Writes the trace as JSON Lines (gzip-compressed for a name ending in ``.gz``)."""
        self._capture.write(os.fspath(path))

    def replay(self, **kwargs: Any) -> "ReplayReport":
        """Replays the recording through the allocator model (``replay``'s options: ``gpu``,
        ``alloc_conf``, ``capacity``, ...)."""
        fd, path = tempfile.mkstemp(prefix="vramsim-record-", suffix=".jsonl")
        os.close(fd)
        try:
            self.write(path)
            return replay(path, **kwargs)
        finally:
            os.remove(path)

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"Recording({len(self.events)} events, peak requested {_size(s['peak_requested_bytes'])} "
            f"in {s['peak_phase']})"
        )


def record(
    model_fn: Any,
    inputs_fn: Any,
    loss_fn: Any,
    optimizer_fn: Any,
    iterations: int = 2,
    **kwargs: Any,
) -> Recording:
    """Records a real PyTorch training step without a GPU (the capture tool,
    ``traces/python/vramsim_capture.py``, shipped in the package): the model is built on the ``meta``
    device (``device="cpu"``: fake CPU tensors, for ``amp="fp16"``/``"bf16"`` with CUDA's autocast policy)
    and every storage's allocation and free is recorded in program order. ``model_fn()`` builds the
    model, ``inputs_fn()`` one micro-batch, ``loss_fn(model, inputs)`` the loss, ``optimizer_fn(params)``
    the optimizer; ``accum``, ``device``, ``mimic_cuda``, ``amp``, ``sdpa``, ``recompute_sdpa`` and
    ``meta`` are the capture's own options. Needs torch. Replay the result with
    :meth:`Recording.replay`."""
    try:
        from ._capture import vramsim_capture
    except ImportError as e:  # pragma: no cover - the package ships it
        raise ImportError(f"vramsim.record: the capture tool is missing: {e}") from e
    if vramsim_capture.torch is None:
        raise ImportError("vramsim.record needs torch: pip install torch")
    for arg, value in (("model_fn", model_fn), ("inputs_fn", inputs_fn), ("loss_fn", loss_fn),
                       ("optimizer_fn", optimizer_fn)):
        if not callable(value):
            raise ConfigError(f"{arg}: expected a callable, got {type(value).__name__}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"iterations: expected a whole number from 1, got {iterations!r}")
    known = {"accum", "device", "mimic_cuda", "meta", "amp", "sdpa", "recompute_sdpa"}
    for key in kwargs:
        if key not in known:
            raise ConfigError(
                f"record() got an unknown option {key!r}; valid: {', '.join(sorted(known))}"
            )
    try:
        capture = vramsim_capture.capture(
            model_fn, inputs_fn, loss_fn, optimizer_fn, iterations, **kwargs
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return Recording(capture)


def _document() -> None:
    """Appends each function's keyword arguments (from the command line's definition) to its doc."""
    for function, command in [
        (predict, "predict"),
        (whatif, "whatif"),
        (max_batch, "max-batch"),
        (recommend, "recommend"),
        (replay, "replay"),
        (check_snapshot, "check-snapshot"),
        (import_snapshot, "import"),
        (explain, "explain"),
    ]:
        lines = ["", "Keyword arguments (the command line's options, same defaults):", ""]
        for o in options(command).values():
            default = "" if o.default is None else f" (default {o.default!r})"
            lines.append(f"    {o.name}{default}: {' '.join(o.help.split())}")
        if command in ("whatif", "recommend"):
            # what the command line's --help says after the options
            lines += [""] + ["    " + line for line in _native.step_time_model().splitlines()]
        function.__doc__ = (function.__doc__ or "") + "\n" + "\n".join(lines)


_document()
