"""Record what a real PyTorch training step asks of GPU memory, on the ``meta`` device, as a vramsim trace.

What goes in: a model, its inputs, its loss and its optimizer (the zoo below, or your own through
:func:`capture`). What comes out: a vramsim JSON Lines trace (``docs/trace-format.md``): one ``alloc`` per
storage the step creates, one ``free`` when that storage dies, ``phase`` markers, and a header whose
``meta`` names the tool, the torch and transformers versions and the recipe.

How it works
============

The model is built under ``with torch.device("meta")``: every tensor has a shape, a dtype and a storage
of ``nbytes`` bytes, but no memory behind it, so a 1.1B-parameter model costs nothing and needs no GPU.
A :class:`~torch.utils._python_dispatch.TorchDispatchMode` (the mechanism of
``torch.distributed._tools.mem_tracker.MemTracker``) sees every ATen op below autograd, in program order,
including the ops the autograd engine and the optimizer run. For each op's outputs it looks at the
untyped storage:

* a storage it has not seen, and that is not the storage of one of the op's inputs, is a new
  allocation: ``alloc`` with ``size = storage.nbytes()`` (the unrounded size the caching allocator would
  be asked for; 0-byte storages are skipped, as ``CUDACachingAllocator`` returns no block for them);
* views and in-place ops return a storage already known: nothing is allocated;
* a known storage whose ``nbytes`` changed (``resize_``) is a new allocation followed by the free of the
  old one, the order ``resize_`` uses.

Each new storage gets a ``weakref`` with a callback. Storages keep their Python object for as long as
the C++ ``StorageImpl`` lives (PyTorch's PyObject preservation), and CPython runs the callback
synchronously when it dies: when the last tensor, saved variable or gradient buffer referring to it
goes away. That is the moment the caching allocator's ``free`` is called, and the callback appends the
``free`` to the same event list as the ``alloc`` events, so frees land exactly between the ops where they
happen. (The backward of meta tensors runs on the calling thread, from the autograd engine's CPU ready
queue, so the order is the engine's node order.)

The step
========

:func:`capture` runs this loop, and the phase markers are where the comments say::

    # phase "setup": parameters and buffers, in the order model.to(device) would move them
    for it in range(iterations):
        for micro in range(accum):
            # phase "forward"
            inputs = inputs_fn()                   # category "input"
            loss = loss_fn(model, inputs)
            if accum > 1: loss = loss / accum
            # phase "backward"
            loss.backward()
            del loss, inputs                      # inputs die here
        # phase "optimizer"
        optimizer.step()
        # phase "zero_grad"
        optimizer.zero_grad(set_to_none=True)

Categories (the trace format's vocabulary), decided when the step is over and written on the ``alloc``:

``parameter``        storages of ``model.parameters()`` (tied weights are one storage).
``other``            module buffers (tag ``buffer:NAME``: BatchNorm running stats, HF position ids).
``input``            storages allocated by ``inputs_fn``.
``activation``       allocated in the forward and still alive when the forward ends (what autograd saved
                     for backward, and the loss), or recomputed by activation checkpointing in the
                     backward and still alive when the recomputation ends.
``gradient``         storages that become a parameter's ``.grad`` (seen by a post-accumulate-grad hook:
                     ``AccumulateGrad`` often *steals* the buffer a backward op allocated, so the alloc
                     sits at that op).
``optimizer_state``  storages in ``optimizer.state`` after ``step()``.
``temporary``        everything else: forward intermediates freed inside the forward, gradients of
                     activations, the optimizer's foreach intermediates.

Meta is not CUDA: what differs and what this tool does about it
===============================================================

The Python and C++ code above the kernels (modules, autograd formulas, the autograd engine,
``AccumulateGrad``, the optimizers, ``torch.utils.checkpoint``) is the same code on every device, and the
meta kernels give the same output shapes and dtypes as CUDA's (``native_layer_norm`` on bf16 input keeps
fp32 ``mean``/``rstd``, as CUDA does). What differs:

* **Dropout.** ``at::dropout`` takes the fused ``native_dropout`` kernel only for CUDA/XPU/lazy/
  privateuse1 tensors (``is_fused_kernel_acceptable`` in ``aten/src/ATen/native/Dropout.cpp``). On meta
  (and CPU) it falls back to ``empty_like`` + ``bernoulli_`` + ``div_`` + ``mul``, and autograd saves that
  noise tensor in the input's dtype: 4 bytes per element in fp32 where CUDA saves a 1-byte bool mask.
  With ``mimic_cuda=True`` (the default) the capture routes ``torch.nn.functional.dropout`` (what
  ``nn.Dropout`` and the HF models call) to ``torch.native_dropout`` when CUDA would, so the trace holds
  CUDA's output + bool mask. In-place dropout stays unfused, as on CUDA.
* **Optimizers.** On CUDA the optimizers default to ``foreach=True``; on meta they default to the
  per-parameter loop. The zoo passes ``foreach=True`` explicitly, so the foreach intermediates (Adam's
  ``exp_avg_sq.sqrt()`` list, ...) are in the trace. ``step`` counters are CPU tensors, as on CUDA
  without ``capturable``/``fused``; CPU tensors are never recorded.
* **Kernel-internal allocations are not seen**, here or by any dispatch mode: cuBLAS/cuBLASLt workspaces,
  cuDNN convolution workspaces, the sort buffers of CUDA's ``embedding_dense_backward``, and other
  buffers a CUDA kernel takes from the caching allocator while it runs. They are part of what
  ``torch.cuda.max_memory_allocated`` shows and not part of this trace.
* **cuDNN batch norm** returns a ``reserve`` buffer (usually 0 bytes); meta's batch norm returns an empty
  one. ``torch.nn.functional.scaled_dot_product_attention`` picks a device-specific backend (flash,
  memory-efficient, math) that saves different tensors: the zoo's HF models use
  ``attn_implementation="eager"`` so the trace does not depend on that choice.
* **Data-dependent Python code cannot run on meta** (``.item()``, ``if tensor.all():``): it raises
  ``Tensor.item() cannot be called on meta tensors``. In HF transformers 5 the attention-mask helpers do
  that. For the causal models (GPT-2, LLaMA) the packed-sequence check reads the position ids when no
  ``attention_mask`` is given, so the zoo passes an all-ones mask (as a tokenizer would; the eager path
  then builds the same float mask on CUDA). For BERT, CUDA with an all-ones mask skips the mask
  (``padding_mask.all()`` is true), which is exactly what passing no mask does, so the zoo passes none.
  Your own model may need the same care.

Command line::

    python traces/python/vramsim_capture.py --model gpt2 --batch 2 --seq 128 --dtype fp32 \\
        --optimizer adamw --checkpoint none --accum 1 --iterations 2 -o gpt2.jsonl

Library::

    from vramsim_capture import capture
    cap = capture(model_fn, inputs_fn, loss_fn, optimizer_fn, iterations=2)
    cap.write("step.jsonl")        # or .jsonl.gz
    print(cap.summary()["peak_requested_bytes"])

Mixed precision: fake CPU tensors
=================================

The meta device has no autocast dispatch key, so ``torch.autocast`` does nothing there. For AMP steps
(``--dtype amp-fp16`` / ``amp-bf16``, or ``capture(..., device="cpu", amp="fp16")``) the capture runs on
*fake CPU tensors* instead: the model is built on meta, then ``model.to_empty(device="cpu")`` inside a
``FakeTensorMode`` (tied parameters re-tied), and the step runs in that mode (shapes, dtypes, strides and
storages as on CPU, no memory, no compute). On top of it:

* **CUDA's autocast policy on the CPU key** (``cuda_autocast.py``): the ops and the cast policy of each are read
  off the installed wheel's ``AutocastCUDA`` kernels, with ``cached_cast``'s weight cache and its lifetime, and
  CUDA's fused half-to-float softmax. The forward and the loss run under ``torch.autocast("cpu", dtype)``.
* **GradScaler** for fp16: ``scaler.scale(loss).backward()``; the step is ``unscale_``, ``optimizer.step()``,
  ``update()`` (what ``scaler.step`` does when no inf is found; it reads ``found_inf`` with ``.item()``, which a
  fake tensor cannot answer).
* **CUDA's kernel choices**: fused dropout as above; SDPA pinned to a CUDA backend (``--attention sdpa-flash``,
  ``sdpa-mem-efficient``, ``sdpa-math``; :func:`pinned_sdpa`), since the CPU picks its own kernel; the float32
  statistics of 16-bit ``native_layer_norm``/``native_batch_norm`` (CUDA's accumulate type; the meta functions
  give CPU's dtype for CPU tensors).
* **Host memory stays out**: an optimizer's CPU ``step`` counters and the ``torch.tensor(1.0, device="cpu")``
  torch/optim wraps them with are host tensors on a CUDA run (on meta they are real CPU tensors, never seen).

A fake-CPU recording of an fp32 or bf16 step is event for event the meta recording
(``test_cuda_autocast.py`` checks it on every family). What the recording method itself adds, as on meta:
gradients summed out of place (a dispatch mode), and kernel-internal allocations (cuBLAS/cuDNN workspaces,
``expect_contiguous`` copies inside CUDA kernels) unseen; the memory-efficient SDPA's philox ``seed``/``offset``
come from its meta function as device tensors (CPU tensors on CUDA without graph capture).

Deliberately not done: rounding (the simulator rounds sizes as PyTorch does), streams other than 0,
multi-GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

try:  # the module imports without torch, so that tests can skip with a reason
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary
except ImportError:  # pragma: no cover - exercised only where torch is absent
    torch = None  # type: ignore[assignment]
    TorchDispatchMode = object  # type: ignore[assignment,misc]

TOOL = "vramsim_capture"
TOOL_VERSION = 1

PHASES = ("setup", "forward", "backward", "optimizer", "zero_grad")
CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "workspace",
              "input", "autograd_detail", "communication", "other")


def versions() -> dict[str, str | None]:
    """The versions a trace depends on: python, torch, and transformers/torchvision when installed."""
    out: dict[str, str | None] = {"python": sys.version.split()[0], "torch": None,
                                  "transformers": None, "torchvision": None}
    if torch is not None:
        out["torch"] = torch.__version__
    for name in ("transformers", "torchvision"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded as None
            pass
    return out


# --------------------------------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Alloc:
    """One storage allocation: its alloc event is written from this record when the capture ends."""

    id: int
    size: int
    category: str
    tag: str | None
    freed: bool = False
    ref: Any = None  # the weakref whose callback emits the free
    host: bool = False  # host memory on a CUDA run (an optimizer's CPU `step`): left out of the trace


@dataclass
class Capture:
    """A finished capture: header metadata and the events, in order."""

    meta: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)

    def header(self) -> dict[str, Any]:
        return {"format": "vramsim-trace", "version": 1, "meta": self.meta}

    def lines(self) -> Iterable[str]:
        """The JSON Lines text, header first, one event per line."""
        yield json.dumps(self.header(), separators=(",", ":"))
        for ev in self.events:
            yield json.dumps(ev, separators=(",", ":"))

    def write(self, path: str) -> None:
        """Write JSON Lines; a name ending in ``.gz`` is gzip-compressed (as the Rust writer decides)."""
        text = "".join(line + "\n" for line in self.lines()).encode("utf-8")
        with open(path, "wb") as f:
            if path.endswith(".gz"):
                # mtime 0 and no file name: the same trace always compresses to the same bytes
                with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
                    gz.write(text)
            else:
                f.write(text)

    def summary(self) -> dict[str, Any]:
        return summarize(self.events)


class Recorder(TorchDispatchMode):
    """A dispatch mode that turns storage lifetimes on ``device`` into alloc/free events.

    The driver (:func:`capture`) sets ``phase`` and ``context`` (``"input"`` while inputs are made) and
    calls :meth:`end_forward`, :meth:`mark_gradient` and :meth:`mark_optimizer_state`; everything else is
    seen by ``__torch_dispatch__``.
    """

    def __init__(self, device: "torch.device", names: dict[int, str] | None = None) -> None:
        super().__init__()
        self.device = device
        self.items: list[tuple[str, Any]] = []  # ("alloc", _Alloc) | ("free", id) | ("phase", name)
        # keyed by the storage object's identity, held weakly (as MemTracker's _WINFO)
        self._by_storage = WeakIdKeyDictionary()
        self._next_id = 0
        self.phase = "setup"
        self.context: str | None = None
        self.closed = False
        self._pending: list[_Alloc] = []     # forward / recompute allocations, category decided later
        self._in_recompute = False
        self.module_stack: list[str] = []
        self.names = names or {}
        self.ops = 0
        self.untracked_inputs = 0

    # -- events -------------------------------------------------------------------------------------

    def mark_phase(self, name: str) -> None:
        self.items.append(("phase", name))
        self.phase = name

    def _on_free(self, rec: _Alloc, _ref: Any) -> None:
        # Runs synchronously when the StorageImpl dies, between the ops that make it die.
        if self.closed or rec.freed:
            return
        rec.freed = True
        self.items.append(("free", rec.id))

    def _new_alloc(self, st: Any, category: str, tag: str | None) -> _Alloc | None:
        size = int(st.nbytes())
        rec = _Alloc(self._next_id, size, category, tag)
        self._next_id += 1
        self._by_storage[st] = rec
        if size == 0:
            rec.freed = True  # never emitted: the caching allocator hands out no block for 0 bytes
            return rec
        rec.ref = weakref.ref(st, lambda r, rec=rec: self._on_free(rec, r))
        self.items.append(("alloc", rec))
        return rec

    def track(self, t: "torch.Tensor", category: str, tag: str | None) -> _Alloc | None:
        """Record a tensor that exists already (a parameter at setup): alloc now if its storage is new."""
        st = t.untyped_storage()
        rec = self._by_storage.get(st)
        if rec is None:
            rec = self._new_alloc(st, category, tag)
        return rec

    def lookup(self, t: "torch.Tensor") -> _Alloc | None:
        return self._by_storage.get(t.untyped_storage())

    def _category_now(self) -> str:
        if self.context == "input":
            return "input"
        # Recompute of activation checkpointing: forward ops run by the autograd engine with grad
        # enabled (the engine itself runs backward formulas with grad disabled).
        recompute = (self.phase == "backward" and torch.is_grad_enabled()
                     and torch._C._current_graph_task_id() != -1)
        if recompute:
            self._in_recompute = True
            return "pending"
        if self._in_recompute:
            self._resolve_pending()
        if self.phase == "forward":
            return "pending"
        return "temporary"

    def _resolve_pending(self) -> None:
        """The end of a forward or of a recomputation: what is still alive is an activation."""
        for rec in self._pending:
            rec.category = "temporary" if rec.freed else "activation"
        self._pending.clear()
        self._in_recompute = False

    def end_forward(self) -> None:
        self._resolve_pending()

    def mark_gradient(self, t: "torch.Tensor", name: str) -> None:
        rec = self.lookup(t)
        if rec is None:
            rec = self.track(t, "gradient", "grad:" + name)
        if rec is not None and rec in self._pending:
            self._pending.remove(rec)
        if rec is not None:
            rec.category = "gradient"
            rec.tag = "grad:" + name

    def mark_host(self, t: "torch.Tensor") -> None:
        """``t`` lives in host memory on a CUDA run although it shares the capture's device (fake CPU): its
        alloc and free are left out of the trace."""
        rec = self.lookup(t)
        if rec is not None:
            rec.host = True

    def mark_optimizer_state(self, t: "torch.Tensor", tag: str) -> None:
        if t.device != self.device:
            return  # Adam's `step` counters live on the CPU, as on CUDA without capturable/fused
        rec = self.lookup(t)
        if rec is None:
            rec = self.track(t, "optimizer_state", tag)
        if rec is not None:
            rec.category = "optimizer_state"
            rec.tag = tag

    # -- the dispatch mode --------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.closed:
            return out
        if self.device.type == "cpu" and func in _CUDA_ACC_STATS:
            out = _cuda_acc_stats(func, args, out)
        self.ops += 1
        outs = [t for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.device == self.device]
        if not outs:
            return out
        fresh = func in _LIFT_FRESH
        in_storages: list[Any] | None = None
        opname = _op_name(func)
        for t in outs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # sparse, nested or otherwise storage-less tensors
            rec = self._by_storage.get(st)
            if rec is not None:
                if int(st.nbytes()) != rec.size and not rec.freed:
                    self._realloc(st, rec)
                continue
            if not fresh:
                if in_storages is None:
                    in_storages = _storages(args, kwargs, self.device)
                if any(st is s for s in in_storages):
                    # Output aliases an input we never saw allocated: a tensor from before the capture.
                    self.untracked_inputs += 1
                    continue
            cat = self._category_now()
            rec = self._new_alloc(st, cat, self._tag(opname))
            if rec is not None and cat == "pending":
                self._pending.append(rec)
            if rec is not None and fresh and self.phase == "optimizer" and self.device.type == "cpu":
                # torch/optim wraps Python numbers for its CPU `step` counters as torch.tensor(x, device="cpu")
                # (Adam's foreach `_foreach_add_(steps, torch.tensor(1.0, device="cpu"))`) and makes its device
                # tensors with factories on p.device: on a fake-CPU capture a fresh literal in the optimizer is
                # host memory of the CUDA run.
                rec.host = True
        return out

    def _realloc(self, st: Any, old: _Alloc) -> None:
        rec = self._new_alloc(st, old.category, old.tag)  # resize_: new block first, then the old freed
        if old in self._pending and rec is not None:
            self._pending.append(rec)
        if old.ref is not None and not old.freed:
            old.freed = True
            self.items.append(("free", old.id))

    def _tag(self, opname: str) -> str:
        module = self.module_stack[-1] if self.module_stack else ""
        if module and self.phase == "backward":
            return f"recompute:{module}:{opname}"
        return f"{module}:{opname}" if module else opname

    # -- output -------------------------------------------------------------------------------------

    def close(self) -> list[dict[str, Any]]:
        """Stop recording (storages that die later are not freed in the trace) and build the events."""
        self.closed = True
        self._resolve_pending()
        events: list[dict[str, Any]] = []
        host = {x.id for kind, x in self.items if kind == "alloc" and x.host}
        for kind, x in self.items:
            if kind == "alloc" and x.host or kind == "free" and x in host:
                continue
            if kind == "alloc":
                ev = {"op": "alloc", "id": x.id, "size": x.size, "stream": 0, "category": x.category}
                if x.tag:
                    ev["tag"] = x.tag
                events.append(ev)
            elif kind == "free":
                events.append({"op": "free", "id": x})
            else:
                events.append({"op": "phase", "name": x})
        return events


if torch is not None:
    _LIFT_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
else:  # pragma: no cover
    _LIFT_FRESH = set()


if torch is not None:
    # Kernels whose meta function gives CPU's dtype for fake CPU tensors where CUDA's kernel allocates its
    # statistics in the accumulate type (at::toAccumulateType(dtype, /*is_cuda=*/true): float32 for 16-bit
    # inputs): layer_norm_cuda (`cuda/layer_norm_kernel.cu`: mean, rstd) and batch_norm_cuda
    # (`cuda/Normalization.cu`: save_mean, save_invstd). Output indices to fix, per op.
    _CUDA_ACC_STATS = {torch.ops.aten.native_layer_norm.default: (1, 2),
                       torch.ops.aten.native_batch_norm.default: (1, 2),
                       torch.ops.aten._native_batch_norm_legit.default: (1, 2),
                       torch.ops.aten._native_batch_norm_legit_no_training.default: (1, 2)}
else:  # pragma: no cover
    _CUDA_ACC_STATS = {}


def _cuda_acc_stats(func: Any, args: Any, out: Any) -> Any:
    """``out`` with the statistics of a 16-bit normalization in float32, as CUDA's kernels allocate them."""
    if args[0].dtype not in (torch.float16, torch.bfloat16):
        return out
    out = list(out)
    for i in _CUDA_ACC_STATS[func]:
        t = out[i]
        if t.dtype != torch.float32 and t.numel() > 0:
            out[i] = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    return tuple(out)


