"""logger.wandb=offline makes no network attempt from the training process (#18)."""

import socket

import pytest

from tests.helpers import train

LOCAL = ("127.0.0.1", "::1", "localhost", "0.0.0.0")


def test_offline_wandb_connects_to_nothing_but_localhost(tmp_path, monkeypatch):
    """wandb 0.31 runs its work in a wandb-core service subprocess, reached over a local socket;
    what this process can see is its own connects and name lookups, which must all be local.
    (The service subprocess is given x_disable_stats etc., so it has nothing to send; a
    connect it made itself would not be seen here.)"""
    pytest.importorskip("wandb")
    remote = []
    real_connect, real_gai = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if self.family != socket.AF_UNIX and address[0] not in LOCAL:
            remote.append(address)
            raise OSError("network disabled by the test")
        return real_connect(self, address)

    def getaddrinfo(host, *a, **k):
        if host not in LOCAL and host is not None:
            remote.append(host)
            raise socket.gaierror("network disabled by the test")
        return real_gai(host, *a, **k)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setenv("WANDB_MODE", "offline")
    s = train(tmp_path, "model=gpt_test", "batch_size=8", "steps=2", "eval_every=1000", "monitor=off",
              "logger.progress=false", "logger.wandb=offline", quiet=False)
    assert s["status"] == "completed"
    assert remote == []
    assert (tmp_path / "wandb").is_dir()  # wandb ran (offline), it was not disabled by a failure
