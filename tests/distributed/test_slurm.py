"""SLURM without a cluster: srun's environment, the submitit job script, preemption and requeue.

``sbatch``, ``srun`` and ``scontrol`` are stand-ins (tests/distributed/common.py). A sweep is
submitted the way ``python train.py -m hydra/launcher=slurm ...`` does it (Hydra's sweeper,
the submitit plugin, submitit's SlurmExecutor) up to the ``sbatch`` call; then a job is run
as SLURM would run it (``python -m submitit.core._submit`` with SLURM's variables), is sent
the signal its job script asks SLURM for, and is run again as a requeued job.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

from stabletrain.config import ConfigError
from stabletrain.engine import distributed as D
from stabletrain.engine.loop import Trainer
from tests.distributed.common import GPT, clean_env, fake_slurm_tools, signal_once_running, start, wait_ok
from tests.helpers import ROOT, losses, train

# Few steps keep the test quick; 27 steps after the warning still outlast the 20 ms polling.
JOB = ["steps=30", "batch_size=8", "ckpt_every=1000", *GPT]
LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=proj",
            "hydra.launcher.qos=low", "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=4"]


def submit_sweep(overrides: list[str]) -> None:
    """``python train.py -m <overrides>``, in this process, without configuring logging."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT))
    import train

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3", job_name="train"):
        hydra = GlobalHydra.instance().hydra
        cfg = hydra.compose_config("train", overrides, run_mode=RunMode.MULTIRUN)
        ctx = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
        sweeper = Plugins.instance().instantiate_sweeper(hydra_context=ctx, task_function=train.main.__wrapped__,
                                                         config=cfg)
        sweeper.sweep(arguments=OmegaConf.to_container(cfg.hydra.overrides.task))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A two-point sweep submitted to the fake SLURM: (sweep dir, env with the fake tools, scontrol log)."""
    base = tmp_path_factory.mktemp("slurm")
    log = base / "scontrol.log"
    tools = fake_slurm_tools(base / "bin", log)
    sweep_dir = base / "sweep"
    from submitit.slurm.slurm import SlurmJob

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", tools["PATH"])
        # launch() waits for the jobs' results; nothing runs them until the test does.
        mp.setattr(SlurmJob, "results", lambda self: [SimpleNamespace(return_value=None)])
        submit_sweep([*LAUNCHER, f"hydra.sweep.dir={sweep_dir}", "hydra.sweep.subdir=${hydra.job.num}",
                      *JOB, "optim.tau=0.01,0.02"])
    return SimpleNamespace(dir=sweep_dir, env=tools, scontrol=log)


def test_slurm_launcher_writes_one_array_job_of_ddp_tasks(sweep):
    script = (sweep.dir / ".submitit" / "4242" / "4242_submission.sh").read_text()
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))
    assert flags["array"] == "0-1%2"  # one job per sweep point
    assert (flags["partition"], flags["account"], flags["qos"]) == ("gpu", "proj", "low")
    assert (flags["nodes"], flags["gpus-per-node"], flags["ntasks-per-node"]) == ("2", "4", "4")  # a rank per GPU
    # memory per GPU, so that a 1-GPU job does not ask for a whole node's (480GB before)
    assert flags["time"] == "1440" and flags["mem-per-gpu"] == "60G" and "mem" not in flags
    assert flags["cpus-per-task"] == "10"
    assert re.fullmatch(r"USR[12]@120", flags["signal"]) and "requeue" in flags
    assert re.search(r"^srun .* -m submitit\.core\._submit .*\.submitit/%j$", script, re.M)
    for point in (0, 1):
        assert (sweep.dir / ".submitit" / f"4242_{point}" / f"4242_{point}_submitted.pkl").is_file()


def test_preempted_slurm_job_checkpoints_requeues_and_resumes_identically(sweep, tmp_path):
    script = (sweep.dir / ".submitit" / "4242" / "4242_submission.sh").read_text()
    warning = getattr(signal, "SIG" + re.search(r"--signal=(USR[12])@", script).group(1))
    cmd = [sys.executable, "-u", "-m", "submitit.core._submit", str(sweep.dir / ".submitit" / "%j")]
    env = clean_env(**sweep.env, SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4243", SLURM_ARRAY_JOB_ID="4242",
                    SLURM_ARRAY_TASK_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1",
                    SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1")
    run_dir = sweep.dir / "0"

    log = tmp_path / "attempt1.log"
    proc = start(cmd, cwd=ROOT, env=env, log=log)
    signal_once_running(proc, run_dir, warning, after_step=3)
    out = wait_ok(proc, log, expect=255)  # submitit requeues, then exits with -1
    assert sweep.scontrol.read_text().split() == ["requeue", "4242_0"], out[-3000:]
    k = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 3 <= k < 30, f"stopped at step {k}: the warning came too late to test a resume"
    assert '"interrupted"' in (run_dir / "summary.json").read_text()
    assert (run_dir / ".hydra" / "config.yaml").is_file()  # rank_zero_only resolved inside the task

    log = tmp_path / "attempt2.log"
    wait_ok(start(cmd, cwd=ROOT, env=env, log=log), log)  # SLURM starts the requeued job afresh
    assert f"resumed from step {k}" in log.read_text()
    assert '"completed"' in (run_dir / "summary.json").read_text()

    train(tmp_path / "reference", *JOB, "optim.tau=0.01")
    got, want = losses(run_dir), losses(tmp_path / "reference")
    assert sorted(got) == sorted(want) == list(range(1, 31))
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=1e-7), s


def _preempted_at(monkeypatch, tmp_path, job: str, at: int):
    """SLURM's stand-ins, and SIGUSR1 during the ``at``-th training step: (scontrol's log, the real step)."""
    log = tmp_path / "scontrol.log"
    monkeypatch.setenv("PATH", fake_slurm_tools(tmp_path / "bin", log)["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", job)
    step, calls = Trainer.train_step, []

    def warned(self, *a, **k):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(self, *a, **k)

    monkeypatch.setattr(Trainer, "train_step", warned)
    return log, step


def test_plain_sbatch_preemption_warning_requeues_and_the_rerun_resumes(tmp_path, monkeypatch):
    """A job script of one's own (``#SBATCH --signal=USR1@90``, ``srun python train.py ...``)."""
    args = [*GPT, "steps=8", "batch_size=8"]
    log, step = _preempted_at(monkeypatch, tmp_path, "77", 5)
    s = train(tmp_path / "run", *args)
    assert s["status"] == "interrupted" and "SIGUSR1" in s["reason"] and s["step"] == 5
    assert log.read_text().split() == ["requeue", "77"]

    monkeypatch.setattr(Trainer, "train_step", step)
    assert train(tmp_path / "run", *args)["status"] == "completed"  # no resume=...: SLURM implies it
    train(tmp_path / "reference", *args)
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "reference"), rel=1e-6)

    config = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="another optim.lr; pass resume=auto resume_allow_changes=true"):
        train(tmp_path / "run", *args, "optim.lr=0.5")
    assert (tmp_path / "run" / "config.yaml").read_text() == config