def _op_name(func: Any) -> str:
    name = str(func)
    if name.endswith(".default"):
        name = name[: -len(".default")]
    return name


def _storages(args: Any, kwargs: Any, device: Any) -> list[Any]:
    out = []
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.device == device:
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                pass
    return out


# --------------------------------------------------------------------------------------------------
# CUDA mimicry
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def cuda_like_dropout() -> Any:
    """Route ``F.dropout`` to ``native_dropout`` where CUDA's ``at::dropout`` would take the fused kernel.

    ``is_fused_kernel_acceptable``: CUDA tensor, ``0 < p < 1``, at least one element, not in-place. The
    fused kernel returns the output and a bool mask, and autograd saves the mask (``NativeDropoutBackward0``
    saves ``result1``). Meta tensors otherwise take the unfused path, which saves a mask in the input dtype.
    """
    import torch.nn.functional as F

    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002, ANN001
        if (training and not inplace and 0.0 < p < 1.0 and isinstance(input, torch.Tensor)
                and input.numel() > 0 and not torch.jit.is_scripting()):
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


SDPA_BACKENDS = ("flash", "mem-efficient", "math")
AMP_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
CHECKPOINTS = ("none", "full", "selective", "selective-op")


@contextlib.contextmanager
def pinned_sdpa(backend: str | None, recompute: bool = False) -> Any:
    """Route ``F.scaled_dot_product_attention`` to the kernel CUDA's composite would call for ``backend``.

    On CUDA ``at::scaled_dot_product_attention`` (``aten/src/ATen/native/transformers/attention.cpp``) asks
    ``_fused_sdp_choice`` (``cuda/sdp_utils.cpp``) for a backend and calls its kernel; on CPU tensors the CPU
    choice runs instead (``_scaled_dot_product_flash_attention_for_cpu``), which saves other tensors. The
    capture pins the backend a CUDA run would take (or that ``torch.nn.attention.sdpa_kernel`` forces):

    * ``flash``: ``_scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask=False,
      scale)`` (head dims padded to a multiple of 8 first, a no-op for the zoo's 64);
    * ``mem-efficient``: ``_scaled_dot_product_efficient_attention(q, k, v, attn_mask, compute_log_sumexp,
      dropout_p, is_causal, scale)`` with ``compute_log_sumexp`` = an input requires grad and grad mode is on
      (``should_compute_logsumexp``);
    * ``math``: ``_scaled_dot_product_attention_math``.

    Autocast first: ``aten::scaled_dot_product_attention`` has an ``AutocastCUDA`` kernel (lower_precision_fp),
    so under ``torch.autocast`` its tensor arguments are cast (with :mod:`cuda_autocast`'s policy) before the
    backend runs. Only the mask-free call without ``enable_gqa`` is pinned for the fused backends (what the zoo's
    ViT makes); anything else is an error naming the backend.

    ``recompute=True`` is selective activation checkpointing of the attention core: each call (its autocast
    casts included) runs under non-reentrant ``torch.utils.checkpoint``, as user code writing
    ``checkpoint(F.scaled_dot_product_attention, q, k, v, use_reentrant=False)`` would.
    """
    import torch.nn.functional as F

    if backend is None:
        yield
        return
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}: use one of {', '.join(SDPA_BACKENDS)}")
    original = F.scaled_dot_product_attention
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,  # noqa: ANN001
             enable_gqa=False):
        if recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            def core(q, k, v, m):  # noqa: ANN001, ANN202
                return run(q, k, v, m, dropout_p, is_causal, scale, enable_gqa)
            return checkpoint(core, query, key, value, attn_mask, use_reentrant=False)
        return run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ANN001, ANN202
        import cuda_autocast
        query, key, value, attn_mask = cuda_autocast.autocast_args(
            "scaled_dot_product_attention", query, key, value, attn_mask)
        with cuda_autocast.below_autocast():
            if backend == "math":
                return aten._scaled_dot_product_attention_math(
                    query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
            if enable_gqa or (attn_mask is not None and backend == "flash"):
                raise ValueError(f"SDPA pinned to {backend}: the capture pins only calls without "
                                 f"enable_gqa{' or a mask' if backend == 'flash' else ''}")
            if backend == "flash":
                return aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, lse, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _materialize_fake(model: "torch.nn.Module", device: str) -> None:
    """``model.to_empty(device)`` under the active ``FakeTensorMode``, keeping tied parameters tied.

    ``to_empty`` replaces each module's parameters one by one, so a parameter shared by two modules (GPT-2's
    ``wte``/``lm_head``) becomes two; the sharing seen on the meta model is restored afterwards."""
    shared: dict[int, list[tuple[Any, str, str]]] = {}
    for mod in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    shared.setdefault(id(t), []).append((mod, kind, name))
    model.to_empty(device=device)
    for users in shared.values():
        first_mod, kind, first_name = users[0]
        t = getattr(first_mod, kind)[first_name]
        for mod, kind2, name in users[1:]:
            getattr(mod, kind2)[name] = t


# --------------------------------------------------------------------------------------------------
# The capture driver
# --------------------------------------------------------------------------------------------------

def _apply_order(module: "torch.nn.Module", prefix: str = "") -> Iterable[tuple[str, Any, str]]:
    """Parameters and buffers in the order ``Module._apply`` (``model.to(device)``) visits them:
    children first, then the module's own parameters, then its buffers."""
    for name, child in module._modules.items():
        if child is not None:
            yield from _apply_order(child, f"{prefix}{name}.")
    for name, p in module._parameters.items():
        if p is not None:
            yield f"{prefix}{name}", p, "parameter"
    for name, b in module._buffers.items():
        if b is not None:
            yield f"{prefix}{name}", b, "buffer"


def capture(
    model_fn: Callable[[], "torch.nn.Module"],
    inputs_fn: Callable[[], Any],
    loss_fn: Callable[["torch.nn.Module", Any], "torch.Tensor"],
    optimizer_fn: Callable[[Any], "torch.optim.Optimizer"],
    iterations: int = 2,
    *,
    accum: int = 1,
    device: str = "meta",
    mimic_cuda: bool = True,
    meta: dict[str, Any] | None = None,
    amp: str | None = None,
    sdpa: str | None = None,
    recompute_sdpa: bool = False,
) -> Capture:
    """Run ``iterations`` training steps of ``accum`` micro-batches each and record them.

    ``model_fn()`` builds the model; it runs under ``with torch.device(device)``, so build it there
    (checkpointing, dtype casts and all). ``inputs_fn()`` makes one micro-batch (also under the device
    context; its storages are category ``input``). ``loss_fn(model, inputs)`` returns the scalar loss.
    ``optimizer_fn(params)`` gets ``model.parameters()`` and returns the optimizer: pass
    ``foreach=True`` to match CUDA's default. Everything runs on ``device``: ``"meta"`` (meta tensors) or
    ``"cpu"`` (fake CPU tensors under ``FakeTensorMode``); neither has memory behind it nor needs a GPU.

    ``amp`` (``"fp16"`` or ``"bf16"``, ``device="cpu"`` only) runs the forward and the loss under
    ``torch.autocast`` with CUDA's policy (:mod:`cuda_autocast`); fp16 scales the loss with a ``GradScaler``
    and steps as ``scaler.step`` does (``unscale_``, ``optimizer.step()``, ``update()``: ``step`` itself reads
    ``found_inf`` with ``.item()``, which a fake tensor cannot answer; with no inf found it does exactly that).
    ``sdpa`` pins ``F.scaled_dot_product_attention`` to a CUDA backend (:func:`pinned_sdpa`); on ``"cpu"`` a
    model that calls SDPA needs it, since the CPU backend is not CUDA's. ``recompute_sdpa`` checkpoints each
    pinned SDPA call (selective activation checkpointing of the attention core).
    """
    if torch is None:
        raise RuntimeError("vramsim_capture needs torch: pip install torch")
    if iterations < 1 or accum < 1:
        raise ValueError(f"iterations and accum must be 1 or more, got {iterations} and {accum}")
    if device not in ("meta", "cpu"):
        raise ValueError(f"unknown device {device!r}: use meta or cpu (fake CPU tensors)")
    if amp is not None and amp not in AMP_DTYPES:
        raise ValueError(f"unknown amp dtype {amp!r}: use one of {', '.join(AMP_DTYPES)}")
    if amp is not None and device != "cpu":
        raise ValueError("amp needs device='cpu': the meta device has no autocast dispatch key")
    if sdpa is not None and sdpa not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {sdpa!r}: use one of {', '.join(SDPA_BACKENDS)}")
    if recompute_sdpa and sdpa is None:
        raise ValueError("recompute_sdpa checkpoints the pinned SDPA call: give an sdpa backend")
    dev = torch.device(device)
    t0 = time.perf_counter()
    fake = None
    if device == "cpu":
        from torch._subclasses.fake_tensor import FakeTensorMode

        # Built on meta (no memory, no random init), then fake CPU storages of the same sizes.
        with torch.device("meta"):
            model = model_fn()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            _materialize_fake(model, "cpu")
    else:
        with torch.device(dev):
            model = model_fn()
    model.train()
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    rec = Recorder(dev, names)

    # setup: what model.to(device) would have put on the GPU before the first step
    param_names: dict[int, str] = {}
    n_params = 0
    seen_params: set[int] = set()
    for name, t, kind in _apply_order(model):
        if t.device != dev:
            continue
        if kind == "parameter":
            if id(t) not in seen_params:
                seen_params.add(id(t))
                n_params += t.numel()
                param_names[id(t)] = name
            rec.track(t, "parameter", name)
        else:
            rec.track(t, "other", "buffer:" + name)
    rec.items.insert(0, ("phase", "setup"))

    hooks = []
    for p in model.parameters():
        if p.requires_grad:
            pname = param_names.get(id(p), "?")
            hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, pname=pname: rec.mark_gradient(p.grad, pname)))

    def pre_hook(module: Any, _args: Any) -> None:
        rec.module_stack.append(names.get(id(module), type(module).__name__))

    def post_hook(_module: Any, _args: Any, _out: Any) -> None:
        if rec.module_stack:
            rec.module_stack.pop()

    mod_hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
        torch.nn.modules.module.register_module_forward_hook(post_hook, always_call=True),
    ]
    optimizer = optimizer_fn(model.parameters())

    def opt_post_hook(opt: Any, _args: Any, _kwargs: Any) -> None:
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for p, state in opt.state.items():
            pname = param_names.get(id(p), "?")
            group = group_of.get(id(p), {})
            for key, val in state.items():
                if isinstance(val, torch.Tensor):
                    if (key == "step" and val.dim() == 0 and fake is not None
                            and not group.get("capturable") and not group.get("fused")):
                        # Adam's "special device hosting for step": torch.tensor(0.0, device="cpu") unless
                        # capturable or fused, i.e. host memory on CUDA (on meta it is a real CPU tensor).
                        rec.mark_host(val)
                        continue
                    rec.mark_optimizer_state(val, f"{key}:{pname}")

    hooks.append(optimizer.register_step_post_hook(opt_post_hook))
    dropout_ctx = cuda_like_dropout() if mimic_cuda else contextlib.nullcontext()
    amp_dtype = getattr(torch, AMP_DTYPES[amp]) if amp else None
    t_setup = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(dropout_ctx)
            stack.enter_context(pinned_sdpa(sdpa, recompute_sdpa))
            if amp is not None:
                import cuda_autocast
                stack.enter_context(cuda_autocast.installed())
            if fake is not None:
                stack.enter_context(fake)
            stack.enter_context(torch.device(dev))
            stack.enter_context(rec)
            scaler = torch.amp.GradScaler(device) if amp == "fp16" else None
            for _it in range(iterations):
                for _micro in range(accum):
                    rec.mark_phase("forward")
                    rec.context = "input"
                    inputs = inputs_fn()
                    rec.context = None
                    with (torch.autocast(device, dtype=amp_dtype) if amp is not None
                          else contextlib.nullcontext()):
                        loss = loss_fn(model, inputs)
                    if accum > 1:
                        loss = loss / accum
                    rec.end_forward()
                    rec.mark_phase("backward")
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                    del loss, inputs
                rec.mark_phase("optimizer")
                if scaler is not None:  # scaler.step(optimizer) with no inf/NaN found, then update()
                    scaler.unscale_(optimizer)
                    optimizer.step()
                    scaler.update()
                else:
                    optimizer.step()
                rec.mark_phase("zero_grad")
                optimizer.zero_grad(set_to_none=True)
        events = rec.close()
    finally:
        rec.closed = True
        for h in hooks + mod_hooks:
            h.remove()
    t_end = time.perf_counter()

    v = versions()
    header = {
        "tool": TOOL,
        "tool_version": TOOL_VERSION,
        "torch": v["torch"],
        "transformers": v["transformers"],
        "torchvision": v["torchvision"],
        "python": v["python"],
        "device": str(dev),
        "mimic_cuda": mimic_cuda,
        "amp": amp,
        "sdpa_backend": sdpa,
        "recompute_sdpa": recompute_sdpa,
        "iterations": iterations,
        "accum": accum,
        "params": n_params,
        "optimizer_class": type(optimizer).__name__,
        "optimizer_defaults": {k: v for k, v in optimizer.defaults.items()
                               if isinstance(v, (bool, int, float, str)) or v is None},
        "ops_seen": rec.ops,
        "untracked_input_storages": rec.untracked_inputs,
        "capture_seconds": round(t_end - t_setup, 3),
        "build_seconds": round(t_setup - t0, 3),
    }
    header.update(meta or {})
    return Capture(header, events)


