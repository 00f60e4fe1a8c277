"""Resource pools: named sets of device slots reserved as Ray placement groups.

A pool is ``nodes x devices_per_node`` bundles. A bundle is one GPU (plus CPUs) on GPU clusters, or
``cpus_per_device`` CPUs on CPU machines. Bundles are ordered node by node, so consecutive ranks
(megatron's tensor-parallel groups) stay on one node. One node: one STRICT_PACK group. Several
nodes: one STRICT_PACK group per node (one device per node: a single STRICT_SPREAD group).

Before reserving anything the pool checks the cluster's nodes can hold it and fails fast with
what was asked and what exists; a reservation that stays pending (resources held by others) fails
after ``ready_timeout_s`` instead of hanging.

A pool without GPUs (``device: cpu``, or ``auto`` on a cluster without them) hides the node's GPUs from its
workers (:func:`worker_env`): Ray sets ``CUDA_VISIBLE_DEVICES`` only for actors it gives accelerators to (since
Ray 2.60 not for zero-GPU actors, ``ray/_private/utils.py: set_visible_accelerator_ids``), so on a GPU node its
ranks would otherwise find CUDA, join an NCCL world and build on GPU 0.

Ray is imported where a pool is reserved, not at import. The pool's configuration
(:class:`~megarl.controller.spec.PoolConfig`) lives in :mod:`megarl.controller.spec`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from megarl.controller.spec import Device, PoolConfig
from megarl.errors import ConfigError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

# what a CUDA or ROCm build of torch reads to find GPUs (Ray's NVIDIA and AMD accelerator managers set them)
_NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def worker_env(use_gpu: bool) -> dict[str, str]:
    """Environment of a pool's workers: one without GPUs sees none (then torch runs gloo on the CPU)."""
    return {} if use_gpu else dict(_NO_GPU)


class ResourcePool:
    """A reserved pool. ``bundles()`` lists (placement group, bundle index) in rank order."""

    def __init__(self, name: str, config: PoolConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.name = name
        self.config = config
        self.use_gpu = _resolve_device(config.device)
        self.bundle = {"CPU": config.cpus_per_device} | ({"GPU": 1.0} if self.use_gpu else {})
        self.env = worker_env(self.use_gpu)
        _check_feasible(name, config, self.bundle)
        per_node = [self.bundle] * config.devices_per_node
        if config.nodes == 1:
            self.groups = [placement_group(per_node, strategy="STRICT_PACK", name=f"megarl-{name}")]
        elif config.devices_per_node == 1:
            self.groups = [placement_group(per_node * config.nodes, strategy="STRICT_SPREAD", name=f"megarl-{name}")]
        else:
            self.groups = [
                placement_group(per_node, strategy="STRICT_PACK", name=f"megarl-{name}-node{i}")
                for i in range(config.nodes)
            ]
        ready, pending = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups),
                                  timeout=config.ready_timeout_s)
        if pending:
            self.release()
            raise ConfigError(
                f"resource pool {name!r} ({_describe(config, self.bundle)}) could not be reserved within "
                f"{config.ready_timeout_s:.0f} s: the resources exist but are held by other pools or jobs "
                f"(available now: {_fmt(ray.available_resources())}). Free them or shrink the pool."
            )

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def bundles(self) -> list[tuple[PlacementGroup, int]]:
        if len(self.groups) == 1:
            return [(self.groups[0], i) for i in range(self.world_size)]
        return [(g, i) for g in self.groups for i in range(self.config.devices_per_node)]

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g)
        self.groups = []


def _resolve_device(device: Device) -> bool:
    import ray

    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if device is Device.GPU and not has_gpu:
        raise ConfigError("a pool asks for GPUs (device: gpu) but the Ray cluster has none; use device: cpu or auto.")
    return device is Device.GPU or (device is Device.AUTO and has_gpu)


def _check_feasible(name: str, config: PoolConfig, bundle: dict[str, float]) -> None:
    """Fail fast when no arrangement of the cluster's nodes can ever hold the pool."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits = [min(int(res.get(k, 0) // v) for k, v in bundle.items()) for res in nodes]
    if config.nodes == 1 and config.devices_per_node > 1:
        ok = max(fits, default=0) >= config.devices_per_node
    else:
        ok = sum(f >= config.devices_per_node for f in fits) >= config.nodes
    if not ok:
        have = "; ".join(f"node {i}: {_fmt(res)}" for i, res in enumerate(nodes)) or "no alive nodes"
        raise ConfigError(
            f"resource pool {name!r} needs {_describe(config, bundle)}, which this Ray cluster can never "
            f"provide ({have}). Lower nodes/devices_per_node/cpus_per_device or add nodes."
        )


def _describe(config: PoolConfig, bundle: dict[str, float]) -> str:
    return f"{config.nodes} node(s) x {config.devices_per_node} bundle(s) of {_fmt(bundle)}"


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()) if k in ("CPU", "GPU"))
