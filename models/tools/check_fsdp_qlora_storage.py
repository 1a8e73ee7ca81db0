"""Check, on PyTorch itself, what FSDP2 does with FSDP-QLoRA's parameters (``lower/fsdp.rs``).

Two gloo processes on the CPU, no bitsandbytes: a block holds what a ``Linear4bit`` with PEFT's
LoRA holds as parameters — the packed codes of a 64 × 64 weight, frozen, stored as bitsandbytes'
``quant_storage`` packs them (``(n + 1) // (2 * itemsize)`` rows of one element), a frozen bf16
norm weight, and trainable float32 ``lora_A`` [8, 64] and ``lora_B`` [64, 8] — and the quant state
(absmax) as a plain attribute, neither parameter nor buffer, as bitsandbytes keeps it.
``fully_shard`` on the block and on the root. Printed on rank 0, for bf16 and uint8 storage:
each parameter's local shard (shape, dtype), the all-gather output of the block (dtype, numel),
the reduce dtype ``_get_reduce_dtype`` picks, and that the quant-state attribute is untouched.

PyTorch 2.15 prints, for bf16 codes: the codes' shard ``[512, 1]`` bfloat16 (1024 rows over 2
ranks), the norm's ``[32]`` bfloat16, ``lora_A`` ``[4, 64]`` and ``lora_B`` ``[32, 8]`` float32;
the block's all-gather output ``torch.uint8`` of 2 × (512·2 + 32·2 + 256·4 + 256·4) = 6,272
bytes (mixed dtypes are gathered as bytes); the reduce dtype float32; the absmax attribute
whole. For uint8 codes (``[2048, 1]``): the same, the codes' shard ``[1024, 1]`` uint8, so plain
``fully_shard`` on 2.15 shards them too (accelerate ≥ 1.14 passes them as ``ignored_params``
instead, which is what vramsim models for uint8).

With bitsandbytes importable (0.50.2, its CPU backend), the same is run on a real
``Linear4bit(64, 64, quant_type="nf4", quant_storage=...)`` with float32 LoRA A/B, forward and
backward included: both storages run, the weight's shard is ``[512, 1]`` bfloat16 or
``[1024, 1]`` uint8, and the module's ``quant_state.absmax`` stays whole (``[64]``).

    python3 models/tools/check_fsdp_qlora_storage.py
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg


class QLoraBlock(nn.Module):
    """The parameters of a Linear4bit(64, 64) with LoRA r 8, and an RMSNorm weight."""

    def __init__(self, storage):
        super().__init__()
        n = 64 * 64
        rows = (n + 1) // (2 * storage.itemsize)
        self.codes = nn.Parameter(torch.zeros(rows, 1, dtype=storage), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(64, dtype=torch.bfloat16), requires_grad=False)
        self.lora_A = nn.Parameter(torch.randn(8, 64))
        self.lora_B = nn.Parameter(torch.randn(64, 8))
        # bitsandbytes' QuantState: an attribute, not registered with the module.
        self.absmax = torch.ones(n // 64)

    def forward(self, x):
        base = x * self.norm.float() + self.codes.float().sum() * 0.0
        return base + x @ (self.lora_B @ self.lora_A).t()


def run(rank, storage_name):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29543")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    storage = getattr(torch, storage_name)
    model = nn.Sequential(QLoraBlock(storage), nn.Linear(64, 8))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    log = []
    unshard, reduce_dtype = pg.FSDPParamGroup.unshard, pg.FSDPParamGroup._get_reduce_dtype

    def logged_unshard(self, async_op=False):
        out = unshard(self, async_op)
        r = self._all_gather_result
        if r is not None and self._module_fqn == "0":
            o = r.all_gather_output
            log.append(("all_gather_output", str(o.dtype), o.numel()))
        return out

    def logged_reduce_dtype(self, params, grads):
        d = reduce_dtype(self, params, grads)
        log.append(("reduce_dtype", self._module_fqn, str(d)))
        return d

    pg.FSDPParamGroup.unshard = logged_unshard
    pg.FSDPParamGroup._get_reduce_dtype = logged_reduce_dtype
    shards = [
        (name, list(p.to_local().shape), str(p.dtype)) for name, p in model[0].named_parameters()
    ]
    x = torch.randn(4, 64)
    model(x).sum().backward()
    if rank == 0:
        print(f"quant_storage {storage_name}:")
        for s in shards:
            print("  shard", *s)
        for e in log:
            print(" ", *e)
        print("  absmax attribute", list(model[0].absmax.shape), "whole")
    dist.destroy_process_group()


class BnbBlock(nn.Module):
    """A bitsandbytes Linear4bit(64, 64) (NF4, the given quant_storage) with float32 LoRA A/B."""

    def __init__(self, storage):
        super().__init__()
        from bitsandbytes.nn import Linear4bit

        q = Linear4bit(
            64,
            64,
            bias=False,
            quant_type="nf4",
            compress_statistics=False,
            quant_storage=storage,
            compute_dtype=torch.bfloat16,
        )
        q.weight.data = torch.randn(64, 64, dtype=torch.bfloat16)
        self.q = q.to("cpu")  # quantizes (Params4bit._quantize)
        self.lora_A = nn.Parameter(torch.randn(8, 64))
        self.lora_B = nn.Parameter(torch.randn(64, 8))

    def forward(self, x):
        return self.q(x) + (x.float() @ (self.lora_B @ self.lora_A).t()).to(x.dtype)


def run_bnb(rank, storage_name):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(BnbBlock(getattr(torch, storage_name)), nn.Linear(64, 8))
    model[1].to(torch.bfloat16).requires_grad_(False)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    shards = [
        (name, list(p.to_local().shape), str(p.dtype)) for name, p in model[0].named_parameters()
    ]
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    if rank == 0:
        print(f"bitsandbytes Linear4bit, quant_storage {storage_name}: forward and backward ran")
        for s in shards:
            print("  shard", *s)
        print("  quant_state.absmax", list(model[0].q.quant_state.absmax.shape), "whole")
    dist.destroy_process_group()


if __name__ == "__main__":
    for i, storage_name in enumerate(["bfloat16", "uint8"]):
        os.environ["MASTER_PORT"] = str(29543 + i)
        mp.spawn(run, args=(storage_name,), nprocs=2)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        print("bitsandbytes not installed: the Linear4bit check is skipped")
    else:
        for i, storage_name in enumerate(["bfloat16", "uint8"]):
            os.environ["MASTER_PORT"] = str(29553 + i)
            mp.spawn(run_bnb, args=(storage_name,), nprocs=2)
