"""CUDA's autocast, applied to (fake) CPU tensors: record mixed-precision training steps without a GPU.

``torch.autocast`` works through one dispatch key per device (``AutocastCUDA``, ``AutocastCPU``, ...), and
each key has its own op lists (``aten/src/ATen/autocast_mode.cpp``): on CPU, ``layer_norm``, ``softmax``,
``exp``, ``sum`` stay in 16 bit where CUDA runs them in float32, and CPU casts ``cross_entropy_loss`` as a
whole where CUDA lets it decompose. The meta device has no autocast key at all. This module makes the CPU key
behave as CUDA's, so that a step run on fake CPU tensors (``FakeTensorMode``: no memory, no compute) under
``torch.autocast("cpu", dtype)`` performs the casts a CUDA run performs, in the same order.

Nothing in it is a hand-kept list of ops:

* **Which ops.** Exactly those that carry an ``AutocastCUDA`` kernel in the installed wheel
  (``torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA")``). Ops with only an ``AutocastCPU``
  kernel get a fallthrough, as they have on CUDA: they run uncast and the ops they decompose into still see
  autocast (``cross_entropy_loss`` → ``log_softmax`` with the input's own dtype, then ``nll_loss``).
* **What each op does.** :func:`probe` calls each op's ``AutocastCUDA`` kernel itself (``OpOverload.redispatch``
  with only that key) on fake *CUDA* tensors, which that kernel takes as eligible (``is_autocast_eligible``:
  ``tensor.is_cuda()``), and watches what it does below autocast with a dispatch mode: which arguments it
  casts to which dtype, whether it fills in ``dtype=float``, which overload it calls, whether it refuses. The
  outcome is one of the ``CastPolicy`` values of ``aten/src/ATen/autocast_mode.h``:

  ``lower_precision_fp``  every eligible tensor argument cast to the autocast dtype;
  ``fp32``                every eligible tensor argument cast to float32;
  ``fp32_set_opt_dtype``  no cast; the optional ``dtype`` argument set to float32 when the caller left it unset
                          and the first argument is eligible (an explicit dtype is kept);
  ``fp32_append_dtype``   the call redirected to the overload that takes a ``dtype``, with float32 appended;
  ``promote``             every eligible tensor argument cast to the widest floating type among them and the
                          autocast dtype;
  ``banned``              the kernel raises (``binary_cross_entropy``), and so does the emulation, with its text.

* **How a cast is made** is ``cached_cast`` (``autocast_mode.cpp``): only floating, non-double tensors of the
  autocast device are eligible; a cast to the autocast dtype of a float32 leaf that requires grad (and is not a
  view) is cached while the cache is enabled, keyed by the tensor, until the outermost autocast region exits
  (``torch.autocast.__exit__`` → ``torch.clear_autocast_cache()``: also at the end of each recomputation of
  ``torch.utils.checkpoint``, which re-enters autocast); every other cast is a fresh ``.to(dtype)``. The op then
  runs with the autocast key excluded, so composite ops are not cast again inside.

One kernel-level difference is not a cast policy: ``at::softmax``/``at::log_softmax`` (``SoftMax.cpp``), given a
CUDA Half tensor and ``dtype=float``, call the fused ``_softmax(x, dim, half_to_float=True)`` instead of
converting the input first; for a CPU tensor they convert. :func:`install` takes CUDA's branch for the
``softmax.int``/``log_softmax.int`` kernels (the fp32_set_opt_dtype path is the one that produces that call).

Use::

    import cuda_autocast
    with cuda_autocast.installed():
        with FakeTensorMode(...), torch.autocast("cpu", dtype=torch.float16):
            ...

:func:`installed` restores the wheel's own ``AutocastCPU`` kernels when it exits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import functools
import weakref
from typing import Any, Iterator

try:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - the module imports without torch so that tests can skip
    torch = None  # type: ignore[assignment]
    TorchDispatchMode = object  # type: ignore[assignment,misc]

POLICIES = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")


def autocast_ops(key: str = "AutocastCUDA") -> list[str]:
    """The ``aten`` ops (``name`` or ``name.overload``) that have a kernel for ``key`` in the installed wheel."""
    out = []
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            out.append(name[len("aten::"):])
    return sorted(out)


def _overload(name: str) -> Any:
    base, _, ov = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), ov or "default")


# --------------------------------------------------------------------------------------------------
# Probing the wheel's AutocastCUDA kernels
# --------------------------------------------------------------------------------------------------

class _Reached(Exception):
    """Raised by :class:`_Watch` at the first op below autocast that is not a cast: the probe has seen enough."""


class _Watch(TorchDispatchMode):
    """Below the autocast kernel under probe: records the casts (``_to_copy``), stops at the op it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[tuple[Any, Any]] = []
        self.reached: tuple[Any, tuple, dict] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.casts.append((args[0].dtype, kwargs.get("dtype")))
            return func(*args, **kwargs)
        if func.namespace == "prim":  # prim.device and friends: metadata queries
            return func(*args, **kwargs)
        self.reached = (func, args, kwargs)
        raise _Reached


