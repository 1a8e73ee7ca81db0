"""The vramsim Python package: same answers as the command line, typed results, Python errors.

The comparisons with the command line run the `vramsim` binary (``$VRAMSIM_BIN``, else
``target/{debug,release}/vramsim`` of this checkout) and are skipped, with the reason, without it.
"""

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import vramsim

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cs336-medium-train-step.jsonl"


def _binary():
    candidates = [os.environ.get("VRAMSIM_BIN")]
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    candidates += [target / "debug" / "vramsim", target / "release" / "vramsim"]
    for c in candidates:
        if c and Path(c).is_file():
            return str(c)
    return None


def cli(*args):
    """The command line's --json document for ``args`` (skips the test without the binary)."""
    binary = _binary()
    if binary is None:
        pytest.skip("no vramsim binary (cargo build -p vramsim-api, or set VRAMSIM_BIN)")
    out = subprocess.run([binary, *args], cwd=ROOT, capture_output=True, text=True)
    return out


def without_timing(doc):
    """A document without its wall-clock timings (the only fields two runs may disagree on)."""
    if isinstance(doc, list):
        return [without_timing(d) for d in doc]
    doc = dict(doc)
    doc.pop("timing", None)
    doc.pop("seconds", None)
    return doc


def test_predict_is_the_command_lines_json():
    p = vramsim.predict(model="gpt2", batch=2, seq=128, precision="amp-bf16", gpu="rtx4090")
    out = cli("predict", "--model", "gpt2", "--batch", "2", "--seq", "128",
              "--precision", "amp-bf16", "--gpu", "rtx4090", "--json")
    assert out.returncode == 0, out.stderr
    assert without_timing(p.to_dict()) == without_timing(json.loads(out.stdout))


def test_whatif_is_the_command_lines_json():
    w = vramsim.whatif(model="mlp", batch=4, vary={"precision": ["fp32", "bf16"], "keep_outputs": [False, True]})
    out = cli("whatif", "--model", "mlp", "--batch", "4", "--vary", "precision=fp32,bf16",
              "--vary", "keep-outputs=false,true", "--json")
    assert out.returncode == 0, out.stderr
    assert without_timing(w.to_dict()) == without_timing(json.loads(out.stdout))
    assert len(w) == 4
    assert {r.options["precision"] for r in w} == {"fp32", "bf16"}


def test_defaults_are_the_command_lines():
    opts = vramsim.options("predict")
    assert opts["precision"].default == "fp32"
    assert opts["optimizer"].default == "adamw"
    assert opts["accum"].default == "1"
    assert opts["iterations"].default == "2"
    assert opts["keep_outputs"].kind == "flag"
    assert "json" not in opts  # output format: a result always holds the document
    p = vramsim.predict(model="mlp", batch=8)
    assert p.recipe["precision"] == "fp32"
    assert p.recipe["optimizer"] == "adamw"
    assert p.recipe["accum"] == 1 and p.recipe["iterations"] == 2
    assert "precision" in vramsim.predict.__doc__


def test_step_time_model_is_documented_as_the_command_line_does():
    # whatif and recommend estimate step times; their --help describes the model after the options, and
    # help(vramsim.whatif) / help(vramsim.recommend) must say the same (the notebooks point there)
    for function, command in [(vramsim.whatif, "whatif"), (vramsim.recommend, "recommend")]:
        doc = " ".join(function.__doc__.split())
        assert "Step time: a FLOP/bandwidth (roofline) estimate" in doc
        section = doc[doc.index("Step time:"):]
        out = cli(command, "--help")
        assert out.returncode == 0, out.stderr
        assert section in " ".join(out.stdout.split())
    assert "Step time:" not in vramsim.predict.__doc__


def test_results_are_typed_and_readable():
    p = vramsim.predict(model="mlp", batch=8, gpu="rtx4090")
    assert isinstance(p, vramsim.Prediction)
    assert p.fits is True
    assert p.peak_reserved_bytes >= p.peak_allocated_bytes > 0
    assert p["model"] == "mlp"
    text = repr(p)
    assert text.startswith("Prediction(mlp, batch 8") and "fits" in text
    assert "peak" in p.table
    with pytest.raises(AttributeError):
        p.no_such_field
    d = p.to_dict()
    d["model"] = "changed"
    assert p.model == "mlp"  # to_dict is a copy


def test_out_of_memory_is_a_result_not_an_error():
    p = vramsim.predict(model="gpt2", batch=64, seq=1024, capacity="2GiB")
    assert p.fits is False
    assert "CUDA out of memory" in p.oom["message"]
    assert "OUT OF MEMORY" in repr(p)


def test_plot_as_png_bytes():
    p = vramsim.predict(model="mlp", batch=4, plot=True)
    assert p.png.startswith(b"\x89PNG\r\n\x1a\n")
    assert p._repr_png_() == p.png
    assert vramsim.predict(model="mlp", batch=4).png is None


def test_plot_to_a_file(tmp_path):
    path = tmp_path / "step.svg"
    vramsim.predict(model="mlp", batch=4, plot=str(path))
    assert path.read_text().lstrip().startswith("<svg")


