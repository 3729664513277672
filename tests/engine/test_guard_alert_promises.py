"""The promises of the health alerts, the crash forensics, the step guard, the host-memory check
and the run directory's helpers that no other test holds, each checked directly on small inputs."""

import contextlib
import shlex
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from stabletrain.engine import memory as M
from stabletrain.engine import rundir as R
from stabletrain.errors import ConfigError
from stabletrain.monitor import alerts as A
from tests.helpers import alert_metrics

NO_AUTOCAST = contextlib.nullcontext
SEC_HIGH = {1: 0.9, 2: 0.99, 4: 0.999, 8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}  # d_h = 64, s* = 4



# --- health alerts ----------------------------------------------------------------------------


def test_the_alert_message_states_each_condition_with_its_values():
    """The message names the step, the block, the entropy against its floor, sigma1's growth and
    the step it grew from, and SEC(d_h, s*) against its threshold."""
    watch = A.HealthWatch()
    assert watch.update(0, alert_metrics(qk=2.0, ent=2.0, sec=SEC_HIGH)) == []
    (alert,) = watch.update(10, alert_metrics(qk=50.0, ent=0.01))
    assert alert["message"] == ("step 10: malignant entropy collapse at blocks.0: min attention entropy 0.01 < 0.1 "
                                "nats, max sigma1(Wq^h^T Wk^h) 50 = 25.0x its value at step 0, SEC(64,4) = 0.9990 "
                                "(at step 0) > 0.99")  # the weight pass of step 0 measured it


def test_a_zero_sigma1_is_no_reference_for_growth():
    """sigma1(Wq^T Wk) = 0 (a zero-initialised query) is skipped, not divided by: growth is measured
    from the first positive value."""
    watch = A.HealthWatch()
    assert watch.update(0, alert_metrics(qk=0.0, ent=2.0)) == []
    assert watch.update(10, alert_metrics(qk=1.0, ent=0.05)) == []
    (alert,) = watch.update(20, alert_metrics(qk=50.0))
    assert alert["step"] == 20 and "50.0x its value at step 10" in alert["message"]


def test_a_non_finite_entropy_keeps_the_last_finite_one():
    """After a recovery (entropy 1.0), a NaN entropy is ignored: the block stays recovered and no
    alert fires, though sigma1's growth and SEC still hold."""
    watch = A.HealthWatch()
    watch.update(0, alert_metrics(qk=1.0, ent=2.0, sec=SEC_HIGH))
    assert len(watch.update(10, alert_metrics(qk=50.0, ent=0.01))) == 1
    assert watch.update(20, alert_metrics(ent=1.0)) == []
    assert watch.update(30, alert_metrics(ent=float("nan"))) == []
    assert watch.blocks["blocks.0"].entropy_min == 1.0


def test_alerts_of_one_step_come_in_depth_order():
    """Two blocks collapsing at the same step: blocks.2 is reported before blocks.10."""
    watch = A.HealthWatch()
    first, then = {}, {}
    for b in ("blocks.10", "blocks.2"):
        first.update(alert_metrics(qk=1.0, ent=2.0, sec=SEC_HIGH, block=b))
        then.update(alert_metrics(qk=50.0, ent=0.01, block=b))
    watch.update(0, first)
    assert [a["layer"] for a in watch.update(10, then)] == ["blocks.2", "blocks.10"]


# --- crash forensics: growth_summary ----------------------------------------------------------


def _sigma_history(series, quantity="wq_t_wk_max"):
    steps = sorted({s for pts in series.values() for s, _ in pts})
    hist = [{"step": s} for s in steps]
    for block, pts in series.items():
        for s, v in pts:
            hist[steps.index(s)][f"sigma1/{block}/{quantity}"] = v
    return hist


def test_growth_summary_skips_a_block_that_starts_at_zero():
    """A block whose window starts at 0 has no growth factor: the other block is named, no crash."""
    hist = _sigma_history({"blocks.0": [(0, 0.0), (100, 5.0)], "blocks.1": [(0, 2.0), (100, 5.0)]})
    assert A.growth_summary(hist) == ("max sigma1(Wq^T Wk) grew 2.5x in 100 steps at blocks.1 "
                                      "(2 at step 0 -> 5 at step 100)")


def test_growth_summary_ignores_the_non_finite_last_values_of_the_crash():
    """The crash step's NaN is not the last value: growth runs to the last finite one."""
    hist = _sigma_history({"blocks.0": [(0, 2.0), (100, 30.0), (150, float("nan"))]})
    assert A.growth_summary(hist) == ("max sigma1(Wq^T Wk) grew 15x in 100 steps at blocks.0 "
                                      "(2 at step 0 -> 30 at step 100)")


