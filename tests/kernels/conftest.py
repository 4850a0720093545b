"""Kernel tests run the Triton kernels on the GPU when there is one, else on CPU tensors through
Triton's interpreter (set here, before ``kernels.triton`` defines its kernels)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"

