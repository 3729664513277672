"""AdamW² with FSDP2 / HSDP sharded parameters, and the trainer with ``parallel=fsdp`` (gloo on CPU,
two ranks under torchrun)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.distributed.common import GPT, TORCHRUN, clean_env, run, torchrun_cmd
from tests.helpers import ROOT


def test_sharded_adamw2_takes_the_whole_models_steps_and_resumes(tmp_path):
    out = run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "tests/distributed/fsdp_adamw2.py")],
              cwd=tmp_path, env=clean_env(PYTHONPATH=str(ROOT)))
    assert "fsdp adamw2 ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_sharded_sigma_reparam_iterates_like_the_whole_matrices():
    out = run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "tests/distributed/fsdp_reparam.py")],
              cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)))
    assert "fsdp reparam ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_sharded_locater_gradient_counts_once_like_the_whole_models():
    """LocAteR's gradient through the differentiable gather, beside FSDP2's reduce-scatter over two
    micro-batches, in every order: the unsharded model's, exactly (float64)."""
    out = run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "tests/distributed/fsdp_locater.py")],
              cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)))
    assert "fsdp locater ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_adamw2_refuses_shardings_it_cannot_reassemble():
    """Tensor parallelism splits columns (Shard(1)); the matrix's sigma1 would need another
    reduction, so AdamW2 says so in one line instead of bounding the wrong thing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from stabletrain.optim import AdamW2

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        AdamW2([torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))])  # FSDP's: fine
        w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(1)]))
        with pytest.raises(TypeError, match=r"only from dim-0 shards \(FSDP2, HSDP\).*Shard\(dim=1\)"):
            AdamW2([w])
    finally:
        dist.destroy_process_group()


# --- the trainer with parallel=fsdp (FSDP2 fully_shard per block and root, DCP checkpoints) -----

FSDP_REL = 1e-4  # sharded reduce-scatter vs DDP all-reduce: float32 summation order (observed ~1e-7)
FSDP_ARGS = [*GPT, "schedule=constant", "eval_every=2", "ckpt.keep=0"]  # constant lr: a shorter run is a prefix


def _torchrun(run_dir, *overrides):
    out = run(torchrun_cmd(2, *FSDP_ARGS, f"hydra.run.dir={run_dir}", *overrides), cwd=run_dir.parent)
    return out.stdout + out.stderr


def _scores(run_dir, key: str) -> dict:
    from stabletrain.metrics import read_records

    return {r["step"]: r[key] for r in read_records(run_dir / "metrics.jsonl") if key in r}


def _assert_same_losses(a_dir, b_dir, rel, keys=("loss",)):
    for key in keys:
        a, b = _scores(a_dir, key), _scores(b_dir, key)
        assert sorted(a) == sorted(b) and len(a) >= (4 if key == "loss" else 2), (key, sorted(a), sorted(b))
        for s in b:
            assert a[s] == pytest.approx(b[s], rel=rel), f"{key} at step {s}: {a[s]} vs {b[s]}"


ACCUM_CLIP_AC = ["micro_batch_size=16", "grad_clip=0.5", "activation_checkpointing=true"]
# the fixes that run sharded: sigmaReparam (power iteration on the shards), LocAteR (on each attention's
# effective qkv weight, gathered) beside a logit loss term, a sharded weight average (evaluated every 2
# steps: val_ema/loss)
FIXES = ["reparam=sigma", "regularizer=[zloss,locater]", "ema.decay=0.9"]
# kappa1 = 1 (not 100): the penalty is about the task loss's size, neither hides the other in the logged
# loss (under Adam a misscaled penalty gradient moves it little: fsdp_locater.py checks the gradient itself)
LOCATER = ["regularizer.locater.scale_coef=1"]


@pytest.mark.parametrize("optim,extra", [("adamw2", [*FIXES, *LOCATER, "micro_batch_size=16"]),
                                         ("adamw", [*ACCUM_CLIP_AC, "regularizer=locater", *LOCATER])])
def test_fsdp_trains_like_ddp_and_resumes_identically(tmp_path, optim, extra):
    """With LocAteR, which reads weights outside the forward (gathered whole), with and without
    sigmaReparam, over two micro-batches a rank: the logged losses and penalty are DDP's."""
    args = [f"optim={optim}", *extra]
    _torchrun(tmp_path / "ddp", *args, "steps=4", "parallel=ddp")
    fsdp = tmp_path / "fsdp"
    _torchrun(fsdp, *args, "steps=4", "parallel=fsdp")
    keys = ("loss", "val/loss", "loss/penalty") + (("val_ema/loss", "loss/locater") if optim == "adamw2" else ())
    _assert_same_losses(fsdp, tmp_path / "ddp", FSDP_REL, keys)
    ck = torch.load(fsdp / "checkpoints" / "last.pt", weights_only=True)
    assert ck["dcp"] is True and "model" not in ck and ck["step"] == 4
    assert (fsdp / "checkpoints" / "last_dcp" / ".metadata").is_file()
    if optim != "adamw2":
        return
    cut = tmp_path / "cut"
    _torchrun(cut, *args, "steps=2", "parallel=fsdp")
    log = _torchrun(cut, *args, "steps=4", "parallel=fsdp", "resume=auto")
    assert "resumed from step 2" in log, log[-3000:]  # a fresh start would log the same losses
    _assert_same_losses(cut, fsdp, 1e-6, keys)