def test_growth_summary_default_window_is_200_steps_and_none_is_the_whole_history():
    hist = _sigma_history({"blocks.0": [(0, 1.0), (800, 2.0), (900, 4.0), (1000, 8.0)]})
    assert A.growth_summary(hist) == ("max sigma1(Wq^T Wk) grew 4x in 200 steps at blocks.0 "
                                      "(2 at step 800 -> 8 at step 1000)")
    assert A.growth_summary(hist, window=None) == ("max sigma1(Wq^T Wk) grew 8x in 1000 steps at blocks.0 "
                                                   "(1 at step 0 -> 8 at step 1000)")


# --- crash forensics: first_nonfinite ---------------------------------------------------------


class _Overflows(nn.Module):
    """The top module's own code, after its only child, overflows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) * float("inf")


class _DictHead(nn.Module):
    def forward(self, x):
        return {"logits": x * float("inf")}


class _WithDictHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.head = _DictHead()

    def forward(self, x):
        return self.head(self.lin(x))["logits"]


def test_first_nonfinite_names_the_top_modules_own_code_and_looks_into_dict_outputs():
    x = torch.randn(2, 3)
    assert A.first_nonfinite(_Overflows(), lambda m: m(x)) == A.ROOT == "(model)"
    assert A.first_nonfinite(_WithDictHead(), lambda m: m(x)) == "head"


def test_first_nonfinite_runs_the_forward_without_autograd():
    seen = []
    A.first_nonfinite(nn.Linear(3, 3), lambda m: seen.append(torch.is_grad_enabled()) or m(torch.ones(1, 3)))
    assert seen == [False]


# --- the step guard ---------------------------------------------------------------------------


def _guarded_step(guard, opt, model, x, scale, ema=None):
    from stabletrain.engine.guard import StepGuard

    assert isinstance(guard, StepGuard)
    guard.begin()
    (model(x).sum() * scale).backward()
    finite = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).sum().isfinite()
    guard.step(finite, lambda: (opt.step(), ema.after_step(model, 0) if ema is not None else None))
    opt.zero_grad(set_to_none=True)


def test_the_copy_path_restores_a_weight_average_that_could_skip_by_itself():
    """SGD (no found_inf): the fp32 average could skip exactly, but only the found_inf path tells
    it to; here the guard copies it, so a non-finite step leaves it bit-exact."""
    from stabletrain.engine.ema import WeightEma
    from stabletrain.engine.guard import StepGuard

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = WeightEma(model, 0.9)
    guard = StepGuard(model, opt, ema)
    assert not guard.found_inf and ema.skips_exactly
    x = torch.ones(2, 4)
    _guarded_step(guard, opt, model, x, 1.0, ema)
    average = {k: v.clone() for k, v in ema.module.state_dict().items()}
    _guarded_step(guard, opt, model, x, float("nan"), ema)
    assert all(torch.equal(average[k], v) for k, v in ema.module.state_dict().items())


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)
        self.use_b = False

    def forward(self, x):
        return self.a(x) + (self.b(x) if self.use_b else 0)


def test_a_parameter_without_optimizer_state_yet_keeps_the_step_from_running():
    """b got no gradient in step 1, so no SGD state: a non-finite step 2 must not create its momentum
    (the guard never copied it, so it could not be put back), only a's state exists after it."""
    from stabletrain.engine.guard import StepGuard

    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = StepGuard(model, opt)
    x = torch.ones(2, 4)
    _guarded_step(guard, opt, model, x, 1.0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model.a.weight]["momentum_buffer"].clone()
    model.use_b = True
    _guarded_step(guard, opt, model, x, float("nan"))
    assert not opt.state.get(model.b.weight) and not opt.state.get(model.b.bias)
    assert torch.equal(opt.state[model.a.weight]["momentum_buffer"], momentum)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_the_guard_leaves_no_skip_flag_on_the_optimizer():
    """After a skipped step the fused optimizer's found_inf is cleared: a later step outside the
    guard updates the weights."""
    from stabletrain.engine.guard import StepGuard

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = StepGuard(model, opt)
    assert guard.found_inf
    x = torch.ones(2, 4)
    _guarded_step(guard, opt, model, x, 1.0)
    _guarded_step(guard, opt, model, x, float("nan"))
    assert getattr(opt, "found_inf", None) is None
    before = model.weight.detach().clone()
    model(x).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before)


# --- the host-memory check --------------------------------------------------------------------


