"""A rollout function as user code: a generation loop of its own over the rollout engines, given by path
(``rollout.function``; docs/programming.md §2).

    megarl train examples/grpo_addition_tiny/config.yaml rollout.function=examples/plugins/rollout.py:draft_then_answer

``draft_then_answer``: two generation calls per response. The model first writes a draft; the function inserts a
separator (a space: context the model reads, not trained) and asks for the final answer, which the reward
function scores. Both of the model's segments are trained, each token with the log-prob and weight version of the
call that sampled it. tests/trainer/test_plugin_runs.py checks the rows against transformers.
"""

from __future__ import annotations

from megarl.program import RolloutContext, RolloutRequest, RolloutSample, algos


@algos.rollout_function()
def draft_then_answer(requests: list[RolloutRequest], ctx: RolloutContext) -> list[RolloutSample]:
    samples = [RolloutSample(request) for request in requests]
    separator = ctx.tokenizer.encode(" ", add_special_tokens=False)
    for sample, draft in zip(samples, ctx.generate([r.prompt_ids for r in requests]), strict=True):
        sample.add_model(draft)
        sample.add_context(separator)
    for sample, answer in zip(samples, ctx.generate([s.ids for s in samples]), strict=True):
        sample.add_model(answer)  # sample.text (what the reward function scores): this segment's text
    return samples
