"""Run the capture zoo's training steps on a real CUDA GPU and record what PyTorch's allocator did.

The reference captures (``traces/python/vramsim_capture.py``) record a step on the ``meta`` device or on
fake CPU tensors; this script runs the *same* step (the zoo's model, inputs, loss and optimizer, built by
``vramsim_capture.zoo``) for real on a GPU, so that ``vramsim predict`` can be compared with the hardware:
the caching allocator's peaks (``max_memory_allocated``/``max_memory_reserved``), per phase, the device
memory outside the allocator (CUDA context, cuBLAS/cuDNN handles), the SDPA backend PyTorch chose, and the
memory snapshot (history recorded from before ``model.to("cuda")``) for ``vramsim check-snapshot``.

Usage::

    python validate/python/train_step_gpu.py run-all --out DIR          # on the GPU machine
    python validate/python/train_step_gpu.py one RECIPE_JSON --out DIR  # one recipe (a process each)
    python validate/python/train_step_gpu.py compare DIR [--vramsim target/release/vramsim] [--gpu h100]

How a step runs (what the capture models):

* the model is built on the CPU (real initialisation) and moved with ``model.to("cuda")``, as a user does;
* each micro-batch's inputs are made on the GPU (``inputs_fn`` under ``torch.device("cuda")``);
* ``amp-*`` recipes run the forward and the loss under ``torch.autocast("cuda")``; ``amp-fp16`` uses a real
  ``GradScaler("cuda", init_scale=2**10)`` and ``scaler.step``: the capture assumes no step is skipped, and the
  recorded ``skipped_steps`` says whether one was (a smaller initial scale than the default 2**16 keeps a
  randomly initialised model's first steps finite; the scale changes no allocation);
* ``sdpa-<backend>`` recipes pin the backend with ``torch.nn.attention.sdpa_kernel``; ``sdpa`` (no backend)
  lets PyTorch choose, and the choice (``torch._fused_sdp_choice`` on the step's q/k/v shape) is recorded;
* phases are ``setup`` (``model.to``), ``forward``, ``backward``, ``optimizer``, ``zero_grad``;
  ``reset_peak_memory_stats`` at each phase's start gives each phase's own peaks.

Every recipe runs in a fresh process, so no cached block or library workspace of an earlier one stays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

#: The recipes ``run-all`` measures: the capture zoo's models under the precisions, checkpointing,
#: accumulation and attention choices users run. (model, batch, seq, dtype, optimizer, checkpoint, accum,
#: attention)
RECIPES = [
    ("gpt2", 2, 128, "fp32", "adamw", "none", 1, "eager"),
    ("gpt2", 8, 1024, "bf16", "adamw", "none", 1, "eager"),
    ("gpt2", 2, 128, "fp32", "adamw", "full", 1, "eager"),
    ("gpt2", 2, 128, "fp32", "adamw", "none", 2, "eager"),
    ("gpt2", 2, 128, "fp32", "sgd", "none", 1, "eager"),
    ("gpt2", 2, 128, "amp-fp16", "adamw", "none", 1, "eager"),
    ("gpt2", 2, 128, "amp-bf16", "adamw", "none", 1, "eager"),
    ("gpt2", 4, 1024, "fp32", "adamw", "none", 1, "sdpa"),
    ("gpt2", 4, 1024, "bf16", "adamw", "none", 1, "sdpa"),
    ("gpt2", 4, 1024, "amp-bf16", "adamw", "none", 1, "sdpa"),
    ("gpt2", 4, 1024, "amp-fp16", "adamw", "full", 1, "sdpa"),
    ("gpt2", 4, 1024, "bf16", "adamw", "none", 1, "sdpa-flash"),
    ("gpt2", 4, 1024, "bf16", "adamw", "none", 1, "sdpa-mem-efficient"),
    ("bert-base", 16, 512, "fp32", "adamw", "none", 1, "eager"),
    ("bert-base", 16, 512, "bf16", "adamw", "none", 1, "eager"),
    ("bert-base", 8, 512, "amp-bf16", "adamw", "none", 4, "sdpa"),
    ("tinyllama-1.1b", 2, 512, "bf16", "adamw", "none", 1, "sdpa"),
    ("tinyllama-1.1b", 2, 1024, "amp-bf16", "adamw", "full", 1, "sdpa"),
    ("resnet18", 32, 128, "fp32", "sgd-momentum", "none", 1, "eager"),
    ("resnet18", 32, 128, "amp-fp16", "sgd-momentum", "none", 1, "eager"),
    ("mlp", 64, 128, "fp32", "adamw", "none", 1, "eager"),
    # the largest batch `vramsim max-batch` finds on an H100 80GB; batch 26 runs out of memory, and its
    # message is kept next to the measurements (gpt2__b26s1024__fp32-adamw.oom.txt)
    ("gpt2", 25, 1024, "fp32", "adamw", "none", 1, "eager"),
]
FIELDS = ("model", "batch", "seq", "dtype", "optimizer", "checkpoint", "accum", "attention")
#: LoRA fine-tuning (PEFT's ``get_peft_model`` on the zoo model; ``lora`` as ``vramsim predict --lora`` takes it).
LORA_RECIPES = [
    ("tinyllama-1.1b", 4, 512, "bf16", "adamw", "none", 1, "sdpa", "r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj"),
    ("tinyllama-1.1b", 2, 1024, "bf16", "adamw", "none", 1, "sdpa", "r=8,alpha=16,dropout=0.1,targets=all-linear"),
    ("tinyllama-1.1b", 4, 512, "amp-bf16", "adamw", "none", 1, "sdpa", "r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj"),
]


def all_recipes() -> list[dict[str, Any]]:
    """Every recipe ``run-all`` measures, as dicts."""
    return ([dict(zip(FIELDS, row)) for row in RECIPES]
            + [dict(zip(FIELDS + ("lora",), row)) for row in LORA_RECIPES])


def recipe_name(r: dict[str, Any]) -> str:
    """A file-name-safe name of a recipe."""
    s = f"{r['model']}__b{r['batch']}s{r['seq']}__{r['dtype']}-{r['optimizer']}"
    if r["checkpoint"] != "none":
        s += f"-ckpt{r['checkpoint']}"
    if r["accum"] != 1:
        s += f"-accum{r['accum']}"
    if r["attention"] != "eager":
        s += f"-{r['attention']}"
    if r.get("lora"):
        spec = dict(kv.split("=", 1) for kv in r["lora"].split(",") if "=" in kv)
        s += f"-lora{spec.get('r', '8')}" + ("all" if spec.get("targets") == "all-linear" else "")
    if r.get("alloc_conf"):
        s += "__" + r["alloc_conf"].replace(":", "-").replace(",", "_").replace("True", "true")
    return s


# --------------------------------------------------------------------------------------------------
# On the GPU
# --------------------------------------------------------------------------------------------------

def run_one(r: dict[str, Any], out_dir: str, iterations: int = 2) -> dict[str, Any]:
    """Run one recipe on ``cuda:0`` and write ``<name>.json`` (and ``<name>.snapshot.pickle``)."""
    import pickle

    import torch
    import vramsim_capture as vc

    name = recipe_name(r)
    free0, total = torch.cuda.mem_get_info()  # creates the primary context
    attention = r["attention"]
    # The capture's Recipe knows eager and sdpa-<backend>; "sdpa" (PyTorch's own choice) is HF's sdpa with
    # nothing pinned.
    cap_attention = "sdpa-math" if attention == "sdpa" else attention
    recipe = vc.Recipe(model=r["model"], batch=r["batch"], seq=r["seq"], dtype=r["dtype"],
                       optimizer=r["optimizer"], checkpoint=r["checkpoint"], accum=r["accum"],
                       iterations=iterations, attention=cap_attention)
    model_fn, inputs_fn, loss_fn, optimizer_fn = vc.zoo(recipe)
    amp = recipe.amp()
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp) if amp else None

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_fn()
        if r.get("lora"):
            model = peft_model(model, r["lora"])
    model.train()

    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=2_000_000)
    phases: list[dict[str, Any]] = []

    def phase(label: str, it: int) -> None:
        torch.cuda.synchronize()
        if phases:
            phases[-1]["peak_allocated"] = torch.cuda.max_memory_allocated()
            phases[-1]["peak_reserved"] = torch.cuda.max_memory_reserved()
            phases[-1]["allocated_at_end"] = torch.cuda.memory_allocated()
            phases[-1]["reserved_at_end"] = torch.cuda.memory_reserved()
        if label:
            torch.cuda.reset_peak_memory_stats()
            phases.append({"phase": label, "iteration": it})

    phase("setup", 0)
    model.to("cuda")
    optimizer = optimizer_fn(model.parameters())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10) if amp == "fp16" else None
    backend = sdpa_context(attention)
    skipped = 0
    t0 = time.perf_counter()
    with backend:
        for it in range(iterations):
            for _micro in range(r["accum"]):
                phase("forward", it)
                with torch.device("cuda"):
                    inputs = inputs_fn()
                with (torch.autocast("cuda", dtype=amp_dtype) if amp else contextlib.nullcontext()):
                    loss = loss_fn(model, inputs)
                if r["accum"] > 1:
                    loss = loss / r["accum"]
                phase("backward", it)
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                del loss, inputs
            phase("optimizer", it)
            if scaler is not None:
                before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                skipped += int(scaler.get_scale() < before)
            else:
                optimizer.step()
            phase("zero_grad", it)
            optimizer.zero_grad(set_to_none=True)
        phase("", iterations)
    seconds = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    snap_path = os.path.join(out_dir, name + ".snapshot.pickle")
    with open(snap_path, "wb") as f:
        pickle.dump(snapshot, f)

    props = torch.cuda.get_device_properties(0)
    result = {
        "recipe": r,
        "name": name,
        "iterations": iterations,
        "device": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "total_memory": total,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), **vc.versions()},
        "context_bytes": total - free0,
        "device_used_end": total - free1,
        "reserved_end": torch.cuda.memory_reserved(),
        "outside_allocator_end": (total - free1) - torch.cuda.memory_reserved(),
        "peak_allocated": max(p["peak_allocated"] for p in phases),
        "peak_reserved": max(p["peak_reserved"] for p in phases),
        "stats": {k: v for k, v in stats.items()
                  if k.endswith(".all.peak") or k.endswith(".all.current") or "." not in k
                  or k.startswith("num_")},
        "phases": phases,
        "sdpa_choice": sdpa_choice(r, amp_dtype),
        "skipped_steps": skipped,
        "step_seconds": round(seconds, 3),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def peft_model(model: Any, spec: str) -> Any:
    """``peft.get_peft_model`` with the LoRA of a ``--lora`` spec (``r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj``;
    PEFT's defaults otherwise: r 8, alpha 8, dropout 0)."""
    import peft

    opts: dict[str, str] = {}
    key = None
    for part in spec.split(","):
        if "=" in part:
            key, value = part.split("=", 1)
            opts[key] = value
        elif key == "targets":  # targets=q_proj,v_proj: the list goes on
            opts[key] += "," + part
    targets = opts.get("targets", "q_proj,v_proj")
    config = peft.LoraConfig(r=int(opts.get("r", 8)), lora_alpha=int(opts.get("alpha", 8)),
                             lora_dropout=float(opts.get("dropout", 0.0)),
                             target_modules="all-linear" if targets == "all-linear" else targets.split(","))
    return peft.get_peft_model(model, config)


def sdpa_context(attention: str) -> Any:
    """``sdpa_kernel`` pinning ``sdpa-<backend>``; nothing for eager and for PyTorch's own choice."""
    if not attention.startswith("sdpa-"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "mem-efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}[attention[5:]])


def sdpa_choice(r: dict[str, Any], amp_dtype: Any) -> str | None:
    """The backend ``at::_fused_sdp_choice`` picks for the recipe's attention call (q/k/v that require grad,
    no mask, causal for the decoder models), or None for eager attention and non-transformers."""
    import torch

    if r["attention"] == "eager" or r["model"] not in ("gpt2", "bert-base", "tinyllama-1.1b"):
        return None
    heads, kv_heads, dim = {"gpt2": (12, 12, 64), "bert-base": (12, 12, 64),
                            "tinyllama-1.1b": (32, 4, 64)}[r["model"]]
    dtype = amp_dtype or {"fp32": torch.float32, "bf16": torch.bfloat16}.get(r["dtype"], torch.float32)
    q = torch.empty(r["batch"], heads, r["seq"], dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.empty(r["batch"], heads, r["seq"], dim, device="cuda", dtype=dtype, requires_grad=True)
    # HF passes the config's attention dropout in training (GPT-2's attn_pdrop, BERT's
    # attention_probs_dropout_prob: 0.1; Llama's attention_dropout: 0.0); only BERT is not causal.
    dropout = 0.0 if r["model"] == "tinyllama-1.1b" else 0.1
    with sdpa_context(r["attention"]):
        choice = torch._fused_sdp_choice(q, k, k, None, dropout, r["model"] != "bert-base")
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(choice).name
    except Exception:  # noqa: BLE001 - an enum this script does not know: the number
        return str(choice)


def run_all(out_dir: str, only: str | None, alloc_conf: str = "") -> int:
    """Each recipe in a process of its own (with ``PYTORCH_CUDA_ALLOC_CONF=alloc_conf``, recorded in the
    result and appended to its name); prints a line per recipe."""
    os.makedirs(out_dir, exist_ok=True)
    failed = 0
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc_conf)
    for r in all_recipes():
        if alloc_conf:
            r["alloc_conf"] = alloc_conf
        if only and not any(o in recipe_name(r) for o in only.split(",")):
            continue
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "one", json.dumps(r), "--out", out_dir],
                              capture_output=True, text=True, env=env)
        dt = time.perf_counter() - t0
        if proc.returncode != 0:
            failed += 1
            print(f"FAILED {recipe_name(r)} ({dt:.1f} s)\n{proc.stderr[-3000:]}", flush=True)
            with open(os.path.join(out_dir, recipe_name(r) + ".error.txt"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{res['name']:<58} alloc {res['peak_allocated']:>14,} reserved {res['peak_reserved']:>14,} "
              f"outside {res['outside_allocator_end']:>12,} sdpa {res['sdpa_choice']} skipped "
              f"{res['skipped_steps']} ({dt:.1f} s)", flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# Here: compare with vramsim
# --------------------------------------------------------------------------------------------------

def predict_args(res: dict[str, Any]) -> list[str]:
    """``vramsim predict`` options for the recipe a result ran."""
    r = res["recipe"]
    args = ["predict", "--model", r["model"], "--batch", str(r["batch"]), "--precision", r["dtype"],
            "--optimizer", r["optimizer"], "--checkpoint", r["checkpoint"], "--accum", str(r["accum"]),
            "--iterations", str(res["iterations"]),
            "--context", str(res["context_bytes"])]
    major_minor = tuple(int(x) for x in res["versions"]["torch"].split("+")[0].split(".")[:2])
    if r.get("alloc_conf"):
        args += ["--alloc-conf", r["alloc_conf"]]
    if r.get("lora"):
        args += ["--lora", r["lora"]]
    if major_minor < (2, 15):
        # PyTorch <= 2.14 keeps one cuBLAS workspace per (handle, stream) (CublasHandlePool.cpp)
        args += ["--cublas-workspace-cache"]
    if r["model"] not in ("mlp", "resnet18"):
        args += ["--seq", str(r["seq"]), "--use-cache", "false"]
        args += ["--attention", "auto" if r["attention"] == "sdpa" else r["attention"]]
    return args


def compare(dir_: str, vramsim: str, gpu: str) -> list[dict[str, Any]]:
    """``vramsim predict --json`` for every result in ``dir_``, next to the measured peaks."""
    rows = []
    for fn in sorted(os.listdir(dir_)):
        if not fn.endswith(".json"):
            continue
        res = json.load(open(os.path.join(dir_, fn)))
        args = predict_args(res) + ["--gpu", gpu, "--json"]
        proc = subprocess.run([vramsim] + args, capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"name": res["name"], "error": proc.stderr.strip()})
            continue
        pred = json.loads(proc.stdout)
        rows.append({"name": res["name"], "measured": res, "predicted": pred, "args": args})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table: measured and predicted step peaks, and their errors."""
    def gib(b: int) -> str:
        return f"{b / 2**30:.3f}"

    out = ["| recipe | peak allocated measured / predicted (GiB) | error | peak reserved measured / predicted "
           "(GiB) | error | SDPA (PyTorch / vramsim) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['name']} | vramsim failed: {r['error'].splitlines()[0]} | | | | |")
            continue
        m, p = r["measured"], r["predicted"]
        ea = (p["peak_allocated_bytes"] - m["peak_allocated"]) / m["peak_allocated"]
        er = (p["peak_reserved_bytes"] - m["peak_reserved"]) / m["peak_reserved"]
        kernel = (p.get("attention") or {}).get("kernel")
        sdpa = f"{m['sdpa_choice']} / {kernel}" if m["sdpa_choice"] else "-"
        out.append(f"| `{r['name']}` | {gib(m['peak_allocated'])} / {gib(p['peak_allocated_bytes'])} | "
                   f"{100 * ea:+.2f}% | {gib(m['peak_reserved'])} / {gib(p['peak_reserved_bytes'])} | "
                   f"{100 * er:+.2f}% | {sdpa} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train_step_gpu.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("run-all")
    a.add_argument("--out", required=True)
    a.add_argument("--only", help="run the recipes whose name contains one of these (comma-separated)")
    a.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for every recipe")
    o = sub.add_parser("one")
    o.add_argument("recipe")
    o.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("dir")
    c.add_argument("--vramsim", default=os.path.join(ROOT, "target", "release", "vramsim"))
    c.add_argument("--gpu", default="h100")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        print(table(compare(args.dir, args.vramsim, args.gpu)))
        return 0
    if args.cmd == "run-all":
        return run_all(args.out, args.only, args.alloc_conf)
    if args.cmd == "one":
        res = run_one(json.loads(args.recipe), args.out)
        print(json.dumps({k: res[k] for k in ("name", "peak_allocated", "peak_reserved",
                                               "outside_allocator_end", "sdpa_choice", "skipped_steps")}))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