def test_sizes_switch_from_mb_to_gb_at_100_mb():
    assert (M.size(99.9e6), M.size(1e8), M.size(2.5e8), M.size(8.1e6)) == ("99.9 MB", "0.1 GB", "0.2 GB", "8.1 MB")


def _mlp(d=7, h=33, c=5):
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, c))


def test_one_sample_counts_every_saved_tensor_per_sample():
    """x of one sample: the whole forward's saved tensors times micro (the docstring's 'one works')."""
    d, h, c = 7, 33, 5
    assert M.activation_bytes(_mlp(d, h, c), torch.randn(1, d), 100, NO_AUTOCAST) == 100 * 4 * (d + h + h + c)


def test_the_measure_is_of_a_training_forward_even_for_a_model_in_eval_mode():
    """Dropout keeps its noise only in training: an eval-mode model is measured as it trains."""
    d, h, c = 7, 33, 5
    model = nn.Sequential(nn.Linear(d, h), nn.Dropout(0.5), nn.Linear(h, c))
    model.train()
    trained = M.saved_bytes(model, torch.randn(1, d), NO_AUTOCAST)
    assert trained == 4 * (d + h + h + c)  # dropout's fp32 noise besides what the MLP keeps
    model.eval()
    assert M.saved_bytes(model, torch.randn(1, d), NO_AUTOCAST) == trained and not model.training


def test_exactly_the_free_memory_fits_one_byte_less_does_not():
    model, x = _mlp(), torch.randn(4, 7)
    acts = M.activation_bytes(model, x, 1000, NO_AUTOCAST)
    assert M.check_host_memory(model, x, micro=1000, autocast=NO_AUTOCAST, available=acts) is None
    with pytest.raises(ConfigError):
        M.check_host_memory(model, x, micro=1000, autocast=NO_AUTOCAST, available=acts - 1)


def test_each_local_process_needs_its_own_activations(monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE=4: four times a micro-batch's activations must be free."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model, x = _mlp(), torch.randn(4, 7)
    acts = M.activation_bytes(model, x, 1000, NO_AUTOCAST)  # 312 KB
    with pytest.raises(ConfigError, match=rf"needs at least {M.size(4 * acts)} more memory \(the activations of "
                                          r"a micro-batch of 1000 samples in each of 4 processes\)"):
        M.check_host_memory(model, x, micro=1000, autocast=NO_AUTOCAST, available=3 * acts)


class _Block(nn.Module):
    def __init__(self, d=10, h=1000):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))

    def forward(self, x):
        return x + self.mlp(x)


def test_a_checkpointed_model_is_not_told_to_checkpoint():
    from stabletrain.engine.sharding import apply_activation_checkpointing

    model = nn.Sequential(_Block())
    apply_activation_checkpointing([("0", model[0])])
    with pytest.raises(ConfigError) as err:
        M.check_host_memory(model, torch.randn(4, 10), micro=1000, autocast=NO_AUTOCAST, available=1000)
    assert str(err.value).endswith("set micro_batch_size to accumulate smaller micro-batches, or train on a GPU")


def test_unknown_free_memory_refuses_nothing(monkeypatch):
    """Where /proc/meminfo cannot be read (not Linux) the check passes silently."""
    monkeypatch.setattr(M, "available_bytes", lambda: None)
    assert M.check_host_memory(_mlp(), torch.randn(4, 7), micro=10**6, autocast=NO_AUTOCAST) is None