def _sample_args(schema: Any, tensor: Any) -> tuple[list, dict]:
    """Arguments that type-check against ``schema``: every required argument gets a value, tensors come from
    ``tensor()``, optional arguments keep their defaults (so ``dtype`` is left unset)."""
    args: list = []
    kwargs: dict = {}
    for a in schema.arguments:
        if a.has_default_value():
            continue
        t = str(a.type)
        if t in ("Tensor", "Optional[Tensor]"):
            v: Any = tensor()
        elif t.startswith("List[") and "Tensor" in t:
            v = [tensor(), tensor()]
        elif t in ("int", "SymInt"):
            v = 1
        elif t in ("List[int]", "List[SymInt]"):
            v = [1]
        elif t == "float":
            v = 0.5
        elif t == "bool":
            v = False
        elif t == "number":
            v = 2.0
        elif t == "str":
            v = "ij,jk->ik" if a.name == "equation" else "fro"
        elif t == "ScalarType":
            v = torch.float32
        elif t.startswith("Optional["):
            v = None
        else:
            raise TypeError(f"no sample value for argument {a.name}: {t}")
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    return args, kwargs


def _run_cuda_kernel(name: str, dtypes: tuple, autocast_dtype: Any) -> tuple[_Watch, Exception | None]:
    """Call ``name``'s AutocastCUDA kernel on fake CUDA tensors under ``autocast_dtype``: the first tensor
    argument has ``dtypes[0]``, the others ``dtypes[1]``. Returns what the kernel did below autocast, and the
    error it raised (its own refusal, or the op's complaint about the sample arguments) if any."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = _overload(name)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
    saved = torch.get_autocast_dtype("cuda")
    torch.set_autocast_dtype("cuda", autocast_dtype)
    made = []

    def tensor() -> Any:
        made.append(None)
        return torch.empty(4, 4, dtype=dtypes[0] if len(made) == 1 else dtypes[1], device="cuda")

    watch = _Watch()
    error = None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args, kwargs = _sample_args(op._schema, tensor)
            try:
                with watch:
                    op.redispatch(keys, *args, **kwargs)
            except _Reached:
                pass
            except Exception as e:  # noqa: BLE001 - the kernel refused (banned op) or the sample did not fit
                error = e
    finally:
        torch.set_autocast_dtype("cuda", saved)
    return watch, error


@dataclass
class Policy:
    """What the wheel's AutocastCUDA kernel of one op does (see the module docstring)."""

    op: str
    policy: str
    #: fp32_append_dtype: the overload the kernel calls instead (``norm.Scalar`` → ``norm.ScalarOpt_dtype``)
    target: str | None = None
    #: banned: the kernel's error text
    message: str | None = None


def _has_opt_dtype(schema: Any) -> bool:
    # ScalarType is an int in TorchScript schemas: ``ScalarType? dtype`` reads ``Optional[int]``
    return any(a.name == "dtype" and str(a.type) == "Optional[int]" for a in schema.arguments)


def _passes_float(reached: tuple[Any, tuple, dict]) -> bool:
    """The reached op was asked for a float32 result: ``dtype=float`` given, or CUDA's fused softmax."""
    func, args, kwargs = reached
    if kwargs.get("dtype") is torch.float32 or any(a is torch.float32 for a in args):
        return True
    return func in (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default) and args[2] is True


