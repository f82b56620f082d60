import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These models are tiny: one thread is fastest, and avoids OpenMP spin-waits on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
