# megarl for GPU clusters: CUDA 13.0 + cuDNN devel base (nvcc for the TE and apex builds), Python 3.12,
# torch as pinned by vLLM, Transformer Engine and apex compiled against that torch, then megarl.
#
#   docker build -t megarl .            # builds without a GPU; see TORCH_CUDA_ARCH_LIST / NVTE_CUDA_ARCHS
#   docker run --gpus all --ipc=host --rm -it megarl
#
# Why not nvcr.io/nvidia/pytorch: it ships TE built against an NVIDIA pre-release torch that
# /etc/pip/constraint.txt pins (25.12: torch 2.10.0a0, CUDA 13.1). vLLM pins an exact PyPI torch, so
# adding vLLM there either conflicts with that pin or, pin removed, swaps torch under the compiled TE.

ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# vLLM 0.32.0 pins torch==2.13.0 (PyPI wheel built for CUDA 13.0, matching the base image's nvcc);
# vLLM 0.33 pins torch 2.14, outside setup.py's torch<2.14.
ARG VLLM_VERSION=0.32.0
# The megatron-core version megarl's CPU test suite runs against (Python 3.12 would otherwise get 0.19.x).
ARG MCORE_VERSION=0.16.1
# Inside megatron-core 0.16.1's declared range (>=2.9, <2.12; setup.py's "te" extra, tests/unit/test_te_packaging.py).
ARG TE_VERSION=2.11.0
ARG APEX_REF=master
# A100, H100/H200, B200.
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"
ARG NVTE_CUDA_ARCHS="80;90;100"
ARG MAX_JOBS=8
ARG DEBIAN_FRONTEND=noninteractive

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git build-essential ca-certificates libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04's python3 is 3.12 and externally managed (PEP 668): use a venv.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
RUN python3 -m venv ${VIRTUAL_ENV} \
    && pip install --upgrade pip setuptools wheel packaging ninja pybind11 cmake

# torch (CUDA 13.0 build) comes in with vLLM's exact pin.
RUN pip install "vllm==${VLLM_VERSION}" "megatron-core==${MCORE_VERSION}" \
    && python -c "import torch; assert torch.version.cuda.startswith('13.0'), torch.version.cuda"

# TE: the CUDA 13 core wheel plus the PyTorch extension (an sdist) compiled against the torch above.
RUN NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    MAX_JOBS=${MAX_JOBS} \
    pip install --no-build-isolation "transformer_engine[pytorch,core_cu13]==${TE_VERSION}"

# apex with its C++/CUDA extensions (current apex reads APEX_CPP_EXT/APEX_CUDA_EXT; releases before
# that take --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext").
RUN git clone https://github.com/NVIDIA/apex /tmp/apex \
    && git -C /tmp/apex checkout "${APEX_REF}" \
    && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD=${MAX_JOBS} NVCC_APPEND_FLAGS="--threads 4" \
       TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
       pip install -v --no-build-isolation /tmp/apex \
    && rm -rf /tmp/apex

# megarl last, so code changes do not rebuild the layers above; every dependency is already satisfied.
WORKDIR /workspace/megarl
COPY . .
# The build has no GPU driver, so check that the compiled extensions exist rather than import them.
RUN pip install -e ".[vllm,te]" \
    && python -c "import importlib.util as u, megarl; \
assert all(u.find_spec(m) for m in ('transformer_engine_torch', 'amp_C', 'fused_layer_norm_cuda', 'vllm'))"

CMD ["bash"]
