"""Checkpoints: the three kinds side by side, and the format they share.

- ``format``   the megarl Megatron checkpoint directory (``megarl_checkpoint.json``, ``hf/``, ``weights/``):
               file names, :class:`~megarl.checkpoint.format.CheckpointMeta` and its JSON. Pure: stdlib,
               ``megarl.errors`` and ``megarl.parallel.layout`` only (the driver imports it).
- ``atomic``   write-to-temporary-then-rename helpers. Pure (stdlib only).
- ``hf_io``    HF safetensors directories, streamed tensor by tensor. torch + safetensors, no
               torch.distributed, no megatron-core.
- ``mcore_io`` the weights of a Megatron checkpoint: megatron-core dist-checkpoint save/load at any layout.
               Imports megatron-core (through ``megarl.parallel.mcore_compat``); workers and tools only.
- ``convert``  HF <-> Megatron conversion (the library API behind tools/convert_*.py); megatron-core.
- ``lora_export`` a LoRA run's checkpoint (adapters only) merged onto its base for ``convert``, or as a peft
               adapter (tools/export_peft.py); megatron-core.
- ``cpu_only`` the environment that hides CUDA from a conversion's process, so that it converts in host memory
               whatever GPUs the machine has. Pure (stdlib only: the tools import it before torch).
- ``training`` a role's training state (model + optimizer + LR schedule + RNG; a LoRA role's: its adapters, not
               the base) in a Megatron checkpoint directory; torch.distributed + megatron-core; runs in worker
               ranks. It may not be imported by ``megarl.engine`` (the engine is only an annotation here, under
               TYPE_CHECKING).
- ``manifest`` the checksums of every file of a checkpoint (``manifest.json``): written at commit, verified
               before a resume. Pure (stdlib only).
- ``run``      the run's step directories under ``<output_dir>/checkpoints`` (begin / commit / resume_point /
               read_state): the newest intact one, corrupt ones moved aside. Pure filesystem code (the driver
               imports it).

Nothing in this package imports Ray, vLLM or ``megarl.trainer``.
"""
