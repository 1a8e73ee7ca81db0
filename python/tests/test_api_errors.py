"""Bad arguments to the package raise a Python exception (``ConfigError``, ``TraceError``) whose message names
the argument, never a crash or a bare ``TypeError`` from inside: wrong types, unknown options, values the
command line refuses, and what ``from_module`` cannot run. Torch-dependent cases skip without torch."""

import pytest

import vramsim


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda: vramsim.predict(model="resnet18", batch=[1]), ["batch"]),
        (lambda: vramsim.predict(model="resnet18", batch="abc"), ["--batch"]),
        (lambda: vramsim.predict(model="resnet18", batch=-3), ["--batch"]),
        (lambda: vramsim.predict(model="resnet18", batch=2, precision="fp8"), ["--precision", "fp32"]),
        (lambda: vramsim.predict(model="resnet18", batch=2, bogus=1), ["bogus", "valid"]),
        (lambda: vramsim.predict(model=object(), batch=2), ["model"]),
        (lambda: vramsim.whatif(model="resnet18", batch=2, vary={3: [1]}), ["vary"]),
        (lambda: vramsim.whatif(model="resnet18", batch=2, vary={"nope": [1]}), ["nope"]),
        (lambda: vramsim.max_batch(model="resnet18", gpu="rtx9999"), ["rtx9999", "a100-40gb"]),
        (lambda: vramsim.replay(3), ["trace"]),
        (lambda: vramsim.Model(3), ["document"]),
        (lambda: vramsim.record(3, 3, 3, 3), ["model_fn"]),
        (lambda: vramsim.record(print, print, print, print, iterations=0), ["iterations"]),
        (lambda: vramsim.record(print, print, print, print, bogus=1), ["bogus", "valid"]),
    ],
)
def test_wrong_arguments_name_themselves(call, words):
    with pytest.raises(vramsim.ConfigError) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_bad_graph_document_names_the_argument_not_a_temporary_file():
    with pytest.raises(vramsim.ConfigError) as e:
        vramsim.predict(model=vramsim.Model({"format": "x", "name": "net"}), batch=2)
    assert "model='net'" in str(e.value) and "vramsim-graph" in str(e.value)
    assert "/tmp" not in str(e.value)


def test_from_module_errors_name_the_argument():
    torch = pytest.importorskip("torch", reason="from_module needs torch (pip install torch)")
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.empty(2, 4, device="meta")
    cases = [
        (dict(model="resnet18", example_inputs=x), "model:"),
        (dict(model=net, example_inputs=3), "example_inputs:"),
        # the forward fails on these shapes: the exception says which argument and why
        (dict(model=net, example_inputs=torch.empty(2, 5, device="meta")), "example_inputs: model(*example_inputs) raised RuntimeError"),
        (dict(model=net, example_inputs=x, loss_fn="mse"), "loss_fn:"),
        (dict(model=net, example_inputs=x, loss_fn=lambda o: 1 / 0), "loss_fn: loss_fn(output, *targets) raised ZeroDivisionError"),
        (dict(model=net, example_inputs=x, loss_fn=lambda o: o), "loss_fn: must return a scalar"),
        (dict(model=net, example_inputs=x, targets=3), "targets:"),
        (dict(model=net, example_inputs=x, name=3), "name:"),
        (dict(model=net, example_inputs=x, blocks="0"), "blocks:"),
        (dict(model=net, example_inputs=x, bogus=1), "unknown argument 'bogus'"),
        (dict(model=torch.nn.LSTM(4, 4).to("meta"), example_inputs=torch.empty(2, 3, 4, device="meta")), "returned tuple"),
    ]
    for kwargs, words in cases:
        with pytest.raises(vramsim.ConfigError) as e:
            vramsim.from_module(**kwargs)
        assert words in str(e.value), (kwargs, str(e.value))