def test_whatif_to_pandas():
    pd = pytest.importorskip("pandas")
    w = vramsim.whatif(model="mlp", vary={"batch": [2, 4, 8]})
    df = w.to_pandas()
    assert isinstance(df, pd.DataFrame)
    assert sorted(df["batch"].tolist()) == [2, 4, 8]
    assert df["fits"].all()


def test_whatif_records_without_pandas():
    w = vramsim.whatif(model="mlp", vary=["batch=2,4"])
    recs = w.records()
    assert [r["options"] if "options" in r else r["batch"] for r in recs] == [2, 4]
    assert repr(w) == "Whatif(2 configurations, 2 fit)"


def test_max_batch_and_recommend_are_the_command_lines():
    m = vramsim.max_batch(model="mlp", capacity="1GiB", limit=4096)
    out = cli("max-batch", "--model", "mlp", "--capacity", "1GiB", "--limit", "4096", "--json")
    assert out.returncode == 0, out.stderr
    assert without_timing(m.to_dict()) == without_timing(json.loads(out.stdout))
    assert m.max_batch >= 1
    r = vramsim.recommend(model="mlp", global_batch=8, capacity="1GiB", top=3)
    out = cli("recommend", "--model", "mlp", "--global-batch", "8", "--capacity", "1GiB",
              "--top", "3", "--json")
    assert out.returncode == 0, out.stderr
    want = json.loads(out.stdout)
    got = r.to_dict()
    strip = lambda d: [without_timing(x) for x in d["recipes"]]  # noqa: E731
    assert strip(got) == strip(want)
    assert got["recipes_that_fit"] == want["recipes_that_fit"]
    assert "global batch 8" in repr(r)


def test_replay_snapshot_check_and_import(tmp_path):
    pickle = tmp_path / "example.pickle"
    r = vramsim.replay(EXAMPLE, gpu="rtx4090", snapshot_out=pickle, summary=True)
    out = cli("replay", str(EXAMPLE), "--gpu", "rtx4090", "--summary", "--json")
    assert out.returncode == 0, out.stderr
    assert r.to_dict() == json.loads(out.stdout)
    assert isinstance(r, vramsim.ReplayReport) and r.fits
    c = vramsim.check_snapshot(pickle)
    assert isinstance(c, vramsim.SnapshotCheck)
    assert c.to_dict()["first_divergence"] is None
    imported = vramsim.import_snapshot(pickle, output=tmp_path / "trace.jsonl")
    assert len(imported) == 1 and Path(imported[0].path).is_file()
    again = vramsim.replay(imported[0].path)
    assert again.peak_reserved_bytes == r.peak_reserved_bytes


NESTA = ROOT / "testdata" / "snapshots" / "Nesta-gitU__discrete_diffusion__memory_snapshot.json__1ab3368e.pickle.gz"


def test_diagnose_is_the_command_lines_json(tmp_path):
    assert NESTA.is_file(), f"{NESTA} is missing: the repository's test data is not there"
    d = vramsim.diagnose(NESTA)
    out = cli("diagnose", str(NESTA), "--json")
    assert out.returncode == 0, out.stderr
    assert d.to_dict() == json.loads(out.stdout)
    assert isinstance(d, vramsim.Diagnosis)
    # the recorded OOM: 384 MiB requested on top of live tensors that fill the device
    assert d.oom_cause["requested_bytes"] == 384 * 2**20
    assert d.oom_cause["decided_by"] == "live_tensors"
    assert all(r["avoids_oom"] is False for r in d.remedies)
    assert "OOM decided by live_tensors" in repr(d)
    # tf-bfc options reach the library too
    t = vramsim.diagnose(EXAMPLE, allocator="tf-bfc", allow_growth=True, gpu="rtx4090")
    assert t.allocator == "tf-bfc"
    assert [r["setting"] for r in t.remedies] == ["TF_GPU_ALLOCATOR=cuda_malloc_async"]


def test_diagnose_without_history_is_a_trace_error(tmp_path):
    import gzip
    import pickle

    snap = pickle.load(gzip.open(NESTA, "rb"))
    snap["device_traces"] = [[] for _ in snap["device_traces"]]
    path = tmp_path / "no_history.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    with pytest.raises(vramsim.TraceError, match="_record_memory_history"):
        vramsim.diagnose(path)


def test_gpus():
    presets = vramsim.gpus()
    names = [g.name for g in presets]
    assert "rtx4090" in names
    [default] = [g for g in presets if g.default]
    assert default.name == "h100-80gb"
    rtx = presets[names.index("rtx4090")]
    assert rtx.total_memory_bytes > 20 * 2**30
    assert rtx.compute_capability == [8, 9]


