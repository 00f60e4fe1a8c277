"""``auto`` layout sizes decided (issue #47 item 3; docs/planner.md §13): the policy's pool's ``tp``, ``pp``, ``ep``
and ``rollout.engine.tp`` set to ``auto`` become the layout the planner ranks first among those that fit.

:func:`decide_layout` is the one place this happens. It plans the policy's pool as ``tools/plan.py`` does: the
model's config.json, the pool's nodes x devices of ``device_memory_gb`` (null: the driver's GPU's memory), the run's
workload (:func:`workload`); it takes :func:`megarl.planner.propose`'s table (the layouts that fit, cheapest first:
what ``tools/plan.py`` prints) and chooses its first row that keeps every size the config fixes. The choice, its
rank, peak and the memory planned for are written to ``cluster.pools.NAME.auto_reason`` (the memory to
``device_memory_gb``), so the dumped config.yaml holds ints and reloads to the same run. When no row keeps the fixed
sizes it raises a ConfigError naming the planner's nearest miss (:func:`megarl.planner.closest` over the same
candidates) and what to change. :func:`megarl.config.checks.check_config` checks a config with its sizes decided;
:func:`megarl.config.resolve.resolve` decides them for the run.

The planner models the policy, a reference and a critic on the pool and a vLLM rollout engine colocated with them
(docs/planner.md §2, §6); a rollout pool of its own is planned by ``tools/plan.py --rollout-gpus``. Pure module: the
planner's arithmetic; torch only to read the driver's GPU memory when the pool does not give it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megarl.checkpoint.format import hf_files
from megarl.config.train import Role, TrainConfig
from megarl.controller.spec import Device, PoolSpec
from megarl.errors import ConfigError
from megarl.models.spec import load_hf_config, spec_from_hf_config
from megarl.parallel.layout import Auto, ParallelLayout
from megarl.planner import GB, Cluster, LayoutPlan, Workload, closest, propose
from megarl.planner import Role as PlannedRole
from megarl.rollout.config import RolloutBackend

ENGINE_TP = "rollout.engine.tp"


def decide_layout(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its ``auto`` layout sizes decided (``cfg`` itself when none is auto)."""
    name = cfg.cluster.pool_name(Role.POLICY)
    _refuse_elsewhere(cfg, name)
    pool, engine = cfg.cluster.pools.get(name), cfg.rollout.engine
    auto = [f"cluster.pools.{name}.{size}" for size in pool.auto_sizes] if pool is not None else []
    auto += [ENGINE_TP] if engine.tp is Auto.AUTO else []
    if not auto:
        return cfg
    if cfg.cluster.rollout_apart:
        raise ConfigError(f"{', '.join(auto)}: auto plans the rollout engines colocated with the policy, but "
                          f"cluster.placement.rollout puts them on a pool of their own. Set these sizes (python "
                          "tools/plan.py --rollout-gpus N ranks split layouts).")
    memory, source = _device_memory_gb(pool, name)
    spec = spec_from_hf_config(load_hf_config(hf_files(cfg.model.path)))
    cluster = Cluster(pool.nodes, pool.devices_per_node, memory)
    work = workload(cfg, cuda=pool.device is not Device.CPU)
    fixed = _fixed_sizes(cfg, pool)

    def keeps(layout: ParallelLayout, rollout_tp: int) -> bool:
        sizes = {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "cp": layout.cp, ENGINE_TP: rollout_tp}
        return all(sizes[k] == v for k, v in fixed.items())

    # named as set: what could have been auto, and cp or ep where they matter
    shown = {k: v for k, v in fixed.items() if not (k == "cp" or (k == "ep" and spec.moe is None)) or v != 1}
    where = (f"cluster.pools.{name} ({pool.nodes} x {pool.devices_per_node} devices of {memory:g} GB{source})"
             + (f" with {_sizes(shown)} as set" if shown else ""))
    model = Path(cfg.model.path).name
    table = propose(spec, cluster, work, vpp=pool.vpp, model_name=model)
    chosen = next((p for p in table if keeps(p.layout, p.rollout_tp)), None)
    if chosen is None:
        near = closest(spec, cluster, work, vpp=pool.vpp, model_name=model, where=keeps)
        raise ConfigError(_no_fit(auto, model, where, near, name, fewer=bool(shown)))
    rank = table.index(chosen) + 1
    peak = chosen.worst
    reason = (f"{', '.join(auto)} = auto: {chosen.layout} with rollout TP{chosen.rollout_tp}, the planner's rank "
              f"{rank} of {len(table)} fitting layouts on {where}"
              + (" (the first that keeps those)" if rank > 1 else "")
              + f"; peak {peak.total / GB:.1f} GB of {memory:g} GB per device ({peak.phase.value} phase, stage "
              f"{peak.stage}); the table: {_plan_command(cfg, pool, memory, work)}")
    lay = chosen.layout
    decided = dataclasses.replace(pool, tp=lay.tp, pp=lay.pp, vpp=lay.vpp, ep=lay.ep, device_memory_gb=memory,
                                  auto_reason=reason)
    tp = chosen.rollout_tp if engine.tp is Auto.AUTO else engine.tp
    return dataclasses.replace(
        cfg, cluster=dataclasses.replace(cfg.cluster, pools={**cfg.cluster.pools, name: decided}),
        rollout=dataclasses.replace(cfg.rollout, engine=dataclasses.replace(engine, tp=tp)))


