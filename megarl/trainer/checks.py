"""Checks of the tokens and the frozen models a run scores with, before any worker starts (the driver loads
only tokenizers and config.json files). The policy's tokenizer must fit its model: the pad and eos ids it pads
and stops with are ids the model embeds (a prompt's ids are checked as the data loads,
:func:`megarl.data.prompts.load_prompts`). The reward model and the distillation teacher read the policy's
token ids as they are, so each must embed every id the policy can emit and map every string to the same
id as the policy's tokenizer (re-tokenizing responses for another vocabulary is not supported), and each
must have the right head (a scalar for a reward model, vocabulary logits for a teacher). Every tokenizer is
loaded as saved (:func:`megarl.data.tokenizer.load_tokenizer`). A rollout function given by path is called once
with the policy's tokenizer and a stand-in generate (:func:`check_rollout_function`).
"""

from __future__ import annotations

from megarl.checkpoint.format import hf_files
from megarl.config.train import ModelConfig, TrainConfig
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import ConfigError
from megarl.models.spec import Head, load_hf_config, spec_from_hf_config
from megarl.rollout.config import LoRASync, check_adapter_targets


def check_frozen_models(cfg: TrainConfig, tokenizer) -> None:
    _check_policy_tokenizer(cfg, tokenizer)
    _check_moe(cfg)
    for section, model in (("reward_model", cfg.reward_model), ("cost_model", cfg.cost_model)):
        if model is not None:
            _check(section, model.model, Head.SCALAR, cfg, tokenizer,
                   "an HF *ForSequenceClassification checkpoint with num_labels=1")
    if cfg.teacher is not None:
        _check("teacher", cfg.teacher.model, Head.LM, cfg, tokenizer,
               "an HF *ForCausalLM checkpoint or a megarl checkpoint of one")


def check_rollout_function(cfg: TrainConfig, tokenizer, stop_ids: tuple[int, ...]) -> None:
    """``rollout.function``, called once on synthetic requests with the run's tokenizer and a stand-in generate
    (:func:`megarl.multiturn.custom.check_rollout_function`)."""
    if cfg.rollout.function is None:
        return
    from megarl.algos.plugins import ROLLOUT_FUNCTION, resolve
    from megarl.config.resolve import sampling_params
    from megarl.multiturn.custom import check_rollout_function as check

    plugin = resolve(ROLLOUT_FUNCTION, cfg.rollout.function)
    check(plugin, plugin.name, tokenizer, stop_ids, sampling_params(cfg.rollout.sampling, cfg.rollout, stop_ids, 0))


def policy_vocab_size(cfg: TrainConfig) -> int:
    """The number of token ids the policy embeds (its config.json's ``vocab_size``)."""
    return int(load_hf_config(hf_files(cfg.model.path))["vocab_size"])


def _check_policy_tokenizer(cfg: TrainConfig, tokenizer) -> None:
    """The pad id (padding) and the eos id (the stop of a response) must be ids the policy embeds."""
    vocab = policy_vocab_size(cfg)
    for kind in ("pad", "eos"):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is not None and not 0 <= token_id < vocab:
            raise ConfigError(
                f"the tokenizer {cfg.model.tokenizer} ({type(tokenizer).__name__}, {len(tokenizer)} tokens) has its "
                f"{kind} token {getattr(tokenizer, f'{kind}_token')!r} at id {token_id}, but the policy "
                f"{cfg.model.path} embeds ids 0-{vocab - 1} (config.json vocab_size={vocab}): it is not the "
                "model's tokenizer. Set model.tokenizer to a directory holding only the model's own tokenizer files.")


def _check_moe(cfg: TrainConfig) -> None:
    """Router replay needs an MoE policy; adapter-only LoRA sync cannot carry an MoE model's expert adapters."""
    moe = spec_from_hf_config(load_hf_config(hf_files(cfg.model.path))).moe is not None
    if cfg.policy.router_replay and not moe:
        raise ConfigError(f"policy.router_replay replays a Mixture-of-Experts model's expert choices; model.path "
                          f"{cfg.model.path} is dense: set policy.router_replay=false.")
    if cfg.policy.lora is not None and cfg.rollout.engine.lora_sync is LoRASync.ADAPTER:
        check_adapter_targets(moe, cfg.policy.lora.targets, cfg.model.path)


def _check(section: str, model: ModelConfig, head: Head, cfg: TrainConfig, tokenizer, wanted: str) -> None:
    config = load_hf_config(hf_files(model.path))
    if spec_from_hf_config(config).head is not head:
        raise ConfigError(f"{section}.model.path {model.path} holds a {config.get('architectures')} model; the "
                          f"{section} needs {wanted}.")
    policy_ids, ids = policy_vocab_size(cfg), int(config["vocab_size"])
    if ids < policy_ids:
        raise ConfigError(f"the {section} embeds {ids} token ids, the policy ({cfg.model.path}) emits up to "
                          f"{policy_ids}: it must share the policy's tokenizer (re-tokenizing responses for another "
                          "vocabulary is not supported).")
    source = model.tokenizer  # resolved: its directory, or the model's (hf/ of a megarl checkpoint)
    try:
        vocab = load_tokenizer(source).get_vocab()
    except (OSError, ValueError) as e:
        raise ConfigError(f"no tokenizer could be loaded from {source} ({e}), so it cannot be checked that the "
                          f"{section} shares the policy's; set {section}.model.tokenizer to its tokenizer "
                          "directory.") from e
    policy_vocab = tokenizer.get_vocab()
    if vocab != policy_vocab:
        differ = sorted(t for t in vocab.keys() | policy_vocab.keys() if vocab.get(t) != policy_vocab.get(t))
        raise ConfigError(f"the {section}'s tokenizer ({source}: {len(vocab)} tokens) is not the policy's "
                          f"({len(policy_vocab)} tokens; {len(differ)} differ, e.g. {differ[:3]}): re-tokenizing "
                          f"responses is not supported. Use a {section} trained with the policy's tokenizer.")
