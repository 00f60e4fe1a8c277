"""The tensor collectives megarl issues itself (megatron-core issues its own): each runs on the world's
collective device, :func:`megarl.parallel.init.comm_device`, whatever device its tensor lives on.

Under NCCL a collective takes CUDA tensors only: a CPU tensor raises "No backend type associated with device
type cpu". gloo takes CPU tensors, so a CPU run cannot show a statistic kept on the host (router loads in
float64, step metrics, counts) reaching a GPU run's collective. Every tensor megarl reduces goes through
:func:`all_reduce`, which moves it to the collective device when it is elsewhere (a few bytes of statistics),
reduces it there and writes the result back in place; a tensor already there is reduced as it is. Object
collectives (``all_gather_object``, ``broadcast_object_list``) and ``barrier`` choose their device
themselves (torch's ``_get_object_coll_device``, ``_get_pg_default_device``) and are called directly; the
weight transfer's point-to-point messages carry the model's own tensors (:mod:`megarl.resharding.transport`).

Imports torch.distributed; no megatron-core.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.parallel import init


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (default: the world) on the collective device; returns it."""
    return _reduce(tensor, op, (group,))


def sum_over(tensor: torch.Tensor, *groups: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over each of ``groups`` in turn, moved to the collective device once (in place)."""
    return _reduce(tensor, dist.ReduceOp.SUM, groups)


def _reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, groups: tuple) -> torch.Tensor:
    device = init.comm_device()  # looked up at call time: megarl's one notion of it, one seam for tests
    work = tensor if tensor.device == device else tensor.to(device)
    for group in groups:
        dist.all_reduce(work, op=op, group=group)
    return tensor if work is tensor else tensor.copy_(work)