def _classify(name: str) -> Policy:
    f16, f32 = torch.float16, torch.float32
    a, err = _run_cuda_kernel(name, (f32, f32), f16)
    if err is not None and "autocast" in str(err) and not a.casts:
        return Policy(name, "banned", message=str(err).split("\n")[0])
    if (f32, f16) in a.casts:
        return Policy(name, "lower_precision_fp")
    b, _ = _run_cuda_kernel(name, (f16, f16), f16)
    if (f16, f32) in b.casts:
        return Policy(name, "fp32")
    schema = _overload(name)._schema
    if b.reached is not None and _passes_float(b.reached):
        if _has_opt_dtype(schema):
            return Policy(name, "fp32_set_opt_dtype")
        func = b.reached[0]
        called = func._schema.name.split("::")[1]
        if called == name.partition(".")[0]:
            return Policy(name, "fp32_append_dtype",
                          target=called + ("." + func._overloadname if func._overloadname != "default" else ""))
    c, _ = _run_cuda_kernel(name, (f16, f32), f16)
    if (f16, f32) in c.casts:
        return Policy(name, "promote")
    if _has_opt_dtype(schema) and not a.casts and not b.casts and not c.casts:
        # No cast whatever the inputs, and not banned: of the five CastPolicy values only
        # fp32_set_opt_dtype is left (linalg_matrix_norm: its fp16 check fires before any op we could watch).
        return Policy(name, "fp32_set_opt_dtype")
    raise RuntimeError(f"the AutocastCUDA kernel of aten::{name} does something this module does not model "
                       f"(fp32 inputs: casts {a.casts}, reached {a.reached and a.reached[0]}; fp16 inputs: "
                       f"casts {b.casts}, reached {b.reached and b.reached[0]}, error {err})")


@functools.lru_cache(maxsize=None)
def probe() -> dict[str, Policy]:
    """The policy of every op with an AutocastCUDA kernel in the installed wheel, read off the kernels."""
    out = {}
    for name in autocast_ops("AutocastCUDA"):
        try:
            out[name] = _classify(name)
        except (RuntimeError, TypeError) as e:
            out[name] = Policy(name, "unknown", message=str(e))
    return out


# --------------------------------------------------------------------------------------------------
# The emulation on the AutocastCPU key
# --------------------------------------------------------------------------------------------------


def _no_autocast() -> Any:
    """``ExcludeDispatchKeyGuard no_autocast(AutocastCPU)``: the op runs below autocast."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _eligible(t: Any) -> bool:
    """``is_eligible`` of ``autocast_mode.h`` for the CPU key: a defined floating tensor of the CPU device, not
    double."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == "cpu")