# --------------------------------------------------------------------------------------------------
# Summaries (the numbers the reference fixtures hold)
# --------------------------------------------------------------------------------------------------

def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Replay a trace's alloc/free events and report live requested bytes.

    ``peak_requested_bytes`` is the maximum over the trace of the sum of the sizes of live allocations,
    which is what PyTorch's ``requested_bytes.all.peak`` counts (sizes unrounded). Also: the phase and
    event index of the (first) peak, the bytes by category at that moment, the peak of each phase name and
    of each phase segment in order, counts, and the bytes still live at the end.
    Raises ``ValueError`` on a free of an id that is not live, or an alloc of an id that is.
    """
    live: dict[Any, tuple[int, str]] = {}
    by_cat: dict[str, int] = {}
    cur = peak = 0
    peak_index = -1
    peak_phase = None
    peak_cats: dict[str, int] = {}
    phase = None
    by_phase: dict[str, int] = {}
    segments: list[dict[str, Any]] = []
    n_alloc = n_free = 0
    for i, ev in enumerate(events):
        op = ev["op"]
        if op == "phase":
            phase = ev["name"]
            segments.append({"phase": phase, "peak": cur})
            by_phase[phase] = max(by_phase.get(phase, 0), cur)
        elif op == "alloc":
            if ev["id"] in live:
                raise ValueError(f"event {i}: alloc of id {ev['id']!r}, which is already live")
            cat = ev.get("category") or "other"
            live[ev["id"]] = (ev["size"], cat)
            cur += ev["size"]
            by_cat[cat] = by_cat.get(cat, 0) + ev["size"]
            n_alloc += 1
            if cur > peak:
                peak, peak_index, peak_phase = cur, i, phase
                peak_cats = dict(by_cat)
            if phase is not None:
                by_phase[phase] = max(by_phase.get(phase, 0), cur)
                if segments:
                    segments[-1]["peak"] = max(segments[-1]["peak"], cur)
        elif op == "free":
            if ev["id"] not in live:
                raise ValueError(f"event {i}: free of id {ev['id']!r}, which is not live")
            size, cat = live.pop(ev["id"])
            cur -= size
            by_cat[cat] -= size
            n_free += 1
    final_cats = {k: v for k, v in sorted(by_cat.items()) if v}
    return {
        "peak_requested_bytes": peak,
        "peak_event_index": peak_index,
        "peak_phase": peak_phase,
        "by_category_at_peak": {k: v for k, v in sorted(peak_cats.items()) if v},
        "peak_by_phase": by_phase,
        "peak_by_phase_segment": segments,
        "allocs": n_alloc,
        "frees": n_free,
        "final_live_bytes": cur,
        "final_live_by_category": final_cats,
    }


# --------------------------------------------------------------------------------------------------
# The zoo
# --------------------------------------------------------------------------------------------------

MLP_DIMS = (1024, 4096, 4096, 4096, 1000)
"""The zoo's ``mlp``: Linear(1024,4096)-ReLU-Linear(4096,4096)-ReLU-Linear(4096,4096)-ReLU-
Linear(4096,1000), biases on, input ``(batch, 1024)``, 1000-class cross-entropy. ``--seq`` is ignored."""

TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
"""TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T's config.json (LLaMA-2 architecture)."""

