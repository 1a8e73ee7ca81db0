"""Check, on PyTorch itself, what FSDP2 does with a frozen prefix in backward (``lower/fsdp.rs``).

Two gloo processes on the CPU: ``nn.Sequential(Linear, Block × 4, Linear)`` with the first linear
and blocks 0-1 frozen, ``fully_shard`` on every block and on the root. ``FSDPParamGroup.unshard``
and ``FSDPParamGroup.finalize_backward`` are wrapped to log, on rank 0, each unshard (group and
training state) and whether a group reaches ``finalize_backward`` with an ``_all_gather_result``.

Groups are named by their index in the ``Sequential`` (block k is ``k+1``, the root ``''``). PyTorch
2.15 prints: in backward the root, then ``4`` and ``3`` twice each (the prefetch by the group after
it, then its own pre-backward), then ``2`` once — the prefetch of block 1, the last frozen block,
whose backward never runs — and only ``2`` reaches ``finalize_backward`` with its all-gather result
still set (the "mistargeted unshard" it drops).

    python3 models/tools/check_fsdp_frozen_prefetch.py
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg


class Block(nn.Module):
    """A residual linear block."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


def run(rank):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), *[Block() for _ in range(4)], nn.Linear(64, 8))
    for m in model[:3]:
        for p in m.parameters():
            p.requires_grad_(False)
    for b in model[1:5]:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    log = []
    unshard, finalize = pg.FSDPParamGroup.unshard, pg.FSDPParamGroup.finalize_backward

    def logged_unshard(self, async_op=False):
        log.append(("unshard", self._module_fqn, self._training_state.name))
        return unshard(self, async_op)

    def logged_finalize(self):
        log.append(("finalize_backward", self._module_fqn, self._all_gather_result is not None))
        return finalize(self)

    pg.FSDPParamGroup.unshard = logged_unshard
    pg.FSDPParamGroup.finalize_backward = logged_finalize
    loss = model(torch.randn(4, 64)).sum()
    log.append(("backward",))
    loss.backward()
    if rank == 0:
        for entry in log:
            print(*entry)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
