"""rollout_batch on a hand-worked case: two rollout outputs (as from two replicas) of different widths."""

import torch

from megarl.rollout.base import RolloutOutput
from megarl.rollout.rows import rollout_batch


def _output(prompt_index, responses, lengths, reasons):
    responses = torch.tensor(responses)
    lengths = torch.tensor(lengths)
    mask = torch.arange(responses.shape[1])[None, :] < lengths[:, None]
    log_probs = -(responses.float() / 10) * mask  # -token/10 on response tokens
    return RolloutOutput(prompt_index=torch.tensor(prompt_index), responses=responses, response_mask=mask,
                         log_probs=log_probs, response_lengths=lengths, finish_reasons=reasons)


def test_rows_are_prompt_then_response_then_pad():
    prompts = [[5, 6], [7], [8, 9, 4]]
    a = _output([0, 0], [[11, 12, 13], [14, 0, 0]], [3, 1], ["length", "stop"])
    b = _output([1, 2], [[15, 16], [17, 0]], [2, 1], ["length", "stop"])
    batch = rollout_batch(prompts, [a, b], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 11, 12, 13], [5, 6, 14, 0, 0], [7, 15, 16, 0, 0],
                                           [8, 9, 4, 17, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0]]
    expected_lp = [[0, 0, -1.1, -1.2, -1.3], [0, 0, -1.4, 0, 0], [0, -1.5, -1.6, 0, 0], [0, 0, 0, -1.7, 0]]
    assert torch.allclose(batch["rollout_log_probs"], torch.tensor(expected_lp))
    assert batch["prompt_index"].tolist() == [0, 0, 1, 2] and batch["response_lengths"].tolist() == [3, 1, 2, 1]
    assert batch.non_tensors["finish_reasons"] == ["length", "stop", "length", "stop"]
