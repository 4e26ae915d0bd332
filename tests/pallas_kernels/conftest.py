import pytest

from pallas_kernels.mla import pallas_triton


@pytest.fixture
def small_blocks(monkeypatch):
    """16-row MLA query and key blocks, so that small shapes span several blocks with ragged ends."""
    monkeypatch.setattr(pallas_triton, "BLOCK_Q", 16)
    monkeypatch.setattr(pallas_triton, "BLOCK_K", 16)