ZOO = ("mlp", "resnet18", "gpt2", "bert-base", "tinyllama-1.1b")
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "amp-fp16": "float32", "amp-bf16": "float32"}
"""Recipe dtypes and the dtype of the model's parameters; ``amp-*`` keep float32 parameters and run autocast."""


@dataclass
class Recipe:
    model: str
    batch: int = 2
    seq: int = 128
    dtype: str = "fp32"
    optimizer: str = "adamw"
    checkpoint: str = "none"
    accum: int = 1
    iterations: int = 2
    #: ``eager`` or ``sdpa-<backend>`` (HF ``attn_implementation="sdpa"`` with the backend pinned)
    attention: str = "eager"
    #: ``meta`` or ``cpu`` (fake CPU tensors); ``amp-*`` dtypes always record on ``cpu``
    device: str = "meta"
    #: ``non-reentrant`` (``use_reentrant=False``) or ``reentrant`` (``use_reentrant=True``) checkpointing
    checkpoint_impl: str = "non-reentrant"

    def name(self) -> str:
        s = f"{self.dtype}-{self.optimizer}"
        if self.checkpoint != "none":
            s += f"-ckpt{self.checkpoint}"
            if self.checkpoint_impl == "reentrant":
                s += "-reentrant"
        if self.accum != 1:
            s += f"-accum{self.accum}"
        if self.attention != "eager":
            s += f"-{self.attention}"
        return s

    def amp(self) -> str | None:
        """``fp16``/``bf16`` for the ``amp-*`` dtypes, else None."""
        return self.dtype[len("amp-"):] if self.dtype.startswith("amp-") else None

    def sdpa_backend(self) -> str | None:
        """The pinned SDPA backend of an ``sdpa-*`` attention, else None."""
        return self.attention[len("sdpa-"):] if self.attention.startswith("sdpa-") else None


