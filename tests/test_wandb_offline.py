"""logger.wandb=offline makes no network attempt from the training process."""

import os
import re
import shutil
import socket
import subprocess
import sys


from tests.helpers import ROOT, train

LOCAL = ("127.0.0.1", "::1", "localhost", "0.0.0.0")


def test_offline_wandb_connects_to_nothing_but_localhost(tmp_path, monkeypatch):
    """wandb 0.31 runs its work in a wandb-core service subprocess, reached over a local socket;
    what this process can see is its own connects and name lookups, which must all be local.
    (The service subprocess is given x_disable_stats etc., so it has nothing to send; a
    connect it made itself would not be seen here.)"""
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


def test_offline_wandb_and_its_service_connect_to_nothing_outside_the_machine(tmp_path):
    """Every process of the run, wandb's service and system monitor included, traced: the only
    connects are to local sockets (before, the system monitor resolved a name through the
    network's DNS server)."""
    assert shutil.which("strace"), "strace is part of this project's machine image (apt: strace)"
    trace = tmp_path / "connect.log"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_SILENT", None)
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace), sys.executable,
                        str(ROOT / "train.py"), "model=gpt_test", "batch_size=8", "steps=2", "eval_every=1000",
                        "monitor=off", "logger.wandb=offline", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "wandb").is_dir()
    calls = [ln for ln in trace.read_text().splitlines() if "connect(" in ln]
    outside = [ln for ln in calls if re.search(r"AF_INET6?\b", ln)
               and not re.search(r'inet_addr\("127\.|inet_pton\(AF_INET6, "::1"', ln)]
    assert calls and outside == [], outside


def test_wandb_charts_use_the_training_step_so_a_rollback_can_log_steps_again(tmp_path):
    """wandb drops a record whose ``step=`` is below its last one ("Tried to log to step 4 that is
    less than the current step 6"); a rollback or an earlier resume logs those steps again. The
    training step is therefore a metric (``trainer/step``), every chart's x-axis."""
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}, "WANDB_MODE": "offline"}
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=gpt_test", "steps=12", "batch_size=16",
                        "eval_every=1000", "monitor=off", "logger.progress=false", "logger.wandb=offline",
                        "divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4",
                        "debug.nan_at_step=6", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rollback 1/3 at step" in r.stderr and "less than the current step" not in r.stderr, r.stderr[-2000:]


def test_the_sink_logs_the_step_as_wandbs_x_axis(tmp_path, monkeypatch):
    import wandb
    from omegaconf import OmegaConf

    from stabletrain.metrics import WANDB_STEP, Metrics

    calls = []

    class Run:
        def define_metric(self, name, **kw):
            calls.append(("define", name, kw))

        def log(self, values, **kw):
            calls.append(("log", values, kw))

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: Run())
    cfg = OmegaConf.create({"wandb": "offline", "project": "p", "entity": None, "progress": False,
                            "log_every": 1})
    m = Metrics(tmp_path, cfg)
    for step in (5, 6, 4):
        m.log(step, {"loss": 1.0})
    m.close()
    assert ("define", "*", {"step_metric": WANDB_STEP}) in calls
    logs = [(values, kw) for kind, values, kw in calls if kind == "log"]
    assert logs == [({"loss": 1.0, WANDB_STEP: s}, {}) for s in (5, 6, 4)]


def test_a_fresh_run_in_a_used_directory_gets_its_own_wandb_run(tmp_path):
    """The wandb id is the run's: a resume continues it, a fresh run in the same directory (which
    moves the earlier run's records aside) starts another, so a sync keeps the two apart."""
    args = ["model=gpt_test", "batch_size=8", "steps=2", "eval_every=1000", "monitor=off", "logger.progress=false",
            "logger.wandb=offline"]
    id_file = tmp_path / "wandb_id.txt"
    train(tmp_path, *args)
    first = id_file.read_text()
    train(tmp_path, *args, "seed=1")
    second = id_file.read_text()
    assert second != first
    train(tmp_path, *args, "seed=1", "steps=3", "resume=auto")
    assert id_file.read_text() == second


def test_wandb_online_that_cannot_start_logs_offline_for_a_later_sync(tmp_path, monkeypatch, capsys):
    """logger=wandb_online without an API key (or a network) dropped wandb altogether: no run to
    upload once the key is there."""
    import wandb
    from omegaconf import OmegaConf

    from stabletrain.metrics import Metrics

    modes = []

    class Run:
        def define_metric(self, name, **kw):
            pass

        def log(self, values, **kw):
            pass

        def finish(self):
            pass

    def init(**kw):
        modes.append((kw["mode"], kw["id"]))
        if kw["mode"] == "online":
            raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.\nsecond line")
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    cfg = OmegaConf.create({"wandb": "online", "project": "p", "entity": None, "progress": False, "log_every": 1})
    m = Metrics(tmp_path, cfg)
    m.close()
    assert [mode for mode, _ in modes] == ["online", "offline"] and modes[0][1] == modes[1][1]  # one run id
    assert isinstance(m.wandb, Run)
    assert capsys.readouterr().err == (
        "wandb online failed (UsageError: No API key configured. Use `wandb login` to log in.); logging offline "
        f"instead: `wandb sync {tmp_path}/wandb/offline-run-*` uploads it later\n")
