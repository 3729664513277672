"""Tests run single-threaded per process (and `make test` runs two processes, one per core).

Their tensors are tiny, and on a shared 2-core machine a 2-thread pool stalls on every op
when the other thread is descheduled (measured: a sigmaReparam power-iteration step on
vit_test takes 95 ms with 2 threads, 5 ms with 1). Subprocesses inherit OMP_NUM_THREADS.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
