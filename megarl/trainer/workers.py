"""The run's workers, seen from the driver: one colocated pool hosting policy (with its rollout engine),
reference, critic and reward model, behind typed methods the trainer calls. The pool is Ray worker
processes, or (``cluster.launcher: local``) one rank in the driver process itself.

Owns Ray start-up, the one-time HF -> Megatron conversion of the starting model and of the reward
model (in a child process, so the driver never joins a torch.distributed world, except with the local
launcher, where the driver hosts the rank anyway), and the dispatch
mode of each call (data-parallel shards for forward passes and updates, all ranks for checkpoints).
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
from pathlib import Path

from megarl.checkpoint import mcore_io
from megarl.controller import allocator
from megarl.controller.handles import GroupOptions
from megarl.controller.placement import Placement, PlacementConfig, PoolSpec
from megarl.controller.pools import Device
from megarl.data.batch import Batch
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.trainer.config import TrainConfig
from megarl.workers.critic import CriticConfig, CriticRole, RewardModelRole
from megarl.workers.policy import PolicyConfig, PolicyRole, ReferenceRole

logger = logging.getLogger(__name__)

_QUIET_WORKERS = {"PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning",
                  "TOKENIZERS_PARALLELISM": "false"}


class Workers:
    def __init__(self, cfg: TrainConfig, out: Path, tokenizer) -> None:
        self.cfg = cfg
        self.source = initial_checkpoint(cfg, out)
        rm = cfg.reward_model
        self.reward_source = (megatron_checkpoint(Path(rm.path), out / "reward_model_checkpoint", cfg)
                              if rm is not None else None)
        c, a = cfg.cluster, cfg.algorithm
        local = c.launcher == "local"
        if not local:
            import ray

            if not ray.is_initialized():
                ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True, include_dashboard=False)
        pool = PoolSpec(nodes=c.nodes, devices_per_node=c.devices_per_node, device=Device(c.device),
                        cpus_per_device=c.cpus_per_device, tp=c.tp, pp=c.pp, vpp=c.vpp)
        roles = {"policy": "actor"} | ({"reference": "actor"} if a.needs_reference else {}) | (
            {"critic": "actor"} if a.needs_critic else {}) | (
            {"reward_model": "actor"} if cfg.reward_model is not None else {})
        env = _QUIET_WORKERS | allocator.preload_env(c.allocator)  # workers on a running Ray cluster too
        options = GroupOptions(seed=cfg.trainer.seed, env=env)
        self.placement = Placement(PlacementConfig({"actor": pool}, roles), options, local=local)
        logger.info("host allocator of the driver process: %s", allocator.loaded())
        try:
            self._add_roles(cfg)
        except BaseException:
            self.placement.shutdown()
            raise
        eos = tokenizer.eos_token_id
        eos_ids = (eos,) if cfg.rollout.stop_at_eos and eos is not None else ()
        self.stop_token_ids = tuple(dict.fromkeys(eos_ids + cfg.rollout.stop_token_ids))

    def _add_roles(self, cfg: TrainConfig) -> None:
        r, a, src = cfg.rollout, cfg.algorithm, str(self.source)
        rollout = RolloutConfig(  # logprob_check: rollout vs training log-probs, after generation or in the update
            backend=r.backend, tp=r.tp, dtype=r.dtype, bucket_mb=r.bucket_mb, max_batch_size=r.max_batch_size,
            logprob_check=True, max_logprob_abs_diff=r.max_logprob_abs_diff, offload_train_state=r.offload_train_state,
            gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_mb=r.kv_cache_mb, max_model_len=r.max_model_len,
            enforce_eager=r.enforce_eager, seed=cfg.trainer.seed)
        policy = PolicyConfig(loss=a.policy_loss, entropy_coef=a.entropy_coef, temperature=r.temperature,
                              kl_loss_coef=a.kl_loss_coef, kl_estimator=a.kl_estimator,
                              recompute_old_log_probs=a.recomputes_old_log_probs)
        self.policy = self.placement.add_role("policy", PolicyRole, src, cfg.policy, policy, True, rollout)
        self.reference = (self.placement.add_role("reference", ReferenceRole, src, cfg.policy, r.temperature)
                          if a.needs_reference else None)
        self.critic = (self.placement.add_role("critic", CriticRole, src, cfg.critic, CriticConfig(a.value_clip))
                       if a.needs_critic else None)
        self.reward_model = (self.placement.add_role("reward_model", RewardModelRole, str(self.reward_source),
                                                     cfg.reward_model.engine())
                             if cfg.reward_model is not None else None)

    # ------------------------------------------------------------------------------------- calls

    def generate(self, prompts: Batch, params: SamplingParams, baseline: SamplingParams | None = None) -> Batch:
        return self.policy.dp(PolicyRole.generate, prompts, params, baseline)

    def reward_scores(self, batch: Batch) -> Batch:
        """``scores`` [B] of the reward model (``input_ids``, right-padded ``attention_mask``)."""
        return self.reward_model.dp(RewardModelRole.compute_scores, batch)

    def reference_log_probs(self, batch: Batch) -> Batch:
        return self.reference.dp(ReferenceRole.compute_log_probs, batch)

    def values(self, batch: Batch) -> Batch:
        return self.critic.dp(CriticRole.compute_values, batch)

    def update_policy(self, batch: Batch) -> dict[str, float]:
        return self.policy.dp_split(PolicyRole.update, batch)[0]  # metrics are reduced over DP already

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.critic.dp_split(CriticRole.update, batch)[0]

    def memory_peaks(self) -> dict[str, float]:
        """Peak memory of the busiest worker process since the previous call."""
        per_rank = self.policy.all(PolicyRole.memory_peaks)
        return {k: max(r[k] for r in per_rank) for k in per_rank[0]}

    def save(self, ckpt_dir: Path, step: int) -> None:
        self.policy.all(PolicyRole.save_checkpoint, str(ckpt_dir / "policy"), step, str(self.source))
        if self.critic is not None:
            self.critic.all(CriticRole.save_checkpoint, str(ckpt_dir / "critic"), step, str(self.source))

    def load(self, ckpt_dir: Path) -> None:
        self.policy.all(PolicyRole.load_checkpoint, str(ckpt_dir / "policy"))
        if self.critic is not None:
            self.critic.all(CriticRole.load_checkpoint, str(ckpt_dir / "critic"))

    def shutdown(self) -> None:
        self.placement.shutdown()


def initial_checkpoint(cfg: TrainConfig, out: Path) -> Path:
    """The Megatron checkpoint the run starts from: ``model.path`` itself if it is one, else a one-time
    conversion of the HF directory into ``<output_dir>/initial_checkpoint`` (reused on resume)."""
    return megatron_checkpoint(Path(cfg.model.path), out / "initial_checkpoint", cfg)


def megatron_checkpoint(path: Path, target: Path, cfg: TrainConfig) -> Path:
    """``path`` itself if it is a megarl checkpoint, else a one-time conversion of the HF directory into
    ``target`` at the cluster's layout (reused when ``target`` is complete)."""
    if (path / mcore_io.META_FILE).is_file():
        return path
    if (target / mcore_io.META_FILE).is_file():
        return target
    logger.info("converting %s to a Megatron checkpoint (tp=%d, pp=%d) in %s", path, cfg.cluster.tp, cfg.cluster.pp,
                target)
    if cfg.cluster.launcher == "local":  # this process joins a world of one anyway: no second torch process
        _convert(str(path), str(target), cfg.cluster.tp, cfg.cluster.pp)
        return target
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(_convert, str(path), str(target), cfg.cluster.tp, cfg.cluster.pp).result()
    return target


def _convert(src: str, dst: str, tp: int, pp: int) -> None:
    from megarl.checkpoint.convert import convert_hf_to_megatron

    convert_hf_to_megatron(src, dst, tp=tp, pp=pp)