def _fake_system(tmp_path, monkeypatch, meminfo, cgroup=None):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(meminfo)
    if cgroup is not None:
        (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
        for name, text in cgroup.items():
            (tmp_path / "sys/fs/cgroup" / name).write_text(text)
    monkeypatch.setattr(M, "Path", lambda p: tmp_path / str(p).lstrip("/"))


MEMINFO = "MemTotal:       16000000 kB\nMemAvailable:    1000000 kB\nSwapFree:         500000 kB\n"


def test_free_memory_is_memavailable_plus_free_swap(tmp_path, monkeypatch):
    _fake_system(tmp_path, monkeypatch, MEMINFO, {"memory.max": "max\n"})
    assert M.available_bytes() == 1_500_000 * 1024


def test_a_cgroup_limit_caps_free_memory_less_what_it_uses_but_its_page_cache(tmp_path, monkeypatch):
    """memory.max 1e9, 700 MB charged of which 300 MB inactive page cache (given back): 600 MB free."""
    _fake_system(tmp_path, monkeypatch, MEMINFO, {"memory.max": "1000000000\n", "memory.current": "700000000\n",
                                                  "memory.stat": "anon 400000000\ninactive_file 300000000\n"})
    assert M.available_bytes() == 600_000_000


def test_a_cgroup_limit_above_the_machines_free_memory_changes_nothing(tmp_path, monkeypatch):
    _fake_system(tmp_path, monkeypatch, MEMINFO, {"memory.max": "100000000000\n", "memory.current": "0\n",
                                                  "memory.stat": "inactive_file 0\n"})
    assert M.available_bytes() == 1_500_000 * 1024


# --- the run directory ------------------------------------------------------------------------


def test_the_continuing_command_drops_a_forced_run_dir_override(monkeypatch):
    """'++hydra.run.dir=...' places the run like 'hydra.run.dir=...': the command names the dir once."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    got = R.command(["++hydra.run.dir=/old", "model=gpt_test"], "hydra.run.dir", "/runs/a")
    assert got == f"{shlex.quote(R.interpreter())} train.py model=gpt_test resume=auto hydra.run.dir=/runs/a"


def test_no_figures_command_without_the_scripts_beside_the_package(tmp_path, monkeypatch):
    """Installed from a wheel (no scripts/plot_dynamics.py two levels up): None, not a command that fails."""
    monkeypatch.setattr(R, "__file__", str(tmp_path / "site-packages/stabletrain/engine/rundir.py"))
    assert R.figures_command(tmp_path / "run") is None


def test_a_refused_attempt_puts_the_run_dirs_hydra_record_back(tmp_path):
    """Exit code 2 (a refusal) in the run dir named last (Hydra's rule): its .hydra/ is as before,
    files the attempt added removed."""
    run = tmp_path / "run"
    record = run / ".hydra"
    record.mkdir(parents=True)
    (record / "overrides.yaml").write_text("- steps=3\n")
    argv = [f"hydra.run.dir={tmp_path / 'elsewhere'}", "model=gpt_test", f"hydra.run.dir={run}"]
    with pytest.raises(SystemExit), R.KeptHydraRecord(argv):
        (record / "overrides.yaml").write_text("- steps=9\n")
        (record / "config.yaml").write_text("new\n")
        raise SystemExit(2)
    assert {p.name: p.read_text() for p in record.iterdir()} == {"overrides.yaml": "- steps=3\n"}


@pytest.mark.parametrize("code, multirun", [(0, False), (1, False), (2, True)])
def test_an_attempt_that_is_no_refused_run_keeps_its_record(tmp_path, code, multirun):
    """A run that ended (0), crashed (1), or a multirun (its points have their own .hydra/): the
    record Hydra wrote stays."""
    record = tmp_path / ".hydra"
    record.mkdir()
    (record / "overrides.yaml").write_text("- steps=3\n")
    with pytest.raises(SystemExit), R.KeptHydraRecord([*(["-m"] if multirun else []), f"hydra.run.dir={tmp_path}"]):
        (record / "overrides.yaml").write_text("- steps=9\n")
        raise SystemExit(code)
    assert (record / "overrides.yaml").read_text() == "- steps=9\n"


def test_a_holder_that_wrote_no_pid_is_named_unknown(tmp_path):
    """A released lock file is empty; a process holding it again before writing its pid (check_free
    holds it a moment) is 'pid unknown', not 'pid '."""
    import fcntl
    import os

    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(ConfigError, match=r"is in use by another run \(pid unknown holds "):
            R.RunDirLock(tmp_path).acquire()
    finally:
        os.close(fd)


def test_a_lock_that_is_not_held_removes_no_directory(tmp_path):
    """release_and_remove_unused removes the run dir only under the lock (no other run is in it then)."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    R.RunDirLock(run).release_and_remove_unused()
    assert (run / ".hydra").is_dir()
    R.RunDirLock(run).acquire().release_and_remove_unused()
    assert not run.exists()


def test_an_optimizer_without_state_reads_the_flag_on_the_host_only_at_its_first_step(monkeypatch):
    """SGD without momentum keeps no state: 'every parameter has state' never held, so the flag
    was read on the host at every step (a sync the guard promises once). A non-finite step is
    still undone."""
    from stabletrain.engine.guard import StepGuard

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    guard = StepGuard(model, opt)
    x = torch.ones(2, 4)
    _guarded_step(guard, opt, model, x, 1.0)
    reads = []
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(t) or bool(t.item()))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _guarded_step(guard, opt, model, x, float("nan"))
    assert guard._complete and reads == []
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    _guarded_step(guard, opt, model, x, 1.0)
    assert not all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_an_alert_names_the_step_of_a_value_measured_before_it():
    """The probe found entropy 0 at step 50, SEC crossed 0.99 at the weight pass of step 80: the
    alert said 'step 80: min attention entropy 0', a step-50 value as a step-80 one."""
    w = A.HealthWatch()
    assert w.update(0, alert_metrics(qk=1.0, sec={2: 0.4, 16: 1.0})) == []
    assert w.update(50, alert_metrics(ent=0.0)) == []
    (alert,) = w.update(80, alert_metrics(qk=300.0, sec={2: 0.995, 16: 1.0}))
    assert alert["message"] == ("step 80: malignant entropy collapse at blocks.0: min attention entropy 0 (at step 50) "
                                "< 0.1 nats, max sigma1(Wq^h^T Wk^h) 300 = 300.0x its value at step 0, "
                                "SEC(16,2) = 0.9950 > 0.99")


def test_an_alert_s_onset_is_where_its_collapse_began():
    """sigma1 past 10x its reference at step 10, entropy under the floor from step 50, SEC at step
    80: a rollback from the step-80 alert to the ring's step 70 restored the collapse itself."""
    w = A.HealthWatch()
    w.update(0, alert_metrics(qk=1.0, ent=2.5, sec={2: 0.4, 16: 1.0}))
    w.update(10, alert_metrics(qk=20.0))  # the growth: 20x
    w.update(40, alert_metrics(ent=0.5))
    w.update(50, alert_metrics(ent=0.0))  # the entropy's spell under the floor begins
    w.update(60, alert_metrics(ent=0.05))
    (alert,) = w.update(80, alert_metrics(qk=30.0, sec={2: 0.995, 16: 1.0}))
    assert alert["onset"] == 10
    w = A.HealthWatch()
    w.update(0, alert_metrics(qk=1.0, ent=2.5, sec={2: 0.4, 16: 1.0}))
    w.update(50, alert_metrics(ent=0.0))
    w.update(60, alert_metrics(ent=0.5))  # back over the floor: the spell ends
    w.update(70, alert_metrics(ent=0.01))
    (alert,) = w.update(80, alert_metrics(qk=30.0, sec={2: 0.995, 16: 1.0}))
    assert alert["onset"] == 70  # growth first logged at 80, the present spell from 70


def test_a_rollback_on_an_alert_goes_back_before_the_collapse_began_or_stops(tmp_path):
    """With no ring checkpoint before the onset, the run stops, saying so, instead of restoring a
    collapsed state and cutting the lr on it."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg

    gpt = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1", "precision=fp32",
           "divergence.action=rollback", "ckpt_every=2", "steps=12", "monitor=standard",
           "monitor.stop_on_alert=true", "monitor.rollback_on_alert=true"]
    for onset, outcome in ((5, "completed"), (1, "diverged")):
        t = build_trainer(make_cfg(*QUIET, *gpt), tmp_path / str(onset))
        real = t.monitor.after_step

        def after_step(step, last=False, t=t, real=real, onset=onset):
            real(step, last)
            if step + 1 == 9 and not t.rollbacks:
                t.monitor.stop_reason = "entropy collapse at blocks.0 (step 9)"
                t.monitor.stop_onset = onset

        t.monitor.after_step = after_step
        s = t.fit()
        assert s["status"] == outcome
        if outcome == "completed":
            assert [r["restored_step"] for r in s["rollbacks"]] == [4]  # the newest ring checkpoint before step 5
        else:
            # what the ring holds, and the ckpt.keep that would have kept step 0 (ckpt_every=2: 0, 2, 4, 6, 8)
            assert s["reason"].endswith("no ring checkpoint before step 1, where the collapse began, to roll back "
                                        "to: the ring holds step(s) 4, 6, 8 (ckpt.keep=3); ckpt.keep=5 would have "
                                        "kept step 0"), s["reason"]


def test_no_rollback_names_the_last_ring_step_before_the_onset_not_the_onset(tmp_path):
    """Trouble from step 6, ckpt_every=2, the ring holding 6 and 8: step 6 is no checkpoint from
    before the trouble (ring_before is strict), step 4 is, and ckpt.keep=3 would have kept it."""
    from stabletrain.engine.loop import Trainer
    from stabletrain.topology import DistInfo

    (tmp_path / "checkpoints").mkdir()
    for step in (6, 8):
        (tmp_path / "checkpoints" / f"step_{step}.pt").write_bytes(b"")
    fake = SimpleNamespace(run_dir=tmp_path, info=DistInfo(), settings=SimpleNamespace(ckpt_every=2, ckpt_keep=2))
    line = Trainer._no_checkpoint_before(fake, 6, "spike")
    assert line == ("no ring checkpoint before step 6 to roll back to: the ring holds step(s) 6, 8 (ckpt.keep=2); "
                    "ckpt.keep=3 would have kept step 4")
