"""The TRL side of the offline-trainer comparisons (issue #44): one run of HuggingFace TRL 1.16's ``SFTTrainer``,
``RewardTrainer``, ``DPOTrainer`` or ``KTOTrainer`` on a fixed order of examples, recording every step's loss and
every metric TRL logs, and the trained weights.

    .venv-trl/bin/python benchmarks/offline_trl.py SPEC.json

Run ONLY with the TRL virtualenv's python (benchmarks/requirements-trl.txt says how to make it); nothing megarl is
imported here, and the caller (megarl's side of a comparison) only reads what this writes.

Spec (JSON object; defaults in brackets):

- ``trainer``: ``sft`` | ``reward`` | ``dpo`` | ``kto``;
- ``model``: an HF model directory with its tokenizer beside it (loaded as saved, ``PreTrainedTokenizerFast``:
  ``AutoTokenizer`` would rebuild megarl.toy's character tokenizer as the Qwen2Tokenizer its config names, which
  drops spaces). ``reward`` loads it as ``AutoModelForSequenceClassification`` (``num_labels=1``): a causal-LM
  checkpoint gets a *new random* ``score`` head, drawn after ``transformers.set_seed(seed)``; ``initial/`` keeps it;
- ``data``: a JSONL file, TRL's standard (not conversational) formats: ``sft`` ``{"prompt", "completion"}``
  (loss on the completion only, TRL's default ``completion_only_loss=None``) or ``{"text"}`` (every token);
  ``reward`` ``{"chosen", "rejected"}`` or with ``"prompt"``, optional ``"margin"``; ``dpo`` ``{"prompt", "chosen",
  "rejected"}``; ``kto`` ``{"prompt", "completion", "label"}`` (unpaired: a paired file would be unpaired by TRL
  into twice the rows, which the row check below refuses);
- ``steps``: a list, one entry per optimizer step, of the data's row indices that step trains on, in order (rows
  may repeat across steps). All steps hold equally many rows, the step batch;
- ``output_dir``; ``threads`` [2]: torch threads;
- ``gradient_accumulation_steps`` [1]: the step's rows are split, in order, into this many micro-batches of
  ``per_device_train_batch_size = rows / gradient_accumulation_steps``;
- optimizer: ``learning_rate`` [1e-5], ``adam_beta1`` [0.9], ``adam_beta2`` [0.999], ``adam_epsilon`` [1e-8],
  ``weight_decay`` [0.0], ``max_grad_norm`` [1.0], ``optim`` ["adamw_torch"], ``seed`` [0];
- ``max_length`` [null: no truncation and no filtering; TRL's own default is 1024];
- ``dpo``: ``beta`` [0.1], ``loss_type`` ["sigmoid"; "ipo", "hinge", "robust"], ``label_smoothing`` [0.0],
  ``precompute_ref_log_probs`` [false]; ``kto``: ``beta`` [0.1], ``desirable_weight`` [1.0],
  ``undesirable_weight`` [1.0], ``precompute_ref_log_probs`` [false]; ``reward``:
  ``center_rewards_coefficient`` [null];
- ``extra_args`` [{}]: any other TRL config field (refused where it would change a pinned setting below);
- ``save_initial`` [true for ``reward``, else false]: also save the weights before the first step;
- ``dump_batches`` [false]: save each micro-batch TRL's collator built (``batches/step_K_mb_J.pt``, tensors).

Writes to ``output_dir``: ``steps.json`` (``{"trainer", "versions", "config": the TRL config's fields as used,
"dataset_columns", "model_dropout", "steps": [{"step": K, "rows": [...], "loss", "grad_norm", "learning_rate",
every TRL metric of the step under TRL's name (with accumulation, TRL's ``log`` averages the micro-batches'
values), "compute_loss": [the value each training ``compute_loss`` call returned, one per micro-batch: SFT's is
already over the whole step's label tokens and they add up to ``loss``; the others' are the micro-batch's own
mean, which Trainer then divides by ``gradient_accumulation_steps``]}], "summary": Trainer's end-of-train log}``),
``final/`` (``trainer.save_model``: ``model.safetensors``, config, tokenizer), and ``initial/`` when asked.

Settings pinned here, and what TRL 1.16 / transformers 5.24 do by default that a comparison must know:

- Order: the dataset is rebuilt as the concatenation of the steps' rows, ``train_sampling_strategy="sequential"``
  (a ``SequentialSampler``; KTO requires it), ``dataloader_drop_last=False``, ``dataloader_num_workers=0``,
  ``max_steps = len(steps)``, ``per_device_train_batch_size`` as above, one process. SFT's ``shuffle_dataset=False``.
  After TRL's preparation the dataset must still hold every row (TRL drops rows: RM those longer than
  ``max_length``, DPO/KTO those whose prompt alone fills it, SFT those left without a trainable token); the run
  stops otherwise. ``remove_unused_columns=True`` (TRL's default: only the trainer's signature columns reach the
  collator).
- Precision and device: ``use_cpu=True``, ``bf16=False`` (TRL's configs default it to True), ``fp16=False``,
  ``model_init_kwargs={"dtype": "float32"}`` (TRL loads in float32 when no dtype is given), TF32 irrelevant on CPU.
- No activation checkpointing (``activation_checkpointing=False``; TRL's configs default its deprecated alias
  ``gradient_checkpointing`` to True), ``use_liger_kernel=False``,
  ``padding_free=False`` (SFT, DPO; DPO 1.16 forces it off anyway), ``packing=False`` (SFT), ``pad_to_multiple_of``
  TRL's ``"auto"`` = none on CPU. Padding is on the right.
- ``disable_dropout=True`` (reward, DPO, KTO: policy and reference); ``SFTConfig`` has no such field: the model's
  own dropout applies (recorded as ``model_dropout``; megarl.toy's Qwen2 models have ``attention_dropout=0``).
- Optimizer: ``optim="adamw_torch"`` (``torch.optim.AdamW``, the per-tensor loop on CPU; transformers' default with
  torch >= 2.8 is ``adamw_torch_fused``), weight decay only on parameters whose name has no ``bias``/``norm``
  (``Trainer.get_decay_parameter_names``), ``lr_scheduler_type="constant"``, ``warmup_steps=0``, clipping to
  ``max_grad_norm`` by the total norm of all gradients; ``grad_norm`` is logged before clipping.
- Logging: ``logging_steps=1``, ``report_to="none"``, ``save_strategy="no"``, ``eval_strategy="no"``,
  ``disable_tqdm=True``; ``HF_HUB_OFFLINE=1`` and ``HF_HUB_DISABLE_TELEMETRY=1`` (TRL pings telemetry otherwise).
  Trainer logs the step's ``loss`` unrounded: the sum of the micro-batches' (GA-scaled) losses.
- EOS: for standard (non-conversational) data TRL appends the tokenizer's EOS to every completion (``chosen``,
  ``rejected``, ``completion``, SFT's ``text``) that does not already end with it; the EOS is a completion token
  (it is trained on and counted in IPO's and SFT's token counts). The prompt is tokenized alone and with the
  completion; the completion starts where they diverge.
- Reductions (see megarl.algos.preference for the formulas): DPO and RM mean over the micro-batch's pairs, KTO over
  all its rows, and Trainer divides each micro-batch's loss by ``gradient_accumulation_steps``; SFT divides its
  token-sum by ``num_items_in_batch`` = the label tokens of all the step's micro-batches (``labels[..., 1:] !=
  -100``; ``average_tokens_across_devices=True`` would also sum over processes) and is not divided again.
- DPO: the batch is ``[chosen rows; rejected rows]``; log-probs summed over completion tokens; without
  ``precompute_ref_log_probs`` the reference is a second copy loaded from ``model``; with it the reference
  log-probs are computed once, before training, by the initial model in batches of ``precompute_ref_batch_size``
  (default ``per_device_train_batch_size``) in dataset order.
- KTO: each row's KL completion is the completion of the previous row *of its micro-batch* in dataset order (the
  first row takes the micro-batch's last), i.e. rows rotated by one within each ``per_device_train_batch_size``
  block; the KL estimate is formed per micro-batch (``compute_loss`` call).
- Reward model: the reward is the ``score`` head at the last token that is not the pad token (``pad_token_id`` set
  on the model config from the tokenizer; a tokenizer whose pad is its EOS would score the token before the EOS).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TRAINERS = ("sft", "reward", "dpo", "kto")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")


def pinned(trainer: str) -> dict:
    """The TRL config fields this script fixes (module docstring)."""
    fixed = dict(
        use_cpu=True, bf16=False, fp16=False, activation_checkpointing=False, use_liger_kernel=False,
        model_init_kwargs={"dtype": "float32"}, train_sampling_strategy="sequential", dataloader_drop_last=False,
        dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to="none",
        save_strategy="no", eval_strategy="no", disable_tqdm=True, remove_unused_columns=True,
    )
    if trainer != "sft":
        fixed["disable_dropout"] = True
    if trainer in ("sft", "dpo"):
        fixed["padding_free"] = False
    if trainer == "sft":
        fixed |= {"packing": False, "shuffle_dataset": False}
    return fixed


def trl_config(spec: dict, batch: int):
    """The TRL config object of ``spec``'s trainer (module docstring)."""
    from trl import DPOConfig, KTOConfig, RewardConfig, SFTConfig

    trainer = spec["trainer"]
    accum = spec.get("gradient_accumulation_steps", 1)
    if batch % accum:
        raise SystemExit(f"{batch} rows per step do not split into {accum} micro-batches")
    args = dict(
        output_dir=str(Path(spec["output_dir"]) / "trainer"), per_device_train_batch_size=batch // accum,
        gradient_accumulation_steps=accum, max_steps=len(spec["steps"]), num_train_epochs=1,
        learning_rate=spec.get("learning_rate", 1e-5), adam_beta1=spec.get("adam_beta1", 0.9),
        adam_beta2=spec.get("adam_beta2", 0.999), adam_epsilon=spec.get("adam_epsilon", 1e-8),
        weight_decay=spec.get("weight_decay", 0.0), max_grad_norm=spec.get("max_grad_norm", 1.0),
        optim=spec.get("optim", "adamw_torch"), seed=spec.get("seed", 0), max_length=spec.get("max_length"),
    )
    if trainer == "dpo":
        loss_type = spec.get("loss_type", "sigmoid")
        if loss_type not in DPO_LOSSES:
            raise SystemExit(f"dpo loss_type {loss_type!r}: one of {DPO_LOSSES}")
        args |= dict(beta=spec.get("beta", 0.1), loss_type=[loss_type],
                     label_smoothing=spec.get("label_smoothing", 0.0),
                     precompute_ref_log_probs=spec.get("precompute_ref_log_probs", False))
    elif trainer == "kto":
        args |= dict(beta=spec.get("beta", 0.1), loss_type="kto", desirable_weight=spec.get("desirable_weight", 1.0),
                     undesirable_weight=spec.get("undesirable_weight", 1.0),
                     precompute_ref_log_probs=spec.get("precompute_ref_log_probs", False))
    elif trainer == "reward":
        args["center_rewards_coefficient"] = spec.get("center_rewards_coefficient")
    fixed = pinned(trainer)
    extra = spec.get("extra_args", {})
    clash = sorted(k for k in extra if k in fixed or k in args)
    if clash:
        raise SystemExit(f"extra_args {clash}: set by this script or by a spec field (module docstring)")
    cls = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig, "kto": KTOConfig}[trainer]
    return cls(**args, **fixed, **extra)