def test_a_save_cut_off_before_its_last_pt_resumes_from_the_previous_shards(tmp_path):
    """A save swaps the new shards in as last_dcp/ and keeps the previous ones (.last_dcp.old) until
    the new last.pt is written: a kill between the two leaves a last.pt whose shards are the
    previous ones, and the resume finds them there (exactly: the losses of an uncut run)."""
    args = ["optim=adamw2", "parallel=fsdp"]
    whole = tmp_path / "whole"
    _torchrun(whole, *args, "steps=4")
    cut = tmp_path / "cut"
    _torchrun(cut, *args, "steps=2")
    for name in ("swapped", "lost"):
        shutil.copytree(cut, tmp_path / name)
    ckpts = {d: tmp_path / d / "checkpoints" for d in ("cut", "swapped", "lost")}
    # killed between moving last_dcp/ aside and moving the new shards in
    (ckpts["cut"] / "last_dcp").rename(ckpts["cut"] / ".last_dcp.old")
    # killed after the new shards (step 4's) were moved in, before their last.pt
    (ckpts["swapped"] / "last_dcp").rename(ckpts["swapped"] / ".last_dcp.old")
    shutil.copytree(whole / "checkpoints" / "last_dcp", ckpts["swapped"] / "last_dcp")
    for d in ("cut", "swapped"):
        log = _torchrun(tmp_path / d, *args, "steps=4", "resume=auto")
        assert "resumed from step 2" in log and "resumed from them, and moved them back to last_dcp/" in log, log
        _assert_same_losses(tmp_path / d, whole, 1e-6)
        assert not (ckpts[d] / ".last_dcp.old").exists() and (ckpts[d] / "last_dcp" / ".metadata").is_file()
    # shards of another step and none beside them: one line that says so, not a load_state_dict error
    shutil.rmtree(ckpts["lost"] / "last_dcp")
    shutil.copytree(whole / "checkpoints" / "last_dcp", ckpts["lost"] / "last_dcp")
    out = subprocess.run(torchrun_cmd(2, *FSDP_ARGS, *args, "steps=4", "resume=auto",
                                      f"hydra.run.dir={tmp_path / 'lost'}"),
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert ("the sharded weights of " in out.stderr and "(step 2) are not beside it (last_dcp/ holds step 4)"
            in out.stderr and "start a new run" in out.stderr), out.stderr[-3000:]


@pytest.mark.parametrize("nan_at,restored", [(6, 4), (2, 0)])
def test_fsdp_rolls_back_like_ddp(tmp_path, nan_at, restored):
    """A NaN step rolls back to the ring's sharded checkpoint (step_N.pt with step_N_dcp/), the
    weight average with it, and the run goes on as DDP's does; step 0's checkpoint holds no
    optimizer state (DCP would make one with a zero step, counting a step)."""
    args = ["steps=10", "divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4", "ckpt.keep=2",
            f"debug.nan_at_step={nan_at}", "batch_size=16", "ema.decay=0.9", "eval_every=5"]
    for par in ("ddp", "fsdp"):
        run(torchrun_cmd(2, *GPT, *args, f"parallel={par}", f"hydra.run.dir={tmp_path / par}"), cwd=tmp_path)
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("fsdp", "ddp"))
    assert a["status"] == b["status"] == "completed"
    assert a["rollbacks"] == b["rollbacks"] and a["rollbacks"][0]["restored_step"] == restored
    _assert_same_losses(tmp_path / "fsdp", tmp_path / "ddp", FSDP_REL, ("loss", "val/loss", "val_ema/loss"))
    ckpts = tmp_path / "fsdp" / "checkpoints"
    ring = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))
    assert ring == ["step_000008.pt", "step_000008_dcp", "step_000010.pt", "step_000010_dcp"], ring