class CastCache:
    """``cached_cast``'s cache (``autocast_mode.cpp``, ``get_cached_casts``): keyed by the source tensor, it
    holds the cast alive until :meth:`clear` (the outermost ``torch.autocast`` exit)."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[Any, Any]] = {}

    def cast(self, to: Any, t: Any) -> Any:
        """``cached_cast(to, t)``: lists element by element; ineligible tensors and other values unchanged."""
        if isinstance(t, (list, tuple)):
            return type(t)(self.cast(to, x) for x in t)
        if not _eligible(t) or t.dtype == to:
            return t
        # "Do what Apex does, and cache lower_precision_fp casts of fp32 model weights (leaves)."
        can_try_cache = (to == torch.get_autocast_dtype("cpu") and t.dtype == torch.float32
                         and t.requires_grad and t.is_leaf and not t._is_view()
                         and torch.is_autocast_cache_enabled())
        if not can_try_cache:
            return t.to(to)
        hit = self._casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(to)
        self._casts[id(t)] = (weakref.ref(t), out)
        return out

    def clear(self) -> None:
        self._casts.clear()

    def __len__(self) -> int:
        return len(self._casts)


def _first_tensor(args: Any) -> Any:
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def _prioritize(args: Any, kwargs: Any) -> Any:
    """``promote_type``/``prioritize`` of ``autocast_mode.h``: start at the autocast dtype; float32 wins over
    it; doubles are ignored; any other floating type is an error."""
    lower = torch.get_autocast_dtype("cpu")
    current = lower
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if not _eligible(t):
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif not (current == lower and t.dtype == lower):
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _kernel(p: Policy, cache: CastCache) -> Any:
    """The AutocastCPU kernel that does what ``p`` says the AutocastCUDA kernel does."""
    op = _overload(p.op)
    if p.policy == "lower_precision_fp":
        def kernel(*args: Any, **kwargs: Any) -> Any:
            to = torch.get_autocast_dtype("cpu")
            args = [cache.cast(to, a) for a in args]
            kwargs = {k: cache.cast(to, v) for k, v in kwargs.items()}
            with _no_autocast():
                return op(*args, **kwargs)
    elif p.policy == "fp32":
        def kernel(*args: Any, **kwargs: Any) -> Any:
            args = [cache.cast(torch.float32, a) for a in args]
            kwargs = {k: cache.cast(torch.float32, v) for k, v in kwargs.items()}
            with _no_autocast():
                return op(*args, **kwargs)
    elif p.policy == "fp32_set_opt_dtype":
        pos = [a.name for a in op._schema.arguments].index("dtype")
        fused = {"softmax.int": torch.ops.aten._softmax.default,
                 "log_softmax.int": torch.ops.aten._log_softmax.default}.get(p.op)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            args = list(args)
            if _eligible(_first_tensor(args)):
                # set_opt_dtype: `dtype.has_value() ? dtype : at::kFloat` (an explicit dtype is kept)
                if len(args) > pos:
                    if args[pos] is None:
                        args[pos] = torch.float32
                    dtype = args[pos]
                else:
                    kwargs = dict(kwargs)
                    if kwargs.get("dtype") is None:
                        kwargs["dtype"] = torch.float32
                    dtype = kwargs["dtype"]
                if fused is not None and args[0].dtype == torch.float16 and dtype == torch.float32:
                    # SoftMax.cpp, softmax()/log_softmax(): `input_.is_cuda() && input_.scalar_type() == Half
                    # && dtype == Float` → at::_softmax(input_, dim_, /*half_to_float=*/true), no fp32 copy.
                    with _no_autocast():
                        return fused(args[0], args[1], True)
            with _no_autocast():
                return op(*args, **kwargs)
    elif p.policy == "fp32_append_dtype":
        target = _overload(p.target)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            first = _first_tensor(args)
            # type_from_firstarg(device, at::kFloat, args...)
            to = torch.float32 if _eligible(first) else first.dtype
            with _no_autocast():
                return target(*args, **kwargs, dtype=to)
    elif p.policy == "promote":
        def kernel(*args: Any, **kwargs: Any) -> Any:
            to = _prioritize(args, kwargs)
            args = [cache.cast(to, a) for a in args]
            kwargs = {k: cache.cast(to, v) for k, v in kwargs.items()}
            with _no_autocast():
                return op(*args, **kwargs)
    elif p.policy == "banned":
        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(p.message)
    else:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"aten::{p.op} under CUDA's autocast is not emulated: {p.message}")
    return kernel


@contextlib.contextmanager
def installed() -> Iterator[CastCache]:
    """Within the block, the ``AutocastCPU`` key does what the wheel's ``AutocastCUDA`` key does (see the
    module docstring); on exit the wheel's own CPU kernels are back. Yields the cast cache."""
    import warnings

    policies = probe()
    cuda = set(policies)
    cpu_only = [n for n in autocast_ops("AutocastCPU") if n not in cuda]
    cache = CastCache()
    lib = torch.library.Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        # torch.autocast.__exit__ calls this when the outermost region exits (autocast_decrement_nesting() == 0)
        cache.clear()
        original_clear()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*previously registered.*")
        for name, p in sorted(policies.items()):
            lib.impl(name, _kernel(p, cache), "AutocastCPU")
        for name in cpu_only:
            lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    torch.clear_autocast_cache = clear_autocast_cache
    _ACTIVE.append((policies, cache))
    try:
        yield cache
    finally:
        _ACTIVE.pop()
        torch.clear_autocast_cache = original_clear
        lib._destroy()


_ACTIVE: list[tuple[dict[str, Policy], CastCache]] = []  # set while installed()


def below_autocast() -> Any:
    """A guard under which ops run below the (CPU) autocast key, as an autocast kernel runs its op."""
    return _no_autocast()


def autocast_args(op: str, *args: Any) -> tuple:
    """``args`` as ``op``'s CUDA autocast kernel would pass them on: cast by its policy (lower_precision_fp,
    fp32 or promote) when CPU autocast is enabled and the emulation is installed, else unchanged. For code that
    calls a kernel below an autocast op itself (the capture's pinned SDPA)."""
    if not _ACTIVE or not torch.is_autocast_enabled("cpu"):
        return args
    policies, cache = _ACTIVE[-1]
    p = policies[op]
    if p.policy == "lower_precision_fp":
        to = torch.get_autocast_dtype("cpu")
    elif p.policy == "fp32":
        to = torch.float32
    elif p.policy == "promote":
        to = _prioritize(args, {})
    else:
        raise ValueError(f"autocast_args: aten::{op} has policy {p.policy}, which casts no arguments")
    return tuple(cache.cast(to, a) for a in args)
