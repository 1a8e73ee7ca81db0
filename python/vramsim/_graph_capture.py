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
    # `probe()` reads every op once per process (cached) and is first run before the recorder's
    # emulation registers its CPU kernels (`installed()` calls it first), so the reading does not
    # depend on which recordings ran before; an op the probe cannot call is "unknown": left uncast.
    found = cuda_autocast.probe().get(name)
    if found is None:
        return None
    policy = found.policy
    return {
        "lower_precision_fp": "lower",
        "fp32": "fp32",
        "fp32_set_opt_dtype": "fp32",
        "fp32_append_dtype": "fp32",
        "promote": "promote",
    }.get(policy)


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
        self.last_live: Dict[int, int] = {}
        # Non-tensor keyword arguments (`use_cache=False`), passed as they are.
        self.constants: Dict[str, Any] = {}
        self.frame: Any = None

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
        if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
            # JSON has no inf/nan (`masked_fill(mask, float("-inf"))`): written as a string.
            return {"float": repr(a)}
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

    def run(
        self, example_inputs: List[Any], targets: List[Any], loss_fn: Any, keywords: Optional[List[str]] = None
    ) -> Dict[str, Any]:
        torch = self.torch
        import sys

        self.frame = sys._getframe()
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
            iname = keywords[i] if keywords is not None else f"input{i}"
            doc["inputs"].append(self.value(x, "input", name=iname))
        for i, y in enumerate(targets):
            doc["inputs"].append(self.value(y, "input", name=f"target{i}"))

        cap = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", str(func))
                if name in ("__bool__", "item") and args and cap.is_meta_truth(args[0]):
                    return cap.truth(args[0], name)
                if name in _IGNORED:
                    return func(*args, **kwargs)
                cap.note_live()
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
                if name == "__getitem__" and len(args) == 2:
                    args = (args[0], _expand_ellipsis(args[0], args[1]))
                op = {
                    "op": name,
                    "module": cap.stack[-1] if cap.stack else "",
                    "args": cap.encode(list(args)),
                    "kwargs": {k: cap.encode(v) for k, v in kwargs.items()},
                }
                ins = cap.tensor_args(args, kwargs)
                op["recorded"] = cap.recording(name, ins, outs, packed)
                if name == "tensor":
                    cap.note_dtype_like(op)
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
                    if keywords is not None:
                        output = self.model(**dict(zip(keywords, example_inputs)), **self.constants)
                    else:
                        output = self.model(*example_inputs)
                except FromModuleError:
                    raise
                except Exception as e:  # the user's forward: say where it failed
                    raise FromModuleError(
                        f"example_inputs: model(*example_inputs) raised {type(e).__name__} on the meta "
                        f"device: {e}"
                    ) from e
                self.stack = []
                returned = output
                output, hf_loss = _model_output(torch, output, loss_fn, targets)
                if hf_loss is not None:
                    # The model computed its loss (transformers with `labels`, nanoGPT with
                    # targets): the forward is the whole step's graph; the loop reads the loss.
                    # With `keep_outputs` the loop also holds what the model returned
                    # (`outputs = model(**batch)`, `logits, loss = model(X, Y)`): `kept`.
                    doc["output"] = doc["loss"] = self.ids[id(hf_loss)]
                    doc["forward_ops"] = len(self.ops)
                    kept: Dict[int, None] = {}
                    self._returned(returned, kept, 0)
                    doc["kept"] = [v for v in kept if v != doc["loss"]]
                    output = None
                elif not isinstance(output, torch.Tensor):
                    raise FromModuleError(
                        f"model(*example_inputs) returned {type(output).__name__}; from_module needs a tensor, "
                        "or a transformers ModelOutput with `logits` (or `loss`, given `labels`)"
                    )
                else:
                    doc["output"] = self.ids[id(output)]
                    doc["forward_ops"] = len(self.ops)
                if output is None:
                    pass
                elif loss_fn is not None:
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
                if output is None:
                    pass
                elif not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise FromModuleError("loss_fn: must return a scalar tensor")
                else:
                    doc["loss"] = self.ids[id(loss)]
        finally:
            h1.remove()
            h2.remove()
        doc["blocks"] = self.block_calls
        # Python keeps a call's arguments alive until it returns (the caller's frame holds them).
        doc["calls"] = [c for c in self.calls if c[2] and c[1] > c[0]]
        doc["values"] = self.values
        doc["ops"] = self.ops
        doc["held"] = self.held_by_locals()
        return doc

    # ------------------------------------------------------------------ data-dependent branches
    # transformers tests its inputs' values on the way: `padding_mask.all()` (an all-ones
    # attention_mask is dropped for SDPA, `_ignore_causal_mask_sdpa`), `(packed_sequence_mask[:, -1]
    # == 0).all()` (consecutive position ids: not packed, `find_packed_sequence_indices`). A meta
    # tensor has no values: the capture answers for the batch the zoo models — no padding, no packed
    # sequences —, i.e. `all()` is True and `any()` is False; any other truth test is refused.

    def made_by(self, t: Any) -> Optional[str]:
        vid = self.ids.get(id(t))
        if vid is None or "op" not in self.values[vid]:
            return None
        return self.ops[self.values[vid]["op"]]["op"]

    def is_meta_truth(self, t: Any) -> bool:
        return isinstance(t, self.torch.Tensor) and t.device.type == "meta" and t.numel() == 1

    def truth(self, t: Any, name: str) -> Any:
        made_by = self.made_by(t)
        if made_by == "__eq__":
            # transformers' `fast_all(mask)`: `mask.sum() == mask.numel()`, an all().
            op = self.ops[self.values[self.ids[id(t)]]["op"]]
            lhs = op["args"][0] if op["args"] else None
            src = lhs.get("t") if isinstance(lhs, dict) else None
            if src is not None and "op" in self.values[src] and self.ops[self.values[src]["op"]]["op"] == "sum":
                made_by = "all"
        if made_by not in ("all", "any"):
            raise FromModuleError(
                f"the forward branches on a tensor's value ({made_by or 'a tensor'} then {name}), which "
                "the meta device does not have; only all()/any() of masks are answered (no padding)"
            )
        answer = made_by == "all"
        return answer if name == "__bool__" else int(answer)

    # ------------------------------------------------------------------ Python locals
    # A tensor lives while Python references it, not only until its last use: `residual =
    # hidden_states`, `inputs_embeds` in `GPT2Model.forward`, a `DynamicCache`'s k/v. Before each
    # call, the frames of the model's code (from the caller up to `run`) are scanned for captured
    # tensors in their locals (one level into tuples, lists, dicts — ModelOutputs — and
    # transformers' cache objects); each value is held until the last call it was seen live at.

    def note_live(self) -> None:
        import sys

        k = len(self.ops)
        f = sys._getframe(2)
        while f is not None and f is not self.frame:
            for v in list(f.f_locals.values()):
                self._mark(v, k, 0)
            f = f.f_back

    def _mark(self, v: Any, k: int, depth: int) -> None:
        torch = self.torch
        if isinstance(v, torch.Tensor):
            vid = self.ids.get(id(v))
            if vid is not None and self.values[vid]["kind"] == "op":
                self.last_live[vid] = k
            return
        if depth >= 4 or isinstance(v, (str, bytes, int, float, torch.nn.Module)):
            return
        if isinstance(v, (list, tuple)) and len(v) <= 4096:
            for x in v:
                self._mark(x, k, depth + 1)
        elif isinstance(v, dict) and len(v) <= 4096:
            for x in list(v.values()):
                self._mark(x, k, depth + 1)
        elif type(v).__module__.startswith("transformers.cache_utils"):
            for x in list(vars(v).values()):
                self._mark(x, k, depth + 1)

    def note_dtype_like(self, op: Dict[str, Any]) -> None:
        """transformers' ``DynamicLayer.lazy_initialization(key_states, value_states)`` (cache_utils.py)
        makes ``keys`` and ``values`` as ``torch.tensor([], dtype=key_states.dtype)``: the dtype is the
        keys' (float32 after RoPE under autocast, bfloat16 for GPT-2), not the model's, whatever the
        capture's dtype says. Recorded as ``dtype_like``."""
        import sys

        f = sys._getframe(2)
        if f.f_code.co_name == "lazy_initialization" and "key_states" in f.f_locals:
            key = f.f_locals["key_states"]
            if isinstance(key, self.torch.Tensor) and id(key) in self.ids:
                op["kwargs"]["dtype_like"] = {"t": self.ids[id(key)]}

    def _returned(self, v: Any, out: Dict[int, None], depth: int) -> None:
        """The captured tensors in what the forward returned (in order, once each)."""
        torch = self.torch
        if isinstance(v, torch.Tensor):
            vid = self.ids.get(id(v))
            if vid is not None and self.values[vid]["kind"] == "op":
                out[vid] = None
        elif depth < 4 and isinstance(v, (list, tuple)):
            for x in v:
                self._returned(x, out, depth + 1)
        elif depth < 4 and isinstance(v, dict):
            for x in list(v.values()):
                self._returned(x, out, depth + 1)
        elif depth < 4 and type(v).__module__.startswith("transformers.cache_utils"):
            for x in list(vars(v).values()):
                self._returned(x, out, depth + 1)

    def held_by_locals(self) -> List[List[Any]]:
        """``[[call index, [value ids]]]``: values a Python local holds while that call runs, each at
        the last such call."""
        by_op: Dict[int, List[int]] = {}
        for vid, k in sorted(self.last_live.items()):
            by_op.setdefault(k, []).append(vid)
        return [[k, by_op[k]] for k in sorted(by_op)]