def test_an_fsdp_runs_export_is_the_one_process_runs(tmp_path):
    """scripts/export_weights.py of a parallel=fsdp run reads its last_dcp/: its weights and (--ema)
    its weight average, sigmaReparam folded, are those of the same run in one process."""
    from tests.helpers import train

    args = ["reparam=sigma", "ema.decay=0.5", "steps=2"]
    _torchrun(tmp_path / "fsdp", *args, "parallel=fsdp")
    train(tmp_path / "one", *FSDP_ARGS, *args)
    got = {}
    for run_dir in ("fsdp", "one"):
        for ema in ([], ["--ema"]):
            out = tmp_path / f"{run_dir}{''.join(ema)}.pt"
            r = subprocess.run([sys.executable, str(ROOT / "scripts/export_weights.py"), str(tmp_path / run_dir),
                                str(out), *ema], capture_output=True, text=True, env=clean_env(PYTHONPATH=str(ROOT)))
            assert r.returncode == 0 and ", 8 sigmaReparam layer(s) folded" in r.stdout, r.stdout + r.stderr
            got[run_dir, bool(ema)] = torch.load(out, weights_only=True)
    for ema in (False, True):
        a, b = got["fsdp", ema], got["one", ema]
        assert sorted(a) == sorted(b) and "lm_head.weight" in a
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=FSDP_REL, atol=1e-6, msg=k)
    qkv = "blocks.0.attn.qkv.weight"  # the average is not the live weights
    assert not torch.allclose(got["fsdp", True][qkv], got["fsdp", False][qkv])


def test_fsdp_refusals_are_one_line():
    from stabletrain.build import check_parallel, validate
    from stabletrain.errors import ConfigError
    from tests.helpers import make_cfg

    with pytest.raises(ConfigError, match=r"^parallel=zero is not an option: use ddp or fsdp$"):
        validate(make_cfg("model=gpt_test", "parallel=zero"))
    with pytest.raises(ConfigError, match=r"^parallel=fsdp shards over the ranks of a distributed launch"):
        validate(make_cfg("model=gpt_test", "parallel=fsdp"))
    ok = ["model=gpt_test", "parallel=fsdp", "monitor=off"]
    check_parallel(make_cfg(*ok, *FIXES, "divergence.action=rollback"), world=2)
    for monitor in ("standard", "full"):
        check_parallel(make_cfg(*ok, f"monitor={monitor}"), world=2)


# --- the monitors under parallel=fsdp: every rank gathers and runs the probe, rank 0 logs ------------

MONITOR_GROUPS = ("sigma1/", "sec/", "qk_spectrum/", "norm/blocks", "entropy/", "token_sim/", "attn_logit_max/",
                  "logits/", "alert/")


def _monitor_records(run_dir) -> dict:
    from stabletrain.metrics import read_records

    return {(r["step"], k): v for r in read_records(run_dir / "metrics.jsonl") for k, v in r.items()
            if k.startswith(MONITOR_GROUPS)}