def test_errors_are_python_exceptions_with_the_command_lines_messages():
    with pytest.raises(vramsim.ConfigError) as e:
        vramsim.predict(model="gpt2", batch=1, precision="fp64")
    out = cli("predict", "--model", "gpt2", "--batch", "1", "--precision", "fp64")
    assert out.returncode == 2
    assert str(e.value) in out.stderr
    with pytest.raises(vramsim.ConfigError, match="no-such-model"):
        vramsim.predict(model="no-such-model", batch=1)
    with pytest.raises(vramsim.ConfigError, match="unknown option 'batchsize'"):
        vramsim.predict(model="gpt2", batchsize=1)
    with pytest.raises(vramsim.ConfigError, match="batch"):
        vramsim.predict(model="gpt2", batch=[1, 2])
    with pytest.raises(vramsim.ConfigError, match="inference: a flag"):
        vramsim.predict(model="gpt2", batch=1, inference="yes")
    with pytest.raises(vramsim.ConfigError, match="batch"):
        vramsim.predict(model="gpt2", batch=0)
    assert issubclass(vramsim.ConfigError, vramsim.VramsimError)


def test_bad_traces_raise_trace_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "alloc", "id": 1}\n')
    with pytest.raises(vramsim.TraceError):
        vramsim.replay(bad)
    with pytest.raises(vramsim.TraceError, match="no-such-trace.jsonl"):
        vramsim.replay(tmp_path / "no-such-trace.jsonl")
    with pytest.raises(vramsim.TraceError):
        vramsim.check_snapshot(bad)


def test_the_gil_is_released_while_computing():
    # A Python thread ticks every millisecond while the main thread runs a sweep: with the GIL held
    # during the sweep it could not tick until the call returned.
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.01)
    start = time.perf_counter()
    vramsim.whatif(model="gpt2-medium", seq=1024, vary={"batch": list(range(1, 65))})
    end = time.perf_counter()
    stop.set()
    t.join()
    during = [x for x in ticks if start < x < end]
    assert end - start > 0.05, "the sweep is too short to tell"
    assert len(during) >= 10, (len(during), end - start)


def test_record_a_step_and_replay_it():
    torch = pytest.importorskip("torch")

    dims = (1024, 4096, 4096, 4096, 1000)

    def model_fn():
        layers = []
        for i in range(len(dims) - 1):
            layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(torch.nn.ReLU())
        return torch.nn.Sequential(*layers)

    def inputs_fn():
        return torch.randn(8, 1024), torch.randint(0, 1000, (8,))

    def loss_fn(model, inputs):
        x, y = inputs
        return torch.nn.functional.cross_entropy(model(x), y)

    rec = vramsim.record(model_fn, inputs_fn, loss_fn,
                         lambda p: torch.optim.AdamW(p, foreach=True), iterations=2)
    s = rec.summary()
    # the weights and biases of Linear(1024,4096), 2 × Linear(4096,4096), Linear(4096,1000), fp32
    params = (1024 * 4096 + 4096) + 2 * (4096 * 4096 + 4096) + (4096 * 1000 + 1000)
    assert s["by_category_at_peak"]["parameter"] == 4 * params
    assert "events" in repr(rec)
    r = rec.replay(gpu="rtx4090")
    assert isinstance(r, vramsim.ReplayReport)
    assert r.peak_requested_bytes == s["peak_requested_bytes"]
    with pytest.raises(vramsim.ConfigError, match="unknown option 'batch'"):
        vramsim.record(model_fn, inputs_fn, loss_fn, torch.optim.SGD, batch=2)


# ---- explain ---------------------------------------------------------------------------------------

OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 has a total capacity of 31.47 GiB of which "
    "12.73 GiB is free. Including non-PyTorch memory, this process has 18.73 GiB memory in use. Of the "
    "allocated memory 9.08 GiB is allocated by PyTorch, and 9.35 GiB is reserved by PyTorch but "
    "unallocated."
)  # https://github.com/murong-xu/CADS/issues/4


def test_explain_reads_the_exception_a_try_except_caught():
    torch = pytest.importorskip("torch")
    try:
        raise torch.OutOfMemoryError(OOM_TEXT)
    except torch.OutOfMemoryError as e:
        x = vramsim.explain(e)
    assert isinstance(x, vramsim.Explanation)
    assert x.cause == "capacity"
    assert x.framework == "pytorch"
    # 22.78 - 12.73 - 9.35 = 0.70 GiB at face value
    assert abs(x.shortfall_bytes / 2**30 - 0.70) < 1e-6
    assert x.bounds["requested_bytes"]["printed"] == "22.78 GiB"
    assert any(r["kind"] == "shed_bytes" for r in x.remedies)


def test_explain_takes_text_and_matches_the_command_line():
    x = vramsim.explain(OOM_TEXT)
    out = cli("explain", OOM_TEXT, "--json")
    assert out.returncode == 0, out.stderr
    assert x.to_dict() == json.loads(out.stdout)


def test_explain_bad_input_is_a_config_error():
    with pytest.raises(vramsim.ConfigError, match="no out-of-memory message found"):
        vramsim.explain("ValueError: shapes do not match")
    with pytest.raises(vramsim.ConfigError, match="reserved by PyTorch but unallocated"):
        vramsim.explain(
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.18 GiB "
            "of which 3.69 MiB is free."
        )
    with pytest.raises(vramsim.ConfigError):
        vramsim.explain(42)
