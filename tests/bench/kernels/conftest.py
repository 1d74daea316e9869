"""The tuner imports the MoE-LoRA op's Triton kernels, which pick Triton's interpreter (no CUDA
GPU here) only if it is chosen before they are created: as in tests/kernels/conftest.py."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
