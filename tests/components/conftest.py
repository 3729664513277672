"""Component tests run single-threaded: their tensors are tiny, and on a shared 2-core machine
a 2-thread pool stalls on every op when the other thread is descheduled (measured: a
sigmaReparam power-iteration step on vit_test takes 95 ms with 2 threads, 5 ms with 1)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