def test_a_preemption_warning_while_the_run_is_built_still_requeues(tmp_path, monkeypatch):
    """SIGUSR1 before the loop answers signals would end the process (its default action) and
    lose the requeue: it is held, the loop checkpoints after its first step, and the job requeues;
    the handler in place before (submitit's, here a stand-in) is back afterwards."""
    from stabletrain import build as build_module

    log = tmp_path / "scontrol.log"
    monkeypatch.setenv("PATH", fake_slurm_tools(tmp_path / "bin", log)["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    real_build = build_module.build_trainer

    def build(*a, **k):
        os.kill(os.getpid(), signal.SIGUSR1)  # say, while a large data set is indexed
        return real_build(*a, **k)

    def before(signum, frame):
        raise AssertionError("the earlier handler runs only where requeue_after calls it")

    monkeypatch.setattr(build_module, "build_trainer", build)
    previous = signal.signal(signal.SIGUSR1, before)
    try:
        s = train(tmp_path / "run", *GPT, "steps=8", "batch_size=8")
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert s["status"] == "interrupted" and "SIGUSR1" in s["reason"] and s["step"] == 1
    assert log.read_text().split() == ["requeue", "78"]
    assert torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)["step"] == 1


def test_a_preemption_warning_while_a_resume_loads_still_requeues(tmp_path, monkeypatch):
    """Between the build and the loop's own handlers (a checkpoint read from slow storage, wandb's
    start) SIGUSR1 ended the process, without a requeue and with the earlier attempt's summary.json."""
    args = [*GPT, "steps=8", "batch_size=8", "ckpt_every=2"]
    log, step = _preempted_at(monkeypatch, tmp_path, "79", 3)
    assert train(tmp_path / "run", *args)["step"] == 3
    monkeypatch.setattr(Trainer, "train_step", step)
    real_resume = Trainer.maybe_resume

    def slow_load(self):
        os.kill(os.getpid(), signal.SIGUSR1)  # the next warning, while the requeued attempt loads last.pt
        return real_resume(self)

    monkeypatch.setattr(Trainer, "maybe_resume", slow_load)
    s = train(tmp_path / "run", *args)
    assert s["status"] == "interrupted" and "SIGUSR1" in s["reason"] and s["step"] == 4
    assert log.read_text().split() == ["requeue", "79", "requeue", "79"]


def test_srun_environment_gives_ranks_and_rendezvous(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)
    # A batch script sees the allocation but is a single process.
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert D.detect() == D.DistInfo()
    # A task started by srun.
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert D.detect() == D.DistInfo(rank=5, world=8, local_rank=1)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[007-009,012],cpu1")
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the node list is read here
    env = D.slurm_rendezvous(os.environ)
    assert env == {"MASTER_ADDR": "gpu007", "MASTER_PORT": str(20000 + 123456 % 20000)}
    assert D.first_host("node17") == "node17" and D.first_host("a1,b[2-3]") == "a1"
    # torchrun inside an allocation wins over srun's variables.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert D.detect() == D.DistInfo(rank=1, world=2, local_rank=1)


@pytest.mark.parametrize("env, subdir", [({}, ".hydra"), ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "0"}, ".hydra"),
                                         ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}, None)])