def test_fsdp_monitors_log_what_ddp_logs(tmp_path):
    """Weight passes at steps 0, 2, 4 (sigmaReparam's effective weights, gathered a chunk of blocks
    at a time), probes at 0, 3, 4 (forward and backward on both ranks), every head: the values of
    DDP's rank 0. Step 0 is bit for bit; later steps differ as the trained weights do (summation
    order of the reduce-scatter), observed < 1e-5 relative. The monitors change no loss."""
    args = ["steps=4", "reparam=sigma", "monitor=standard", "monitor.per_head=true", "monitor.weight_every=2",
            "monitor.probe_every=3"]
    for par in ("ddp", "fsdp"):
        _torchrun(tmp_path / par, *args, f"parallel={par}")
    a, b = _monitor_records(tmp_path / "fsdp"), _monitor_records(tmp_path / "ddp")
    assert sorted(a) == sorted(b) and len(b) > 200, (len(a), len(b), sorted(set(a) ^ set(b))[:10])
    assert {s for s, _ in b} == {0, 2, 3, 4}
    assert any(k.startswith("sigma1/blocks.1/wq_t_wk_head") for _, k in b) and ((3, "norm/blocks.0/grad_x") in b)
    for key, want in b.items():
        assert a[key] == (want if key[0] == 0 else pytest.approx(want, rel=FSDP_REL)), f"{key}: {a[key]} vs {want}"
    _assert_same_losses(tmp_path / "fsdp", tmp_path / "ddp", FSDP_REL, ("loss", "val/loss"))
    saved = torch.load(tmp_path / "fsdp" / "checkpoints" / "last.pt", weights_only=True)["monitor"]
    assert saved["warm"] and saved["history"][-1]["step"] == 4  # what a resumed run continues from


# every block's attention entropy (< log 32 nats) is under the floor, and 1-wide heads make SEC(1, 1) = 1:
# the alert fires once max sigma1(W_q^h^T W_k^h) is 15x its step-0 value, at step 3 (12x at step 2, 20x at 3)
ALERT = ["model.num_heads=32", "steps=6", "warmup=0", "optim=adamw", "optim.lr=0.05", "optim.weight_decay=0",
         "monitor=standard", "monitor.weight_every=1", "monitor.probe_every=1", "monitor.entropy_floor=100",
         "monitor.qk_growth=15", "monitor.stop_on_alert=true"]


def test_fsdp_alert_stops_both_ranks_at_the_same_step(tmp_path):
    """Rank 0's alert reaches rank 1 through the loop's all-reduced stop flag: both leave at step 3
    (a rank left behind would wait in its next forward's all-gather until the timeout), and the
    forensics forward runs on both ranks."""
    run(torchrun_cmd(2, *GPT, *ALERT, "parallel=fsdp", f"hydra.run.dir={tmp_path}"), cwd=tmp_path, timeout=120)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "diverged" and s["step"] == 3, (s["status"], s["step"], s["reason"])
    assert s["reason"].startswith("entropy collapse at blocks.") and s["alerts"][0]["step"] == 3
    assert s["forensics"]["last_finite_snapshot"]["step"] == 3 and "grew" in s["forensics"]["growth"]


def test_fsdp_forensics_take_their_last_weight_pass_on_both_ranks(tmp_path):
    """A run that diverges between weight passes (its NaN step skipped, its weights finite) takes
    one more pass at the step it stopped: a collective on sharded weights, which both ranks must
    decide alike, or one waits in the gather until the timeout."""
    run(torchrun_cmd(2, *GPT, "steps=6", "debug.nan_at_step=3", "divergence.max_skips=1", "monitor=standard",
                     "monitor.weight_every=100", "parallel=fsdp", f"hydra.run.dir={tmp_path}"), cwd=tmp_path,
        timeout=120)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "diverged" and s["step"] == 3, (s["status"], s["step"], s["reason"])
    assert s["forensics"]["last_finite_snapshot"]["step"] == 3
