"""Capture of a user's ``nn.Module`` as a vramsim graph (``from_module``), for lowering, not recording.

The forward (and the loss) runs on the meta device (no weights materialised, no GPU) under a
``TorchFunctionMode``, which sees each call at the level PyTorch module code writes it
(``F.linear``, ``F.conv2d``, ``F.batch_norm``, ``Tensor.view``, ``F.cross_entropy``, ...): the level of
the models crate's op library (``GraphBuilder::linear_op`` writes ``t`` + ``addmm`` and autocast's
argument casts itself). While a mode handles a call it is disabled (``torch/overrides.py``
``TorchFunctionMode``), so the calls a composite makes inside are not seen twice. A forward pre-hook
and hook on every module (``register_module_forward_pre_hook``) give each call its module path.

The batch size is a variable: the step is captured at the example batch ``B`` and at ``B + 1`` (dim 0
of every input resized); every integer of the calls' arguments that differs is written as
``{"b": k, "c": c}`` (``k * batch + c``). A forward whose calls depend on the batch otherwise is refused.

The JSON format (``"format": "vramsim-graph"``, version 1) is documented in ``models/README.md``.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

FORMAT = "vramsim-graph"
VERSION = 1

# Calls that only read metadata or return no tensor are not ops; these names are never recorded.
_IGNORED = {
    "size", "dim", "numel", "__get__", "__len__", "__format__", "__bool__", "__index__",
    "is_floating_point", "data_ptr", "requires_grad_", "__setstate__", "stride", "ndimension",
    "is_contiguous", "__repr__", "tolist", "item", "__hash__", "storage_offset", "element_size",
}


@functools.lru_cache(maxsize=None)
def autocast_policy(name: str) -> Optional[str]:
    """What CUDA autocast does with the arguments of ``aten::name`` (``lower``, ``fp32``, ``promote``),
    read off the installed wheel's ``AutocastCUDA`` kernel by the capture tool's ``cuda_autocast.probe``
    logic; ``None`` for an op without such a kernel (or one that is not an ATen op of that name)."""
    try:
        from ._capture import cuda_autocast
    except Exception:  # pragma: no cover - the package ships it; without torch nothing is captured
        return None
    if name not in _autocast_ops():
        return None
    try:
        policy = cuda_autocast._classify(name).policy
    except Exception:  # an op the probe cannot call: left uncast, as before
        return None
    return {
        "lower_precision_fp": "lower",
        "fp32": "fp32",
        "fp32_set_opt_dtype": "fp32",
        "fp32_append_dtype": "fp32",
        "promote": "promote",
    }.get(policy)


@functools.lru_cache(maxsize=1)
def _autocast_ops() -> frozenset:
    from ._capture import cuda_autocast

    return frozenset(cuda_autocast.autocast_ops("AutocastCUDA"))


class FromModuleError(TypeError):
    """A module or argument ``from_module`` cannot capture (the message names the argument)."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class _Capture:
    """One capture of the forward and loss at one batch size."""

    def __init__(self, torch: Any, model: Any, blocks: List[str], rules: Any = ()) -> None:
        self.blocks = set(blocks)
        self.block_calls: List[Dict[str, Any]] = []
        # Module calls: [first op, one past the last op, tensor arguments], by call.
        self.calls: List[List[Any]] = []
        self.call_stack: List[int] = []
        self.torch = torch
        self.model = model
        self.ids: Dict[int, int] = {}  # id(tensor) -> value id
        self.keep: List[Any] = []  # keeps captured tensors alive, so id() is never reused
        self.values: List[Dict[str, Any]] = []
        self.values_t: List[Any] = []  # the tensor of each value id
        self.storage_vid: Dict[int, int] = {}
        self.ops: List[Dict[str, Any]] = []
        self.stack: List[str] = []
        self.names: Dict[int, str] = {id(m): n for n, m in model.named_modules()}
        self.model_dtype = None
        # The calls the op library has a rule for (the others' backward is recorded too).
        self.rules = set(rules)
        # The tensor arguments of each module call in progress (innermost last).
        self.module_args: List[List[Any]] = []

    def value(self, t: Any, kind: str, **extra: Any) -> int:
        vid = len(self.values)
        self.ids[id(t)] = vid
        self.keep.append(t)
        self.values_t.append(t)
        # The newest value on each storage (views share one).
        self.storage_vid[t.untyped_storage()._cdata] = vid
        self.values.append(dict(kind=kind, shape=list(t.shape), dtype=self.dtype_of(t), **extra))
        return vid

    def dtype_of(self, t: Any) -> str:
        if t.is_floating_point() and t.dtype == self.model_dtype:
            return "model"
        return _dtype_name(t.dtype)

    def encode(self, a: Any) -> Any:
        torch = self.torch
        if isinstance(a, torch.Tensor):
            vid = self.ids.get(id(a))
            if vid is None:
                raise FromModuleError(
                    f"a tensor of shape {tuple(a.shape)} is neither a parameter, a buffer, an input nor "
                    "the result of a captured call (a plain tensor attribute? register it as a buffer)"
                )
            return {"t": vid}
        if isinstance(a, bool) or a is None or isinstance(a, (int, float, str)):
            return a
        if isinstance(a, (list, tuple)):
            return [self.encode(x) for x in a]
        if isinstance(a, torch.Size):
            return list(a)
        if isinstance(a, torch.dtype):
            # The model's own dtype is marked: a factory such as stochastic depth's
            # `torch.empty(size, dtype=input.dtype)` follows the model's precision. When it is the
            # dtype of the enclosing module's (first floating) input, that input is named too
            # (`"like"`): under autocast the input may be 16-bit while the parameters are not, and
            # `input.dtype` follows the input.
            out: Dict[str, Any] = {"dtype": _dtype_name(a)}
            if a == self.model_dtype:
                out["model"] = True
            held = self.module_args[-1] if self.module_args else []
            like = next((t for t in held if t.is_floating_point()), None)
            if like is not None and like.dtype == a and id(like) in self.ids:
                out["like"] = self.ids[id(like)]
            return out
        if isinstance(a, torch.memory_format):
            return {"memory_format": str(a).replace("torch.", "")}
        if isinstance(a, torch.device):
            return {"device": str(a)}
        if isinstance(a, slice):
            return {"slice": [self.encode(a.start), self.encode(a.stop), self.encode(a.step)]}
        return {"other": type(a).__name__}

    def tensor_args(self, args: Any, kwargs: Dict[str, Any]) -> List[Any]:
        """The call's tensor arguments that are captured values, in order, each once."""
        torch = self.torch
        found: List[Any] = []

        def walk(a: Any) -> None:
            if isinstance(a, torch.Tensor):
                if id(a) in self.ids and not any(a is f for f in found):
                    found.append(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    walk(x)
            elif isinstance(a, dict):
                for x in a.values():
                    walk(x)

        walk(list(args))
        walk(kwargs)
        return found

    def recording(self, name: str, ins: List[Any], outs: List[Any], packed: List[Any]) -> Dict[str, Any]:
        """What a call did, for ``from_module``'s fallback when vramsim has no rule for it:
        ``inputs`` (value ids), each output a view of input ``j`` (it lives on that input's
        storage; ``inplace`` when it is the argument itself) or a new tensor, the tensors autograd saved for it (one per storage: an input, an
        output, or a new tensor of the storage's size), and whether autograd made a node."""
        def key(t: Any) -> int:
            return t.untyped_storage()._cdata

        inputs = list(ins)
        in_keys = [key(t) for t in inputs]

        def dtype_rule(t: Any) -> Dict[str, Any]:
            # Like an input of the same floating dtype (under autocast the dtype that input has
            # then), else the dtype itself.
            if t.is_floating_point():
                for j, x in enumerate(inputs):
                    if x.is_floating_point() and x.dtype == t.dtype:
                        return {"like": j}
            return {"dtype": self.dtype_of(t)}

        out_specs = []
        for o in outs:
            k = key(o)
            if k in in_keys:
                j = in_keys.index(k)
                # The argument itself returned: an in-place op (`x.clamp_()`), not a view.
                # A view keeps the strides PyTorch gave it (a later reshape copies when they
                # do not allow a view).
                out_specs.append(
                    {"view": j, "inplace": True} if o is inputs[j] else {"view": j, "strides": list(o.stride())}
                )
            else:
                out_specs.append(dtype_rule(o))
        out_keys = [key(o) for o in outs]
        saved = []
        seen = set()
        for t in packed:
            if not isinstance(t, self.torch.Tensor):
                continue
            k = key(t)
            if k in seen:
                continue
            seen.add(k)
            self.keep.append(t)
            if k in out_keys:
                saved.append({"output": out_keys.index(k)})
            elif k in in_keys:
                saved.append({"input": in_keys.index(k)})
            elif k in self.storage_vid:
                # A captured value the call reached without taking it as an argument.
                inputs.append(self.values_t[self.storage_vid[k]])
                in_keys.append(k)
                saved.append({"input": len(inputs) - 1})
            else:
                item = t.element_size()
                saved.append({"shape": [t.untyped_storage().nbytes() // item], **dtype_rule(t)})
        rec = {
            "inputs": [self.ids[id(t)] for t in inputs],
            "outputs": out_specs,
            "saved": saved,
            "grad": any(o.grad_fn is not None for o in outs),
        }
        if name not in self.rules:
            backward = self.backward(inputs, outs, dtype_rule)
            if backward is not None:
                rec["backward"] = backward
            # Under torch.autocast the call's floating arguments are cast first, as its
            # AutocastCUDA kernel says (einsum: to the autocast dtype).
            policy = autocast_policy(name)
            if policy is not None:
                rec["autocast"] = policy
        return rec

    def backward(self, inputs: List[Any], outs: List[Any], dtype_rule: Any) -> Optional[Dict[str, Any]]:
        """The call's backward, run once with ``torch.autograd.grad`` (the graph retained, nothing
        accumulated into ``.grad``) under a dispatch mode that records every new storage: ``steps``,
        in order, ``{"alloc": [numel], dtype}`` and ``{"free": k}`` (allocation ``k`` died), and
        ``grads``, per input, the allocation that is its gradient (``{"alloc": k}``), the incoming
        gradient itself (``{"grad_output": 0}``), or ``None``."""
        torch = self.torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary
        import weakref

        diff_outs = [o for o in outs if o.grad_fn is not None and o.is_floating_point()]
        diff_ins = [j for j, x in enumerate(inputs) if x.requires_grad and x.is_floating_point()]
        # One differentiable output, the first, and not written in place into an argument (its
        # gradient with respect to that argument would be the output's own).
        if len(diff_outs) != 1 or diff_outs[0] is not outs[0] or not diff_ins:
            return None
        if any(o is x for o in outs for x in inputs):
            return None
        grad_out = torch.empty_like(outs[0])
        steps: List[Dict[str, Any]] = []
        seen = WeakIdKeyDictionary()  # storage -> the weak reference whose callback records its free
        alloc_keys: List[int] = []  # the storage key of each allocation, in order
        done = [False]

        def freed(k: int) -> None:
            if not done[0]:
                steps.append({"free": k})

        class Backward(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                known = set()
                for a in list(args) + list((kwargs or {}).values()):
                    for t in a if isinstance(a, (list, tuple)) else [a]:
                        if isinstance(t, torch.Tensor):
                            known.add(t.untyped_storage()._cdata)
                for t in out if isinstance(out, (list, tuple)) else [out]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    st = t.untyped_storage()
                    if st._cdata in known or st in seen or st.nbytes() == 0:
                        continue
                    k = len(alloc_keys)
                    alloc_keys.append(st._cdata)
                    seen[st] = weakref.ref(st, lambda _r, k=k: freed(k))
                    steps.append({"alloc": [st.nbytes() // t.element_size()], **dtype_rule(t)})
                return out

        try:
            with Backward():
                grads = torch.autograd.grad(
                    [outs[0]], [inputs[j] for j in diff_ins], [grad_out], retain_graph=True, allow_unused=True
                )
        except Exception:  # a backward that cannot run on meta: the default gradients are used
            return None
        # A live storage's key is that of its latest allocation (keys of dead ones may be reused).
        by_storage = {key: k for k, key in enumerate(alloc_keys)}
        grad_of: List[Any] = [None] * len(inputs)
        for j, g in zip(diff_ins, grads):
            if g is None:
                continue
            k = g.untyped_storage()._cdata
            if k == grad_out.untyped_storage()._cdata:
                grad_of[j] = {"grad_output": 0}
            elif k in by_storage:
                grad_of[j] = {"alloc": by_storage[k]}
        done[0] = True
        return {"steps": steps, "grads": grad_of}

    def outputs(self, out: Any) -> List[Any]:
        torch = self.torch
        if isinstance(out, torch.Tensor):
            return [out]
        if isinstance(out, (list, tuple)):
            return [o for o in out if isinstance(o, torch.Tensor)]
        return []

    def run(self, example_inputs: List[Any], targets: List[Any], loss_fn: Any) -> Dict[str, Any]:
        torch = self.torch
        from torch.overrides import TorchFunctionMode

        params = list(self.model.named_parameters())
        if params:
            self.model_dtype = params[0][1].dtype
        else:
            self.model_dtype = torch.float32
        doc: Dict[str, Any] = {"params": [], "buffers": [], "inputs": []}
        for name, p in params:
            vid = self.value(p, "param", name=name, trainable=bool(p.requires_grad))
            doc["params"].append(vid)
        # `model.to(device)` allocates each module's parameters, then its buffers: a buffer comes
        # after the parameters registered before it (pre-order of `named_modules`).
        seen_params = 0
        param_ids = {id(p) for _, p in params}
        for mname, m in self.model.named_modules():
            seen_params += sum(1 for p in m.parameters(recurse=False) if id(p) in param_ids)
            for bname, buf in m.named_buffers(recurse=False):
                if buf is None or id(buf) in self.ids:
                    continue
                full = f"{mname}.{bname}" if mname else bname
                doc["buffers"].append(self.value(buf, "buffer", name=full, after_params=seen_params))
        for i, x in enumerate(example_inputs):
            doc["inputs"].append(self.value(x, "input", name=f"input{i}"))
        for i, y in enumerate(targets):
            doc["inputs"].append(self.value(y, "input", name=f"target{i}"))

        cap = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", str(func))
                if name in _IGNORED:
                    return func(*args, **kwargs)
                # What autograd packs for the call's nodes (its saved tensors), for the recorded
                # fallback of calls without a rule.
                packed: List[Any] = []

                def pack(t: Any) -> Any:
                    packed.append(t)
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = func(*args, **kwargs)
                outs = cap.outputs(out)
                if not outs:
                    return out
                op = {
                    "op": name,
                    "module": cap.stack[-1] if cap.stack else "",
                    "args": cap.encode(list(args)),
                    "kwargs": {k: cap.encode(v) for k, v in kwargs.items()},
                }
                ins = cap.tensor_args(args, kwargs)
                op["recorded"] = cap.recording(name, ins, outs, packed)
                op["outputs"] = [cap.value(o, "op", op=len(cap.ops), index=i) for i, o in enumerate(outs)]
                cap.ops.append(op)
                return out

        def pre(module, args):
            name = self.names.get(id(module), "")
            self.stack.append(name)
            self.module_args.append([a for a in args if isinstance(a, torch.Tensor)])
            held = [self.ids[id(a)] for a in args if isinstance(a, torch.Tensor) and id(a) in self.ids]
            self.call_stack.append(len(self.calls))
            self.calls.append([len(self.ops), len(self.ops), held])
            if name in self.blocks and not any(b["module"] == name for b in self.block_calls):
                held = [self.ids[id(a)] for a in args if isinstance(a, torch.Tensor) and id(a) in self.ids]
                self.block_calls.append({"module": name, "args": held})

        def post(module, _args, _out):
            self.stack.pop()
            if self.module_args:
                self.module_args.pop()
            if self.call_stack:
                self.calls[self.call_stack.pop()][1] = len(self.ops)

        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        h1 = register_module_forward_pre_hook(pre)
        h2 = register_module_forward_hook(post)
        try:
            with Mode():
                self.stack = [""]
                try:
                    output = self.model(*example_inputs)
                except FromModuleError:
                    raise
                except Exception as e:  # the user's forward: say where it failed
                    raise FromModuleError(
                        f"example_inputs: model(*example_inputs) raised {type(e).__name__} on the meta "
                        f"device: {e}"
                    ) from e
                self.stack = []
                if not isinstance(output, torch.Tensor):
                    raise FromModuleError(
                        f"model(*example_inputs) returned {type(output).__name__}; from_module needs a tensor "
                        "(wrap the model to return one)"
                    )
                doc["output"] = self.ids[id(output)]
                doc["forward_ops"] = len(self.ops)
                if loss_fn is not None:
                    try:
                        loss = loss_fn(output, *targets)
                    except FromModuleError:
                        raise
                    except Exception as e:
                        raise FromModuleError(
                            f"loss_fn: loss_fn(output, *targets) raised {type(e).__name__}: {e}"
                        ) from e
                elif targets:
                    loss = torch.nn.functional.cross_entropy(output, targets[0])
                else:
                    loss = output.float().mean()
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise FromModuleError("loss_fn: must return a scalar tensor")
                doc["loss"] = self.ids[id(loss)]
        finally:
            h1.remove()
            h2.remove()
        doc["blocks"] = self.block_calls
        # Python keeps a call's arguments alive until it returns (the caller's frame holds them).
        doc["calls"] = [c for c in self.calls if c[2] and c[1] > c[0]]
        doc["values"] = self.values
        doc["ops"] = self.ops
        return doc


def default_blocks(torch: Any, model: Any) -> List[str]:
    """The checkpointable blocks: children of an ``nn.Sequential``/``nn.ModuleList`` that are not leaves
    and repeat (two or more siblings of one class), such as torchvision's ResNet ``BasicBlock``s or a
    transformer's layers (what ``--checkpoint full`` wraps, one ``torch.utils.checkpoint`` each), and
    not inside another such block."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, (torch.nn.Sequential, torch.nn.ModuleList)):
            continue
        children = list(m.named_children())
        counts: Dict[type, int] = {}
        for _, c in children:
            counts[type(c)] = counts.get(type(c), 0) + 1
        for cname, c in children:
            if counts[type(c)] >= 2 and any(True for _ in c.children()):
                out.append(f"{name}.{cname}" if name else cname)
    # A block inside another (RegNet's stages are Sequentials of blocks that hold Sequentials of
    # repeated layers) is not one of its own: checkpointing regions do not nest. The outermost stay.
    return [b for b in out if not any(b.startswith(o + ".") for o in out if o != b)]


def _resize_batch(torch: Any, t: Any, batch: int) -> Any:
    shape = list(t.shape)
    shape[0] = batch
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _symbolic(a: Any, b: Any, batch: int, path: str) -> Any:
    """Merge the captures at ``batch`` and ``batch + 1``: integers that differ become ``k * batch + c``."""
    if isinstance(a, bool) or isinstance(b, bool):
        if a != b:
            raise FromModuleError(f"the forward depends on the batch size beyond shapes ({path})")
        return a
    if isinstance(a, int) and isinstance(b, int):
        if a == b:
            return a
        k = b - a
        return {"b": k, "c": a - k * batch}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_symbolic(x, y, batch, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return {k: _symbolic(a[k], b[k], batch, f"{path}.{k}") for k in a}
    if a == b:
        return a
    raise FromModuleError(f"the forward depends on the batch size beyond shapes ({path}: {a!r} vs {b!r})")


def capture(
    model: Any,
    example_inputs: Any,
    loss_fn: Any = None,
    targets: Any = None,
    name: Optional[str] = None,
    blocks: Any = None,
    rules: Any = (),
) -> Dict[str, Any]:
    """The JSON graph document of ``model`` (see :func:`vramsim.from_module`); ``rules`` are the calls
    the op library has a rule for (the backward of the others is recorded for their fallback)."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("vramsim.from_module needs torch (pip install torch)") from e
    if not isinstance(model, torch.nn.Module):
        raise FromModuleError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = [example_inputs]
    if not isinstance(example_inputs, (list, tuple)) or not example_inputs or not all(
        isinstance(x, torch.Tensor) for x in example_inputs
    ):
        raise FromModuleError("example_inputs: expected a tensor or a non-empty list/tuple of tensors")
    if loss_fn is not None and not callable(loss_fn):
        raise FromModuleError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
    if name is not None and not isinstance(name, str):
        raise FromModuleError(f"name: expected a string, got {type(name).__name__}")
    if targets is None:
        targets = []
    elif isinstance(targets, torch.Tensor):
        targets = [targets]
    if not isinstance(targets, (list, tuple)) or not all(isinstance(y, torch.Tensor) for y in targets):
        raise FromModuleError("targets: expected a tensor or a list/tuple of tensors")
    for p in list(model.parameters()) + list(model.buffers()):
        if p.device.type != "meta":
            raise FromModuleError(
                "model: its parameters must be on the meta device (build it under `with torch.device('meta'):` "
                "or call model.to('meta')): no weights are materialised"
            )
    batch = int(example_inputs[0].shape[0]) if example_inputs[0].dim() else 0
    if batch < 1 or any(x.dim() == 0 or x.shape[0] != batch for x in list(example_inputs) + list(targets)):
        raise FromModuleError("example_inputs: dim 0 of every input and target is the batch and must agree")
    if blocks is None:
        blocks = default_blocks(torch, model)
    known = {n for n, _ in model.named_modules()}
    if isinstance(blocks, str) or not all(isinstance(b, str) and b in known for b in blocks):
        raise FromModuleError("blocks: expected a list of submodule names (model.named_modules())")
    default_ce = loss_fn is None and not targets
    model.train()
    docs = []
    for b in (batch, batch + 1):
        xs = [_resize_batch(torch, x, b) for x in example_inputs]
        ys = [_resize_batch(torch, y, b) for y in targets]
        if default_ce:
            # Classification-shaped output ([B, C] floats): F.cross_entropy against int64 labels.
            with torch.no_grad():
                try:
                    probe = model(*xs)
                except Exception as e:  # the user's forward: say where it failed
                    raise FromModuleError(
                        f"example_inputs: model(*example_inputs) raised {type(e).__name__} on the meta "
                        f"device: {e}"
                    ) from e
            if isinstance(probe, torch.Tensor) and probe.dim() == 2 and probe.is_floating_point():
                ys = [torch.empty([b], dtype=torch.int64, device="meta")]
        docs.append(_Capture(torch, model, list(blocks), rules).run(xs, ys, loss_fn))
    a, b2 = docs
    if len(a["ops"]) != len(b2["ops"]) or [o["op"] for o in a["ops"]] != [o["op"] for o in b2["ops"]]:
        raise FromModuleError("the forward runs different calls at batch sizes B and B+1; vramsim needs one graph")
    # A recorded backward whose steps differ between the two batches (a kernel that picks its path
    # by size) cannot be written per batch: that call keeps the default gradients.
    for oa, ob in zip(a["ops"], b2["ops"]):
        ba = oa.get("recorded", {}).get("backward")
        bb = ob.get("recorded", {}).get("backward")
        if ba is None and bb is None:
            continue
        shape = lambda bw: None if bw is None else ([sorted(x) for x in bw["steps"]], bw["grads"])  # noqa: E731
        same = ba is not None and bb is not None and shape(ba)[0] == shape(bb)[0] and ba["grads"] == bb["grads"]
        if not same or [x.get("free") for x in ba["steps"]] != [x.get("free") for x in bb["steps"]]:
            oa.get("recorded", {}).pop("backward", None)
            ob.get("recorded", {}).pop("backward", None)
    # A recording that differs between the two batches beyond sizes cannot be written per batch: it
    # is dropped (a call with a rule does not need it; one without is then listed as unsupported).
    for oa, ob in zip(a["ops"], b2["ops"]):
        try:
            _symbolic(oa.get("recorded"), ob.get("recorded"), batch, "recorded")
        except FromModuleError:
            oa.pop("recorded", None)
            ob.pop("recorded", None)
    merged = _symbolic(a, b2, batch, "graph")
    merged["format"] = FORMAT
    merged["version"] = VERSION
    merged["name"] = name or type(model).__name__
    merged["batch"] = batch
    return merged
