"""A role's training checkpoint: model + optimizer + LR schedule + RNG, saved with dist-checkpointing.

A training checkpoint directory has the same layout as a converted one (``megarl_checkpoint.json``,
``hf/``, ``weights/``), so it loads into any TP/PP layout for inference and converts back to HF with
tools/convert_megatron_to_hf.py; ``weights/`` additionally holds the optimizer state (in the
layout-independent "fully reshardable" form for the distributed optimizer, so a different DP size
can load it) and ``trainer_state.json`` the step, LR-schedule state and per-rank RNG states.

A LoRA engine's checkpoint holds its adapters and their optimizer state only (the base weights are frozen: they
are the source checkpoint's, recorded as ``CheckpointMeta.lora.base``). It resumes into an engine built from that
base, as the trainer builds its roles; it is no model (``format.check_full_model``) and exports merged or as a
peft adapter (:mod:`megarl.checkpoint.lora_export`).

Writes are atomic: every rank writes into one temporary sibling directory; rank 0 renames it into
place after a barrier, so a crash never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.checkpoint import mcore_io
from megarl.checkpoint.atomic import check_output_dir
from megarl.checkpoint.format import HF_SUBDIR, WEIGHTS_SUBDIR, LoRAMeta, read_meta, weights_dir, write_meta
from megarl.errors import CheckpointError
from megarl.models import adapters
from megarl.models.spec import Head, as_head
from megarl.parallel import cpu_compat, mcore_compat

if TYPE_CHECKING:
    from megarl.engine.config import LoRAConfig
    from megarl.engine.engine import MegatronEngine

TRAINER_STATE = "trainer_state.json"
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _trained(engine: MegatronEngine):
    """Which checkpoint keys a LoRA engine trains (None: every key): its adapters, and a critic's scalar head,
    which trains whole."""
    if engine.lora is None:
        return None
    head = engine.spec.head is Head.SCALAR
    return lambda key: adapters.is_adapter(key) or (head and key == "output_layer.weight")


def _sharded_state(engine: MegatronEngine, *, is_loading: bool) -> dict:
    # the unwrapped chunks (not DDP): same structure as a converted checkpoint; same Parameter objects. A LoRA
    # engine's trained tensors only: its optimizer holds nothing else, and the frozen base is the source checkpoint's
    model_sd = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(engine.chunks)}
    trained = _trained(engine)
    if trained is not None:
        model_sd = {c: {k: v for k, v in sd.items() if trained(k)} for c, sd in model_sd.items()}
    return model_sd | {
        "optimizer": engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA)
    }


@cpu_compat.redirected  # megatron-core's distributed checkpointing and optimizer
def save_training_checkpoint(engine: MegatronEngine, out_dir: str | Path, *, step: int, source_dir: str | Path) -> Path:
    """Collective. Writes ``out_dir`` atomically; ``source_dir`` is the checkpoint the run started
    from (its metadata and hf/ files are carried over)."""
    out_dir = Path(out_dir)
    _init_optimizer_state(engine)  # a run that has not updated yet (every step skipped) has none to save
    tmp = [None]
    if dist.get_rank() == 0:
        check_output_dir(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = [tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent)]
    dist.broadcast_object_list(tmp, src=0)
    tmp_dir = Path(tmp[0])
    try:
        weights = tmp_dir / WEIGHTS_SUBDIR
        if dist.get_rank() == 0:
            weights.mkdir()
        dist.barrier()
        mcore_compat.save_checkpoint(_sharded_state(engine, is_loading=False), str(weights))
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, _rng_state())
        if dist.get_rank() == 0:
            meta = read_meta(source_dir)  # recorded with the engine's head: a critic started from a causal LM is
            # a sequence classifier from its first checkpoint on (a reward model's path takes it as it is)
            hf_config = as_head(meta.hf_config, engine.spec.head)
            write_meta(tmp_dir, dataclasses.replace(meta, hf_config=hf_config, lora=_lora_meta(engine, source_dir)))
            shutil.copytree(Path(source_dir) / HF_SUBDIR, tmp_dir / HF_SUBDIR)
            if hf_config is not meta.hf_config:
                (tmp_dir / HF_SUBDIR / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
            state = {"step": step, "scheduler": engine.scheduler.state_dict(), "rng": rng,
                     "skipped_steps": engine.stats.skipped_steps}
            (tmp_dir / TRAINER_STATE).write_text(json.dumps(state))
        dist.barrier()
        if dist.get_rank() == 0:
            tmp_dir.rename(out_dir)
        dist.barrier()
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


@cpu_compat.redirected
def load_training_checkpoint(engine: MegatronEngine, ckpt_dir: str | Path) -> int:
    """Collective. Restore model (a LoRA engine: its adapters, onto the base it was built from), optimizer,
    schedule and (same world size) RNG; returns the step."""
    ckpt_dir = Path(ckpt_dir)
    _check_adapters(read_meta(ckpt_dir).lora, engine.lora, ckpt_dir)
    path = weights_dir(ckpt_dir)
    state_file = ckpt_dir / TRAINER_STATE
    if not state_file.is_file():
        raise CheckpointError(f"{ckpt_dir} has no {TRAINER_STATE}: it is a model-only checkpoint; start a new run "
                              "from it instead of resuming.")
    trainer = json.loads(state_file.read_text())
    _init_optimizer_state(engine)  # megatron can only load into existing optimizer state
    # extra state the checkpoint lacks (Transformer Engine's, resuming on a machine with TE from a checkpoint
    # written without it) keeps its fresh value; anything else missing raises (mcore_io)
    loaded = mcore_io.load_sharded(_sharded_state(engine, is_loading=True), path,
                                 remedy="move this checkpoint aside to resume from the one before it.")
    for i, m in enumerate(engine.chunks):
        mcore_io.load_into(m, loaded[f"model{i}"], path, only=_trained(engine))
    engine.optimizer.load_state_dict(loaded["optimizer"])
    engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.stats.skipped_steps = trainer["skipped_steps"]
    if len(trainer["rng"]) == dist.get_world_size():
        _set_rng_state(trainer["rng"][dist.get_rank()])
    return int(trainer["step"])


def _lora_meta(engine: MegatronEngine, source_dir: str | Path) -> LoRAMeta | None:
    c = engine.lora
    return None if c is None else LoRAMeta(**dataclasses.asdict(c), base=os.path.abspath(source_dir))


def _check_adapters(saved: LoRAMeta | None, lora: LoRAConfig | None, ckpt_dir: Path) -> None:
    """A checkpoint resumes into an engine with the same adapters (rank, alpha, targets: what the adapted model is;
    dropout may differ), or none with none; otherwise the tensors it holds are not the ones the engine asks for."""
    if saved is None and lora is None:
        return
    if saved is None:
        raise CheckpointError(
            f"{ckpt_dir} holds a full model's training state, but this role trains LoRA adapters (lora: rank "
            f"{lora.rank} on {lora.targets}); resume it without lora, or start a new LoRA run from it (model.path).")
    if lora is not None and (saved.rank, saved.alpha, set(saved.targets)) == (lora.rank, lora.alpha, set(lora.targets)):
        return
    found = "trains every weight (lora: null)" if lora is None else (
        f"has lora rank {lora.rank}, alpha {lora.alpha} on {lora.targets}")
    raise CheckpointError(
        f"{ckpt_dir} holds LoRA adapters of rank {saved.rank}, alpha {saved.alpha} on {saved.targets}, but this role "
        f"{found}; resume with the lora settings it was saved with.")


def _init_optimizer_state(engine: MegatronEngine) -> None:
    """Create (zero) optimizer state without changing parameters: one step with zero gradients and lr 0."""
    groups = [g for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
              for g in opt.optimizer.param_groups]
    if all(len(opt.optimizer.state) for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
        return
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in groups]
    for g in groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    for m in engine.model:
        m.zero_grad_buffer()
    engine.optimizer.zero_grad()
    engine.optimizer.step()
    for g, (lr, wd) in zip(groups, saved, strict=True):
        g["lr"], g["weight_decay"] = lr, wd


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))