def _expand_ellipsis(x: Any, index: Any) -> Any:
    """``x[..., 1:]`` as ``x[:, 1:]`` for a 2-D ``x``: the ellipsis written as the full slices it
    stands for (``Ellipsis`` has no encoding of its own)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(1 for i in items if i is Ellipsis) != 1:
        return index
    at = items.index(Ellipsis)
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    fill = [slice(None)] * max(x.dim() - used, 0)
    return tuple(items[:at] + fill + items[at + 1 :])


def _model_output(torch: Any, output: Any, loss_fn: Any, targets: List[Any]) -> Any:
    """``(output tensor, model-computed loss)`` of what the forward returned. A transformers
    ``ModelOutput`` (a dict subclass) that holds a ``loss`` — the model was given ``labels``, as
    HF's Trainer and the zoo's ``--loss hf`` train (``ForCausalLMLoss``, ``ForMaskedLMLoss``) — gives
    that loss, unless ``loss_fn``/``targets`` ask for another; otherwise its ``logits`` are the output."""
    if isinstance(output, (tuple, list)) and output and loss_fn is None and not targets:
        # `logits, loss = model(X, Y)` (nanoGPT's GPT.forward): a scalar last element is the loss
        # the model computed.
        last = output[-1]
        if isinstance(last, torch.Tensor) and last.dim() == 0 and last.is_floating_point():
            return None, last
    if isinstance(output, torch.Tensor) or not isinstance(output, dict):
        return output, None
    loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss_fn is None and not targets:
        return None, loss
    logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits, None
    return output, None


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


def _resize(torch: Any, t: Any, batch: int, seq: Optional[int], dims: List[int]) -> Any:
    shape = list(t.shape)
    shape[0] = batch
    for d in dims:
        shape[d] = seq
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
    dynamic_dims: Any = None,
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
    # Keyword inputs (`model(**batch)`, as transformers models are called): names in order.
    keywords: Optional[List[str]] = None
    constants: Dict[str, Any] = {}
    if isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise FromModuleError("example_inputs: a dict's keys must be the forward's argument names")
        constants = {k: v for k, v in example_inputs.items() if not isinstance(v, torch.Tensor)}
        keywords = [k for k in example_inputs if k not in constants]
        example_inputs = [example_inputs[k] for k in keywords]
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
    seq_dims, seq = _seq_dims(dynamic_dims, keywords, list(example_inputs) + list(targets))
    if seq_dims:
        # Every integer is fitted as c + b·B + s·S + bs·B·S + s2·S² + bs2·B·S² (a view's B·S, the
        # attention scores' S²): two batches × three lengths, checked at a seventh point.
        points = [(b, t) for t in (seq, seq + 1, seq + 2) for b in (batch, batch + 1)]
        points.append((batch + 2, seq + 3))
    else:
        points = [(batch, None), (batch + 1, None)]
    model.train()
    restore = _capture_dtype(torch, model)
    try:
        docs = _capture_at(
            torch, model, example_inputs, targets, loss_fn, (keywords, constants, seq_dims), blocks, points, default_ce, rules
        )
    finally:
        if restore is not None:
            model.to(restore)
    if seq_dims:
        _same_calls(docs, "at batch sizes B, B+1 and sequence lengths S, S+1, S+2")
        _prune_recordings(docs, lambda xs: _fit(xs, batch, seq, "recorded"))
        merged = _fit(docs, batch, seq, "graph")
        merged["version"] = 2
        merged["seq"] = seq
    else:
        merged = _merge(docs, batch)
        merged["version"] = VERSION
    merged["format"] = FORMAT
    merged["name"] = name or type(model).__name__
    merged["batch"] = batch
    return merged


def _seq_dims(dynamic_dims: Any, keywords: Optional[List[str]], tensors: List[Any]) -> Any:
    """``([(tensor index, dim)], example seq)`` from ``dynamic_dims`` (``{input: {dim: "seq"}}``,
    an input named by its keyword or by its position in inputs then targets)."""
    if dynamic_dims is None:
        return [], None
    if not isinstance(dynamic_dims, dict) or not dynamic_dims:
        raise FromModuleError('dynamic_dims: expected {input: {dim: "seq"}}, e.g. {"input_ids": {1: "seq"}}')
    out = []
    for key, dims in dynamic_dims.items():
        if isinstance(key, str) and keywords is not None and key in keywords:
            i = keywords.index(key)
        elif isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(tensors):
            i = key
        else:
            valid = keywords if keywords is not None else list(range(len(tensors)))
            raise FromModuleError(f"dynamic_dims: {key!r} is not an input (valid: {valid})")
        if not isinstance(dims, dict) or not dims:
            raise FromModuleError(f'dynamic_dims[{key!r}]: expected {{dim: "seq"}}')
        for d, var in dims.items():
            if var != "seq":
                raise FromModuleError(f'dynamic_dims[{key!r}]: {var!r} is not a variable (valid: "seq"; dim 0 is the batch)')
            if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d < tensors[i].dim():
                raise FromModuleError(f"dynamic_dims[{key!r}]: dim {d!r} is not a dim 1..{tensors[i].dim() - 1} of the input")
            out.append((i, d))
    sizes = {int(tensors[i].shape[d]) for i, d in out}
    if len(sizes) != 1:
        raise FromModuleError(f"dynamic_dims: the seq dims have different sizes {sorted(sizes)}")
    return out, sizes.pop()


def _same_calls(docs: List[Dict[str, Any]], where: str) -> None:
    names = [o["op"] for o in docs[0]["ops"]]
    for d in docs[1:]:
        if [o["op"] for o in d["ops"]] != names:
            raise FromModuleError(f"the forward runs different calls {where}; vramsim needs one graph")


_TERMS = ("c", "b", "s", "bs", "s2", "bs2")


def _poly(vals: List[int], batch: int, seq: int) -> Any:
    """The integer polynomial in (b, s) through ``vals`` at the capture points, ``None`` where there is
    none (with integer coefficients, confirmed at the seventh point)."""
    alphas = []
    for j in (0, 1):  # b = batch + j: a quadratic in s through s = seq, seq + 1, seq + 2
        f0, f1, f2 = vals[j], vals[2 + j], vals[4 + j]
        d2 = f2 - 2 * f1 + f0
        if d2 % 2:
            return None
        a2 = d2 // 2
        a1 = (f1 - f0) - a2 * (2 * seq + 1)
        alphas.append((f0 - a1 * seq - a2 * seq * seq, a1, a2))
    terms = {}
    for i, (lo, hi) in enumerate((("c", "b"), ("s", "bs"), ("s2", "bs2"))):
        q = alphas[1][i] - alphas[0][i]
        terms[lo], terms[hi] = alphas[0][i] - q * batch, q
    b, s = batch + 2, seq + 3
    if sum(terms[k] * x for k, x in zip(_TERMS, (1, b, s, b * s, s * s, b * s * s))) != vals[6]:
        return None
    if all(terms[k] == 0 for k in _TERMS[1:]):
        return terms["c"]
    return {k: terms[k] for k in _TERMS if k == "c" or terms[k]}


def _fit(xs: List[Any], batch: int, seq: int, path: str) -> Any:
    """Merge the captures at the seven points: integers that differ become polynomials in batch and
    seq; anything else must agree."""
    a = xs[0]
    if any(isinstance(x, bool) for x in xs) or not all(isinstance(x, int) for x in xs):
        if isinstance(a, list) and all(isinstance(x, list) and len(x) == len(a) for x in xs):
            return [_fit([x[i] for x in xs], batch, seq, f"{path}[{i}]") for i in range(len(a))]
        if isinstance(a, dict) and all(isinstance(x, dict) and x.keys() == a.keys() for x in xs):
            return {k: _fit([x[k] for x in xs], batch, seq, f"{path}.{k}") for k in a}
        if all(x == a for x in xs):
            return a
        raise FromModuleError(f"the forward depends on the batch or seq beyond shapes ({path}: {a!r} vs {xs[1]!r})")
    if all(x == a for x in xs):
        return a
    p = _poly(xs, batch, seq)
    if p is None:
        raise FromModuleError(
            f"{path}: {xs} is not an integer polynomial in batch and seq (degree 1 in batch, 2 in seq)"
        )
    return p


def _capture_dtype(torch: Any, model: Any) -> Any:
    """A transformers model in float32 is captured in bfloat16 (on the meta device: nothing is
    allocated), so its explicit float32 casts — ``hidden_states.to(torch.float32)`` in RMSNorm,
    ``logits.float()``, the rotary frequencies — stay float32 in the graph while the model's own
    dtype is ``model`` (``.to(input_dtype)``) and follows ``--precision``; code that branches on a
    16-bit weight (T5's ``T5LayerNorm``: ``if self.weight.dtype in [float16, bfloat16]``) records the
    cast back to the model's dtype, which is the tensor itself at fp32. Returns the dtype to restore."""
    if not type(model).__module__.startswith("transformers."):
        return None
    params = list(model.parameters())
    if not params or params[0].dtype != torch.float32:
        return None
    model.to(torch.bfloat16)
    return torch.float32


def _capture_at(torch, model, example_inputs, targets, loss_fn, named, blocks, points, default_ce, rules):
    """The documents at each ``(batch, seq)`` of ``points``; ``named``: keyword names of the inputs
    (``None`` for positional ones), the non-tensor keyword arguments and the seq dims."""
    keywords, constants, seq_dims = named
    n = len(example_inputs)
    docs = []
    for b, s in points:
        xs = [_resize(torch, x, b, s, [d for i, d in seq_dims if i == k]) for k, x in enumerate(example_inputs)]
        ys = [_resize(torch, y, b, s, [d for i, d in seq_dims if i == n + k]) for k, y in enumerate(targets)]
        if default_ce and keywords is None:
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
        cap = _Capture(torch, model, list(blocks), rules)
        cap.constants = constants
        docs.append(cap.run(xs, ys, loss_fn, keywords))
    return docs


def _prune_recordings(docs: List[Dict[str, Any]], merge: Any) -> None:
    """Drop the fallback recordings that cannot be written as functions of the variables: a recorded
    backward whose steps differ between the captures (a kernel that picks its path by size) keeps the
    default gradients; a recording that differs beyond sizes is dropped (a call with a rule does not
    need it; one without is then listed as unsupported). ``merge`` merges one value across the docs."""
    for ops in zip(*(d["ops"] for d in docs)):
        bws = [o.get("recorded", {}).get("backward") for o in ops]
        if all(bw is None for bw in bws):
            continue
        first = bws[0]

        def same(bw: Any) -> bool:
            return (
                first is not None
                and bw is not None
                and [sorted(x) for x in bw["steps"]] == [sorted(x) for x in first["steps"]]
                and bw["grads"] == first["grads"]
                and [x.get("free") for x in bw["steps"]] == [x.get("free") for x in first["steps"]]
            )

        if not all(same(bw) for bw in bws):
            for o in ops:
                o.get("recorded", {}).pop("backward", None)
    for ops in zip(*(d["ops"] for d in docs)):
        try:
            merge([o.get("recorded") for o in ops])
        except FromModuleError:
            for o in ops:
                o.pop("recorded", None)


def _merge(docs: List[Dict[str, Any]], batch: int) -> Dict[str, Any]:
    """Merge the captures at ``batch`` and ``batch + 1``."""
    a, b2 = docs
    if len(a["ops"]) != len(b2["ops"]) or [o["op"] for o in a["ops"]] != [o["op"] for o in b2["ops"]]:
        raise FromModuleError("the forward runs different calls at batch sizes B and B+1; vramsim needs one graph")
    _prune_recordings(docs, lambda xs: _symbolic(xs[0], xs[1], batch, "recorded"))
    return _symbolic(a, b2, batch, "graph")
