"""The GPU tests: run on a CUDA device (the lent GPU's image: torch, Triton and transformers,
no textual or fastapi), skipped elsewhere."""

import pytest
import torch


@pytest.fixture(autouse=True)
def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