def run(spec: dict) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import DPOTrainer, KTOTrainer, RewardTrainer, SFTTrainer

    trainer_name = spec["trainer"]
    if trainer_name not in TRAINERS:
        raise SystemExit(f"trainer {trainer_name!r}: one of {TRAINERS}")
    torch.set_num_threads(spec.get("threads", 2))
    out = Path(spec["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    data = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    steps = [list(s) for s in spec["steps"]]
    batch = len(steps[0]) if steps else 0
    if not batch or any(len(s) != batch for s in steps):
        raise SystemExit(f"steps: every step needs the same, non-zero number of rows, found {[len(s) for s in steps]}")
    ordered = [data[i] for s in steps for i in s]
    args = trl_config(spec, batch)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model"])
    transformers.set_seed(args.seed)  # before TRL builds the model: the reward model's new score head

    record = {"compute_loss": []}
    dump = spec.get("dump_batches", False)
    cls = {"sft": SFTTrainer, "reward": RewardTrainer, "dpo": DPOTrainer, "kto": KTOTrainer}[trainer_name]

    class Recorded(cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if dump and model.training:
                mb = len(record["compute_loss"])
                (out / "batches").mkdir(exist_ok=True)
                torch.save({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)},
                           out / "batches" / f"step_{self.state.global_step + 1}_mb_{mb}.pt")
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                record["compute_loss"].append((result[0] if return_outputs else result).item())
            return result

    logged: list[dict] = []
    summary: dict = {}

    class Capture(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is None:
                return
            if "train_runtime" in logs:
                summary.update(logs)
                return
            k = state.global_step
            logged.append({"step": k, "rows": steps[k - 1], **logs, "compute_loss": record["compute_loss"]})
            record["compute_loss"] = []

    trainer = Recorded(model=spec["model"], args=args, train_dataset=Dataset.from_list(ordered),
                       processing_class=tokenizer, callbacks=[Capture()])
    if len(trainer.train_dataset) != len(ordered):
        raise SystemExit(f"TRL's preparation left {len(trainer.train_dataset)} of {len(ordered)} rows (rows over "
                         "max_length, or a paired KTO file): the steps would not train the rows they name")
    if spec.get("save_initial", trainer_name == "reward"):
        trainer.save_model(str(out / "initial"))
    model_config = trainer.model.config
    dropout = {k: v for k, v in model_config.to_dict().items() if "dropout" in k}
    trainer.train()
    if len(logged) != len(steps):
        raise SystemExit(f"{len(logged)} steps logged, {len(steps)} asked for")
    trainer.save_model(str(out / "final"))
    versions = {m.__name__: m.__version__ for m in (trl, transformers, torch)}
    import accelerate
    import datasets

    versions |= {"accelerate": accelerate.__version__, "datasets": datasets.__version__}
    config = {k: v for k, v in args.to_dict().items() if not k.startswith("_")}
    result = {"trainer": trainer_name, "versions": versions, "config": config,
              "dataset_columns": trainer.train_dataset.column_names, "model_dropout": dropout, "steps": logged,
              "summary": summary}
    (out / "steps.json").write_text(json.dumps(result, indent=1, default=str))


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: offline_trl.py SPEC.json (under the TRL virtualenv's python)")
    for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                 "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    run(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