def workload(cfg: TrainConfig, *, cuda: bool = True) -> Workload:
    """The planner's workload of the policy's pool: the roles on it the planner models (policy, reference,
    critic), the policy's precision (``auto``: bfloat16 on ``cuda`` devices), optimizer and micro-batches, the
    longest sequence (prompt + response, or a conversation's budget), the rollout engine's dtype, bucket and CUDA
    graphs; the planner's own default for the sequences each rollout replica decodes at once."""
    pool, p, r = cfg.cluster.pool_name(Role.POLICY), cfg.policy, cfg.rollout
    modelled = {role.value for role in PlannedRole}
    roles = tuple(PlannedRole(role.value) for role in cfg.roles()
                  if role.value in modelled and cfg.cluster.pool_name(role) == pool)
    response = r.multi_turn.max_total_tokens if r.multi_turn.enabled else r.max_new_tokens
    return Workload(
        roles=roles, precision=p.precision.resolve(cuda=cuda), distributed_optimizer=p.optim.use_distributed_optimizer,
        micro_batch_tokens=p.micro_batch.max_tokens, micro_batch_rows=p.micro_batch.max_size, packing=p.packing,
        prompt_tokens=cfg.data.max_prompt_length, response_tokens=response,
        rollout_dtype=r.engine.dtype.resolve(cuda=cuda).value, bucket_mb=r.engine.bucket_mb,
        enforce_eager=r.engine.enforce_eager, lora=p.lora)


def _plan_command(cfg: TrainConfig, pool: PoolSpec, memory: float, w: Workload) -> str:
    """The ``tools/plan.py`` command that prints the table the choice was made from."""
    args = [f"--hf-config {hf_files(cfg.model.path)}", f"--nodes {pool.nodes}",
            f"--gpus-per-node {pool.devices_per_node}", f"--gpu-mem-gb {memory:g}",
            f"--roles {','.join(r.value for r in w.roles)}", f"--precision {w.precision.value}",
            f"--micro-batch-tokens {w.micro_batch_tokens}", f"--micro-batch-rows {w.micro_batch_rows}",
            f"--prompt-tokens {w.prompt_tokens}", f"--response-tokens {w.response_tokens}",
            f"--rollout-dtype {w.rollout_dtype}", f"--bucket-mb {w.bucket_mb:g}"]
    args += [flag for flag, on in (("--no-packing", not w.packing), ("--enforce-eager", w.enforce_eager),
                                   ("--no-distributed-optimizer", not w.distributed_optimizer)) if on]
    if pool.vpp is not None:
        args.append(f"--vpp {pool.vpp}")
    if w.lora is not None:
        args += [f"--lora-rank {w.lora.rank}", f"--lora-targets {','.join(w.lora.targets)}"]
    return "python tools/plan.py " + " ".join(args)


def _fixed_sizes(cfg: TrainConfig, pool: PoolSpec) -> dict[str, int]:
    """The sizes the config sets, which the chosen layout keeps: the pool's tp, pp, ep not auto, its cp, and the
    rollout tp (the embedded engine's is 1: it runs one whole model per rank)."""
    fixed = {size: getattr(pool, size) for size in PoolSpec.AUTO_SIZES if size not in pool.auto_sizes}
    fixed["cp"] = pool.cp
    engine = cfg.rollout.engine
    if engine.tp is not Auto.AUTO:
        fixed[ENGINE_TP] = engine.tp
    elif engine.backend is RolloutBackend.EMBEDDED:
        fixed[ENGINE_TP] = 1
    return fixed


def _device_memory_gb(pool: PoolSpec, name: str) -> tuple[float, str]:
    """(GB per device, where it was read: "" for the config's ``device_memory_gb``)."""
    if pool.device_memory_gb is not None:
        return pool.device_memory_gb, ""
    import torch

    if pool.device is not Device.CPU and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return round(props.total_memory / GB, 2), f", read from the driver's {props.name}"
    raise ConfigError(f"cluster.pools.{name}: an auto layout size is chosen for the devices' memory, and the driver "
                      f"sees no GPU to read it from: set cluster.pools.{name}.device_memory_gb (decimal GB per "
                      "device, e.g. 80 for an 80 GB H100 or A100).")


def _refuse_elsewhere(cfg: TrainConfig, policy_pool: str) -> None:
    """``auto`` is planned for the policy's pool (the planner lays out the policy and what is colocated with it)."""
    for name, pool in cfg.cluster.pools.items():
        if name != policy_pool and pool.auto_sizes:
            raise ConfigError(f"cluster.pools.{name}.{pool.auto_sizes[0]}=auto: auto sizes are chosen for the "
                              f"policy's pool ({policy_pool!r}), which the planner lays out with what is colocated "
                              f"with it; set the sizes of pool {name!r}.")


def _no_fit(auto: list[str], model: str, where: str, near: LayoutPlan | None, name: str, *, fewer: bool) -> str:
    """What to tell when nothing fits: the nearest miss, by how much, and what to change (``fewer``: leaving more
    sizes auto may help)."""
    head = f"{', '.join(auto)} = auto: no layout of {model} fits {where}"
    if near is None:
        return f"{head}: none divides the model and the pool. Set other sizes or another number of devices."
    over = near.worst.total - near.capacity
    return (f"{head}. The planner's nearest miss is {near.layout} with rollout TP{near.rollout_tp}, {over / GB:.1f} GB "
            f"over per device: {near.reason}. To fit: more devices (cluster.pools.{name}.nodes), devices with more "
            "memory, a LoRA policy (policy.lora.rank), the reference or critic on a pool of their own "
            "(cluster.placement), a smaller micro-batch (policy.micro_batch.max_tokens) or shorter sequences "
            "(data.max_prompt_length, rollout.max_new_tokens)" + (", or fewer sizes set" if fewer else "")
            + ".")


def _sizes(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())