def test_only_rank_zero_of_a_multi_task_job_writes_hydra_files(monkeypatch, env, subdir, tmp_path):
    import logging

    from hydra.core.utils import configure_log

    from stabletrain.config import register

    register()  # the structured schema, as train.py registers it

    from hydra import compose, initialize_config_dir

    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    assert cfg.hydra.output_subdir == subdir  # Hydra writes .hydra/ only when this is not None
    # the job log: what Hydra's job setup does with it, in a run dir of our own
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_log(cfg.hydra.job_logging)
        logging.getLogger("stabletrain.test").info("hello")
        files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
        assert [h.level <= logging.INFO for h in files] == [bool(subdir)]  # the others' takes no record
        for h in files:
            h.close()
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    log = tmp_path / f"{cfg.hydra.job.name}.log"
    assert log.is_file() == bool(subdir)
    if subdir:
        assert "hello" in log.read_text()


def test_ranks_that_caught_different_signals_agree_on_the_preemption_warning():
    """The value each rank puts into agree_on_signal's MAX all-reduce: a requeue warning (SIGUSR1,
    SIGUSR2) wins over another rank's SIGTERM or SIGINT (by number SIGTERM would win, and the job
    would stop without the requeue it was warned of)."""
    def agreed(*caught):  # what the all-reduce hands every rank
        return max(D.signal_rank(s) for s in caught) % 256 or None

    assert agreed(signal.SIGTERM, signal.SIGUSR1) == signal.SIGUSR1
    assert agreed(signal.SIGINT, signal.SIGUSR2, signal.SIGTERM) == signal.SIGUSR2
    assert agreed(signal.SIGINT, signal.SIGTERM) == signal.SIGTERM
    assert agreed(None, signal.SIGINT) == signal.SIGINT
    assert agreed(None, None) is None


def test_a_requeued_job_started_with_resume_path_goes_on_from_its_own_checkpoint(tmp_path, monkeypatch):
    """``resume=PATH`` (another run's checkpoint) on the command line: the requeued attempt runs
    the same command, and must continue from its own last.pt, not start again from PATH."""
    monkeypatch.setenv("PATH", fake_slurm_tools(tmp_path / "bin", tmp_path / "scontrol.log")["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    train(tmp_path / "pre", *GPT, "steps=6", "batch_size=8")
    args = [*GPT, "steps=14", "batch_size=8", "ckpt_every=4", f"resume={tmp_path / 'pre/checkpoints/last.pt'}"]
    step = Trainer.train_step
    calls = []

    def warned_at_step_10(self, *a, **k):
        calls.append(1)
        if len(calls) == 4:  # steps 7, 8, 9, 10
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(self, *a, **k)

    monkeypatch.setattr(Trainer, "train_step", warned_at_step_10)
    assert train(tmp_path / "run", *args)["step"] == 10
    calls.clear()

    def counted(self, *a, **k):
        calls.append(1)
        return step(self, *a, **k)

    monkeypatch.setattr(Trainer, "train_step", counted)
    s = train(tmp_path / "run", *args)
    assert s["status"] == "completed" and len(calls) == 4  # steps 11 to 14, not 7 to 14 again
    train(tmp_path / "reference", *args)
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "reference"), rel=1e-6)
    # pre's records up to its checkpoint (steps 1-6), then this run's, each step once
    assert sorted(losses(tmp_path / "run")) == list(range(1, 15))


def test_a_sigterm_after_the_preemption_warning_does_not_cancel_the_requeue(tmp_path, monkeypatch):
    """SLURM's SIGTERM can land while the run writes the checkpoint its SIGUSR1 asked for: the
    warning still decides, in the summary and in the requeue."""
    log = tmp_path / "scontrol.log"
    monkeypatch.setenv("PATH", fake_slurm_tools(tmp_path / "bin", log)["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "79")
    step, save = Trainer.train_step, Trainer.save
    calls = []

    def warned_at_step_3(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(self, *a, **k)

    def killed_while_saving(self, ring=False):
        if self.stop_signal == signal.SIGUSR1:
            os.kill(os.getpid(), signal.SIGTERM)
        return save(self, ring)

    monkeypatch.setattr(Trainer, "train_step", warned_at_step_3)
    monkeypatch.setattr(Trainer, "save", killed_while_saving)
    s = train(tmp_path / "run", *GPT, "steps=8", "batch_size=8")
    assert s["status"] == "interrupted" and s["signal"] == signal.SIGUSR1 and "SIGUSR1" in s["reason"]
    assert log.read_text().split() == ["requeue", "79"]
