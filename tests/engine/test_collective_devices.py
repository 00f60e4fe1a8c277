"""Every tensor collective megarl issues itself runs on the role's compute device (world of one, in process).

Under NCCL a collective refuses a CPU tensor ("No backend type associated with device type cpu"); gloo takes
one, so a CPU run cannot see a host statistic reaching a collective. Here the compute device is made
distinguishable: megarl's one notion of it, :func:`megarl.parallel.init.comm_device`, is declared to be
``cuda:7``, and a torch-function mode stands in for that GPU (a tensor created on or moved to ``cuda:7`` is a
CPU copy marked as living there, and stays marked through the ops on it). Every ``torch.distributed`` tensor
collective called from megarl's code is recorded with its call site and must have a marked tensor: a tensor
that never went to the compute device (old ``engine/moe.py``: router loads in CPU float64) is named. The
statistics of the step equal those of the same step on the plain CPU path. A source check covers the
collectives a world of one does not reach (expert-parallel micro-batch counts, vocabulary-parallel log-probs).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import megarl

FAKE_GPU = torch.device("cuda", 7)  # an index megatron-core never asks for (it uses current_device(): 0)
MEGARL = Path(megarl.__file__).parent
# tensor collectives and point-to-point calls of torch.distributed (object collectives and barrier choose their
# device themselves: torch's _get_object_coll_device / _get_pg_default_device)
TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                      "broadcast", "reduce", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")
# the modules that wrap torch.distributed's collectives rather than issue them for a computation of their own
WRAPPERS = ("parallel/collectives.py", "parallel/cpu_compat.py")


class OnFakeGpu(torch.Tensor):
    """A CPU tensor standing for one on ``FAKE_GPU`` (ops on it return this type too)."""


class FakeGpuMode(TorchFunctionMode):
    """``device=FAKE_GPU`` and ``Tensor.to(FAKE_GPU)`` give a CPU copy marked :class:`OnFakeGpu`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        moved = kwargs.get("device") == FAKE_GPU
        if moved:
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and any(a == FAKE_GPU for a in args[1:] if isinstance(a, torch.device)):
            args, moved = tuple("cpu" if isinstance(a, torch.device) and a == FAKE_GPU else a for a in args), True
        out = func(*args, **kwargs)
        if moved:  # a copy, as a move between devices is
            out = out.as_subclass(torch.Tensor).clone().as_subclass(OnFakeGpu)
        return out


def _megarl_site(frame) -> str | None:
    """``path:line`` of the megarl code that called a collective (through a wrapper), None for anyone else's."""
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        inside = MEGARL in path.parents
        if inside and str(path.relative_to(MEGARL)) not in WRAPPERS:
            return f"{path.relative_to(MEGARL)}:{frame.f_lineno}"
        if not inside and "torch" not in path.parts:
            return None  # megatron-core's own collective (or the test's)
        frame = frame.f_back
    return None


def _record_collectives(monkeypatch) -> list[tuple[str, str, bool]]:
    """(call site, collective, tensor on the compute device) of each tensor collective megarl calls."""
    calls = []

    def recording(name, real):
        def collective(tensor, *args, **kwargs):
            site = _megarl_site(sys._getframe(1))
            if site is not None:
                tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
                calls.append((site, name, all(isinstance(t, OnFakeGpu) for t in tensors)))
            if isinstance(tensor, OnFakeGpu):  # the same storage, as gloo's CPU tensor
                tensor = tensor.as_subclass(torch.Tensor)
            return real(tensor, *args, **kwargs)

        return collective

    for name in TENSOR_COLLECTIVES:
        monkeypatch.setattr(dist, name, recording(name, getattr(dist, name)))
    return calls


@pytest.fixture(scope="module")
def moe_engine(tiny_hf):
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.engine.engine import MegatronEngine
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed, process_groups
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout)
    config = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-30, clip_grad=0.0,  # weights stay
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=16), moe_aux_loss_coef=0.01)  # 2 micro-batches
    spec = spec_from_hf_config(load_hf_config(tiny_hf("qwen3_moe")))
    return MegatronEngine(spec, layout, config, checkpoint_dir=None, trainable=True, groups=process_groups())


def _step(engine):
    from megarl.data.batch import Batch
    from megarl.engine.engine import Extreme

    ids = torch.randint(5, 300, (4, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0

    def loss_fn(logits, mb):  # a metric of the loss function's own, made on the host
        loss = logits.float().square().mean() / 2
        return loss, {"host_metric": torch.tensor(0.25, dtype=torch.float64), "peak": logits.detach().float().max()}

    return engine.train_step(Batch.from_dict({"input_ids": ids, "attention_mask": mask}), loss_fn,
                             extremes={"peak": Extreme.MAX})


def test_every_collective_megarl_issues_runs_on_the_compute_device(moe_engine, monkeypatch):
    from megarl.parallel import init

    plain = _step(moe_engine)  # gloo on the CPU: the reference values
    monkeypatch.setattr(init, "comm_device", lambda: FAKE_GPU)
    calls = _record_collectives(monkeypatch)
    with FakeGpuMode():
        result = _step(moe_engine)
    sites = {site.split(":")[0] for site, _, _ in calls}
    assert {"engine/moe.py", "engine/engine.py"} <= sites, calls  # the router statistics and the step's metrics
    off_device = sorted({f"{site} {name}" for site, name, on in calls if not on})
    assert not off_device, f"collectives on a tensor that is not on the compute device: {off_device}"
    assert {"moe_load_max", "moe_load_min", "moe_load_balancing_loss", "host_metric", "peak"} <= set(result.terms)
    assert not result.step_skipped
    assert result.loss == pytest.approx(plain.loss, rel=1e-12)
    assert result.terms == pytest.approx(plain.terms, rel=1e-12)


def test_megarl_issues_tensor_collectives_only_through_the_device_seam():
    """Where a world of one does not reach (ep > 1, tp > 1): no direct ``dist.<tensor collective>(`` in megarl,
    but the wrappers and the weight transfer (whose messages are the model's own tensors, on its device)."""
    call = re.compile(r"\bdist\.(" + "|".join(TENSOR_COLLECTIVES) + r")\(")
    allowed = {*WRAPPERS, "resharding/transport.py", "resharding/link.py"}
    direct = [f"{p.relative_to(MEGARL)}:{i}" for p in sorted(MEGARL.rglob("*.py"))
              if str(p.relative_to(MEGARL)) not in allowed
              for i, line in enumerate(p.read_text().splitlines(), 1) if call.search(line.split("#")[0])]
    assert not direct, f"call megarl.parallel.collectives instead (it moves host tensors to the device): {direct}"