class _Checkpointed(torch.nn.Module if torch is not None else object):  # type: ignore[misc]
    """Wraps a block so that its forward runs under ``torch.utils.checkpoint`` (non-reentrant unless
    ``reentrant``)."""

    def __init__(self, inner: "torch.nn.Module", reentrant: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, *args, use_reentrant=self.reentrant)


def torchtitan_op_sac_context_fn() -> Any:
    """torchtitan 9dec370's op-level selective AC ``context_fn`` (``torchtitan/parallelisms/
    parallelize_llama.py`` ``_apply_ac_to_transformer_block``, ``selective_ac_option = "op"``), as written
    there: save the outputs of the ``_save_list`` ops, except every second ``aten.mm`` counted per call."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save_list = {
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops.aten.abs.default,
        torch.ops.aten.max.default,
    }

    def _get_custom_policy(meta):  # noqa: ANN001, ANN202
        def _custom_policy(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count_key = f"{mode}_mm_count"
            if func == torch.ops.aten.mm.default:
                meta[mm_count_key] += 1
            to_save = func in save_list and not (
                func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE
        return _custom_policy

    meta = defaultdict(int)
    return create_selective_checkpoint_contexts(_get_custom_policy(meta))


def _op_sac(layer: "torch.nn.Module") -> None:
    """Runs ``layer`` (its module call, hooks and all, as ``CheckpointWrapper`` does) under non-reentrant
    ``torch.utils.checkpoint`` with torchtitan's op-level SAC ``context_fn`` and
    ``preserve_rng_state=False``; the layer keeps its name."""
    from torch.utils.checkpoint import checkpoint

    inner_forward = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner_forward, *args, use_reentrant=False, context_fn=torchtitan_op_sac_context_fn,
                          preserve_rng_state=False, **kwargs)
    layer.forward = forward


def _make_mlp() -> "torch.nn.Module":
    layers: list[Any] = []
    for i in range(len(MLP_DIMS) - 1):
        layers.append(torch.nn.Linear(MLP_DIMS[i], MLP_DIMS[i + 1]))
        if i < len(MLP_DIMS) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _hf_config(model: str, attn: str = "eager") -> Any:
    import transformers as tf
    # use_cache=False: no KV cache. transformers' default (True) builds a DynamicCache in training
    # too (unless gradient checkpointing is on); models/tools/make_use_cache_captures.py records it.
    if model == "gpt2":
        return tf.GPT2Config(attn_implementation=attn, use_cache=False)
    if model == "bert-base":
        return tf.BertConfig(attn_implementation=attn, use_cache=False)
    if model == "tinyllama-1.1b":
        return tf.LlamaConfig(attn_implementation=attn, use_cache=False, **TINYLLAMA)
    raise ValueError(model)


def zoo(recipe: Recipe) -> tuple[Callable, Callable, Callable, Callable]:
    """``(model_fn, inputs_fn, loss_fn, optimizer_fn)`` for a zoo model and recipe."""
    if torch is None:
        raise RuntimeError("the zoo needs torch: pip install torch")
    if recipe.model not in ZOO:
        raise ValueError(f"unknown model {recipe.model!r}: the zoo has {', '.join(ZOO)}")
    if recipe.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {recipe.dtype!r}: use one of {', '.join(DTYPES)}")
    if recipe.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {recipe.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if recipe.checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {recipe.checkpoint!r}: use one of {', '.join(CHECKPOINTS)}")
    if recipe.checkpoint == "selective" and recipe.sdpa_backend() is None:
        raise ValueError("checkpoint selective recomputes the SDPA call only: use an sdpa-* attention")
    if recipe.attention != "eager" and (not recipe.attention.startswith("sdpa-")
                                        or recipe.sdpa_backend() not in SDPA_BACKENDS):
        raise ValueError(f"unknown attention {recipe.attention!r}: use eager or "
                         f"{', '.join('sdpa-' + b for b in SDPA_BACKENDS)}")
    if recipe.batch < 1 or recipe.seq < 1:
        raise ValueError(f"batch and seq must be 1 or more, got {recipe.batch} and {recipe.seq}")
    dtype = getattr(torch, DTYPES[recipe.dtype])
    B, S = recipe.batch, recipe.seq
    ckpt = recipe.checkpoint == "full"
    if recipe.checkpoint_impl not in ("non-reentrant", "reentrant"):
        raise ValueError(f"unknown checkpoint_impl {recipe.checkpoint_impl!r}: use non-reentrant or reentrant")
    reentrant = recipe.checkpoint_impl == "reentrant"

    if recipe.model == "mlp":
        def model_fn() -> Any:
            m = _make_mlp()
            if ckpt:  # one block = Linear + its ReLU
                mods = list(m)
                blocks = [torch.nn.Sequential(*mods[i:i + 2]) for i in range(0, len(mods) - 1, 2)]
                blocks.append(mods[-1])
                m = torch.nn.Sequential(*[_Checkpointed(b, reentrant) if i < len(blocks) - 1 else b
                                          for i, b in enumerate(blocks)])
            return m.to(dtype)

        def inputs_fn() -> Any:
            return (torch.randn(B, MLP_DIMS[0], dtype=dtype), torch.randint(0, MLP_DIMS[-1], (B,)))

        def loss_fn(model: Any, inp: Any) -> Any:
            return torch.nn.functional.cross_entropy(model(inp[0]), inp[1])

    elif recipe.model == "resnet18":
        def model_fn() -> Any:
            import torchvision
            m = torchvision.models.resnet18(weights=None, num_classes=1000)
            if ckpt:  # one block = one BasicBlock
                for lname in ("layer1", "layer2", "layer3", "layer4"):
                    layer = getattr(m, lname)
                    setattr(m, lname, torch.nn.Sequential(*[_Checkpointed(b, reentrant) for b in layer]))
            return m.to(dtype)

        def inputs_fn() -> Any:
            return (torch.randn(B, 3, 224, 224, dtype=dtype), torch.randint(0, 1000, (B,)))

        def loss_fn(model: Any, inp: Any) -> Any:
            return torch.nn.functional.cross_entropy(model(inp[0]), inp[1])

    else:
        cfg = _hf_config(recipe.model, "eager" if recipe.attention == "eager" else "sdpa")
        max_pos = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings")
        if S > max_pos:
            raise ValueError(f"seq {S} is longer than {recipe.model}'s {max_pos} positions")
        vocab = cfg.vocab_size

        def model_fn() -> Any:
            import transformers as tf
            cls = {"gpt2": tf.GPT2LMHeadModel, "bert-base": tf.BertForMaskedLM,
                   "tinyllama-1.1b": tf.LlamaForCausalLM}[recipe.model]
            m = cls(cfg)
            if recipe.model != "bert-base" and getattr(m, "loss_type", "") is None:
                # the loss HF falls back to anyway (logits upcast to fp32, labels shifted, mean
                # cross-entropy), named so that it does not warn
                m.loss_type = "ForCausalLM"
            if ckpt:  # HF's own per-layer wrapper: GPT2Block / BertLayer / LlamaDecoderLayer
                if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5
                    m.activation_checkpointing_enable({"use_reentrant": reentrant})
                else:
                    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            if recipe.checkpoint == "selective-op":  # torchtitan's per-block wrapper
                layers = {"gpt2": lambda: m.transformer.h, "bert-base": lambda: m.bert.encoder.layer,
                          "tinyllama-1.1b": lambda: m.model.layers}[recipe.model]()
                for layer in layers:
                    _op_sac(layer)
            return m.to(dtype)

        def inputs_fn() -> Any:
            inp = {"input_ids": torch.randint(0, vocab, (B, S))}
            if recipe.model != "bert-base":
                # Causal models: HF's packed-sequence check reads position ids when no mask is given
                # (data-dependent, impossible on meta); an all-ones mask takes the same path on CUDA.
                inp["attention_mask"] = torch.ones(B, S, dtype=torch.long)
            # BERT: on CUDA an all-ones mask is skipped (`padding_mask.all()`), exactly what no mask does.
            inp["labels"] = torch.randint(0, vocab, (B, S))
            return inp

        def loss_fn(model: Any, inp: Any) -> Any:
            return model(**inp).loss  # the output object (logits) dies here, as in Trainer

    def optimizer_fn(params: Any) -> Any:
        if recipe.optimizer == "sgd":
            return torch.optim.SGD(params, lr=1e-2, foreach=True)
        if recipe.optimizer == "sgd-momentum":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)
        if recipe.optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-3, foreach=True)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def capture_zoo(recipe: Recipe) -> Capture:
    """Capture a zoo model under a recipe; the header's meta names the model and the recipe."""
    model_fn, inputs_fn, loss_fn, optimizer_fn = zoo(recipe)
    meta = {"model": recipe.model, "recipe": recipe.name(), "batch": recipe.batch,
            "seq": None if recipe.model in ("mlp", "resnet18") else recipe.seq,
            "dtype": recipe.dtype, "optimizer": recipe.optimizer, "foreach": True,
            "checkpoint": recipe.checkpoint, "checkpoint_impl": recipe.checkpoint_impl, "attn_implementation":
                recipe.attention if recipe.model in ("gpt2", "bert-base", "tinyllama-1.1b") else None}
    if recipe.model in ("mlp", "resnet18"):
        meta["image_or_features"] = "3x224x224" if recipe.model == "resnet18" else MLP_DIMS[0]
    device = "cpu" if recipe.amp() else recipe.device
    return capture(model_fn, inputs_fn, loss_fn, optimizer_fn, recipe.iterations,
                   accum=recipe.accum, meta=meta, device=device, amp=recipe.amp(), sdpa=recipe.sdpa_backend(),
                   recompute_sdpa=recipe.checkpoint == "selective")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vramsim_capture.py",
        description="Record a PyTorch training step on the meta device as a vramsim JSON Lines trace.")
    ap.add_argument("--model", required=True, help=f"zoo model: {', '.join(ZOO)}")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (language models)")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    ap.add_argument("--checkpoint", default="none", choices=CHECKPOINTS,
                    help="full: every block; selective: the SDPA call only (needs --attention sdpa-*)")
    ap.add_argument("--checkpoint-impl", default="non-reentrant", choices=("non-reentrant", "reentrant"),
                    help="torch.utils.checkpoint's use_reentrant=False (default) or True")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--attention", default="eager",
                    choices=["eager"] + ["sdpa-" + b for b in SDPA_BACKENDS],
                    help="HF attention: eager, or SDPA with the CUDA backend pinned")
    ap.add_argument("--device", default="meta", choices=("meta", "cpu"),
                    help="meta tensors, or fake CPU tensors (amp-* dtypes always use cpu)")
    ap.add_argument("-o", "--output", required=True, help="trace file (.jsonl, or .jsonl.gz)")
    ap.add_argument("--summary", action="store_true", help="print the summary as JSON on stdout")
    a = ap.parse_args(argv)
    if torch is None:
        print("error: vramsim_capture needs torch: pip install torch", file=sys.stderr)
        return 2
    recipe = Recipe(a.model, a.batch, a.seq, a.dtype, a.optimizer, a.checkpoint, a.accum, a.iterations,
                    a.attention, a.device, a.checkpoint_impl)
    try:
        cap = capture_zoo(recipe)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cap.write(a.output)
    s = cap.summary()
    if a.summary:
        print(json.dumps(s, indent=1))
    else:
        print(f"{a.output}: {len(cap.events)} events, peak requested {s['peak_requested_bytes']} B "
              f"in {s['peak_phase']}, {cap.meta['params']} params, {cap.meta['capture_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
