"""Promises of the changes since 914049e that no test held (a mutation audit): each test here
fails on one deliberate bug in stabletrain/ that the rest of the suite let through."""

import json
import re
import shutil
import textwrap

import pytest
import torch

from stabletrain.errors import ConfigError
from tests.helpers import cli, forget_own_code, make_cfg, model_of, train

GPT = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1"]


@pytest.fixture
def own_code_is_forgotten(monkeypatch):
    """As in test_own_code.py, but not autouse here: the modules it drops would include
    matplotlib's, which the plot tests import."""
    yield from forget_own_code(monkeypatch)


def _module(tmp_path, name: str, body: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def _with_overrides(ck_path, overrides):
    """The checkpoint as a train.py run writes it: with its command line (an in-process run has none)."""
    state = torch.load(ck_path, weights_only=False)
    state["overrides"], state["launcher"] = list(overrides), None
    torch.save(state, ck_path)


# --- options of one's own: what they return ------------------------------------------------------

@pytest.mark.usefixtures("own_code_is_forgotten")
def test_an_init_of_ones_own_that_writes_in_place_and_returns_nothing_is_applied(tmp_path):
    """An init writes the weight it is given in place (INITS' documented form): one without a
    ``return`` is that form, not a wrong return, and its values are the model's."""
    path = _module(tmp_path, "inplace_init", """
        from stabletrain.layers.init import INITS

        @INITS.register("inplace_own")
        def inplace_own(w, gain=1.0):
            w.fill_(0.25)
    """)
    from stabletrain.build import validate

    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "init.name=inplace_own")
    validate(cfg)
    net = model_of(cfg)
    assert torch.all(net.blocks[0].attn.qkv.weight == 0.25) and torch.all(net.blocks[0].mlp.fc2.weight == 0.25)


CLASS_DATA = """
    from stabletrain.data import DATASETS, Data

    @DATASETS.register("class_data_own", kind="text")
    def class_data_own(d, m, seed):
        return Data
"""
CLASS_DATA_LINE = (r"^data=class_data_own: [\w.]+\.class_data_own returned the class Data, not an instance of it; "
                   r"a data option returns a stabletrain.data.Data$")


@pytest.mark.usefixtures("own_code_is_forgotten")
def test_a_training_run_with_a_data_set_that_returns_the_class_is_one_line(tmp_path):
    """The same data set in a run: the trainer builds its data with data_from_config, which met
    "type object 'Data' has no attribute 'extra'" instead of the one line."""
    from stabletrain.build import build_trainer, validate

    path = _module(tmp_path, "class_data_run", CLASS_DATA)
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "data.name=class_data_own", "steps=1")
    validate(cfg)
    with pytest.raises(ConfigError, match=CLASS_DATA_LINE):
        build_trainer(cfg, tmp_path / "run")


@pytest.mark.usefixtures("own_code_is_forgotten")
def test_a_reparam_of_ones_own_that_returns_no_hook_is_one_line(tmp_path):
    """reparam= is checked too: a reparametrisation returning a dict, not its step hook or None,
    was met only after the first optimizer step."""
    path = _module(tmp_path, "dict_reparam", """
        from stabletrain.layers.reparam import REPARAMS

        @REPARAMS.register("dict_own")
        def dict_own(model, cfg):
            return {"hook": None}

        @REPARAMS.register("model_own")
        def model_own(model, cfg):  # callable, but the first step would call the model with no input
            return model
    """)
    from stabletrain.build import validate

    for name, got in (("dict_own", "a dict"), ("model_own", "a GPT")):
        cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", f"reparam.name={name}")
        validate(cfg)
        with pytest.raises(ConfigError, match=rf"^reparam={name}: [\w.]+\.{name} returned {got}; a reparam option "
                                              r"returns the hook to run after each optimizer step \(a function, "
                                              r"not the model or a class\), or None$"):
            model_of(cfg)


@pytest.mark.usefixtures("own_code_is_forgotten")
def test_an_own_options_kwargs_are_no_unread_key_when_it_declares_its_keys(tmp_path):
    """register(keys=...) names the keys of the group the option reads besides its own arguments:
    its kwargs (declared with kwargs=) are read, and not noted as changing nothing."""
    from stabletrain.build import own_groups, validate
    from stabletrain.config import unread_keys

    from tests.test_own_code import GAIN_NORM

    path = _module(tmp_path, "gain_keys_norm", GAIN_NORM.replace(
        '@NORMS.register("gain_own", layer=GainNorm, kwargs=("g0",))',
        '@NORMS.register("gain_keys_own", layer=GainNorm, kwargs=("g0",), keys=("eps",))').replace(
        "def gain_own(", "def gain_keys_own("))
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "norm.name=gain_keys_own", "+norm.kwargs.g0=2")
    validate(cfg)
    assert own_groups(cfg) == {"norm": ("eps",)}
    assert unread_keys(cfg, own_groups(cfg)) == []


# --- resuming another run's checkpoint: the commands offered go where it lies ---------------------

def test_a_checkpoint_past_this_runs_steps_is_continued_in_its_own_run_dir(tmp_path):
    """resume=PATH of another run's checkpoint at step 4 into a 2-step run: 'continue it with its
    own command' named this directory with resume=auto, which finds nothing and trains from 0."""
    train(tmp_path / "old", *GPT, "steps=4")
    ck = tmp_path / "old" / "checkpoints" / "last.pt"
    _with_overrides(ck, ["model=gpt_test", "steps=4"])
    old = re.escape(str(tmp_path / "old"))
    with pytest.raises(ConfigError, match=rf"past this run's 2 steps: continue it with its own command, \S+ "
                                          rf"\S*train.py model=gpt_test steps=4 resume=auto hydra.run.dir={old}; or "
                                          rf"pass steps=4"):
        train(tmp_path / "new", *GPT, "steps=2", f"resume={ck}")


def test_another_optimizers_checkpoint_names_its_own_command(tmp_path):
    """resume=PATH of a checkpoint written with another optim=: the refusal names the command it
    was written with, in its own run directory."""
    train(tmp_path / "old", *GPT, "steps=2", "optim=adamw")
    ck = tmp_path / "old" / "checkpoints" / "last.pt"
    _with_overrides(ck, ["model=gpt_test", "optim=adamw"])
    old = re.escape(str(tmp_path / "old"))
    with pytest.raises(ConfigError, match=rf"; resume with optim=adamw \(its own command: \S+ \S*train.py "
                                          rf"model=gpt_test optim=adamw resume=auto hydra.run.dir={old}\), "
                                          rf"or start a new run$"):
        train(tmp_path / "new", *GPT, "steps=4", "optim=adamw2", f"resume={ck}")


def test_a_checkpoint_of_another_model_names_the_command_in_its_own_run_dir(tmp_path):
    """resume=PATH of a checkpoint whose weights do not fit: 'resume it with the command it was
    written with' names its run's directory, not this one."""
    train(tmp_path / "old", *GPT, "steps=2")
    ck = tmp_path / "old" / "checkpoints" / "last.pt"
    _with_overrides(ck, ["model=gpt_test"])
    with pytest.raises(ConfigError, match=rf"does not fit this run's model or optimizer \(.*\); resume it with the "
                                          rf"command it was written with, \S+ \S*train.py model=gpt_test resume=auto "
                                          rf"hydra.run.dir={re.escape(str(tmp_path / 'old'))}$"):
        train(tmp_path / "new", *GPT, "steps=4", "model.embed_dim=64", f"resume={ck}")


def test_a_checkpoint_without_its_world_size_is_no_world_note(tmp_path, capsys):
    """Checkpoints written before the world size was saved: nothing is known of their process
    count, and the start lines say nothing of it ('written on None')."""
    train(tmp_path, *GPT, "steps=2")
    ck = tmp_path / "checkpoints" / "last.pt"
    state = torch.load(ck, weights_only=False)
    del state["world"]
    torch.save(state, ck)
    capsys.readouterr()
    assert train(tmp_path, *GPT, "steps=3", "resume=auto", quiet=False)["step"] == 3
    assert "written on" not in capsys.readouterr().err


# --- a sweep run again into its directory ----------------------------------------------------------

def test_a_sweep_run_again_where_one_point_refuses_keeps_the_others_as_the_new_command(tmp_path):
    """Run again with optim.lr changed: point 0 (completed) refuses, point 1 (never trained) takes
    the new command. The refusal must not stick to the next point (its .hydra/ put back, the tally
    '2 refused this time'), and a .hydra.kept left by a killed sweep is replaced, not a crash."""
    base = ["-m", "model=gpt_test", "steps=2", "batch_size=8", "logger=none", "monitor=off", "optim.tau=0.01,0.02",
            f"hydra.sweep.dir={tmp_path}"]
    assert cli(*base).returncode == 0
    for p in (tmp_path / "1").iterdir():  # point 1 as a sweep killed before it trained leaves it
        if p.name != ".hydra":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    stale = tmp_path / "0" / ".hydra.kept"  # what a killed sweep left
    stale.mkdir()
    (stale / "overrides.yaml").write_text("- stale\n")
    record = (tmp_path / "0" / ".hydra" / "overrides.yaml").read_text()
    r = cli(*base, "optim.lr=0.003", "resume=auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"sweep {tmp_path}: 2 points, 1 refused this time, 1 completed; 0/ refused this time (its run is as it " \
           f"was): resume=auto would change the resumed run's optim.lr (0.001 there, 0.003 here)" in r.stderr
    assert (tmp_path / "0" / ".hydra" / "overrides.yaml").read_text() == record
    assert "optim.lr=0.003" in (tmp_path / "1" / ".hydra" / "overrides.yaml").read_text()
    assert not [p.name for p in tmp_path.rglob("*") if p.name.endswith((".kept", ".kept.yaml", "refused_now"))]


def test_the_continue_command_of_a_sweep_run_again_is_this_one(tmp_path, monkeypatch):
    """While a sweep runs again, the earlier multirun.yaml is kept beside the new one: a point that
    refuses is told the earlier command, but one that stops (Ctrl-C, a rollback limit) is told to
    run again the command it is running."""
    import yaml

    from stabletrain.engine import rundir

    def multirun(path, task):
        path.write_text(yaml.safe_dump({"hydra": {"overrides": {"hydra": ["hydra.mode=MULTIRUN"], "task": task}}}))

    multirun(tmp_path / "multirun.yaml", ["model=gpt_test", "steps=4", "optim.tau=0.01,0.02"])
    multirun(tmp_path / rundir.KEPT_MULTIRUN, ["model=gpt_test", "steps=2", "optim.tau=0.01,0.02"])
    monkeypatch.setattr(rundir, "sweep_dir", lambda: tmp_path)
    now, earlier = rundir.continue_with(tmp_path / "0"), rundir.continue_with(tmp_path / "0", earlier=True)
    assert now.endswith(f"train.py -m model=gpt_test steps=4 optim.tau=0.01,0.02 resume=auto "
                        f"hydra.sweep.dir={tmp_path}"), now
    assert earlier.endswith(f"train.py -m model=gpt_test steps=2 optim.tau=0.01,0.02 resume=auto "
                            f"hydra.sweep.dir={tmp_path}"), earlier


# --- the command line -------------------------------------------------------------------------------

def test_an_unknown_prefixed_key_that_is_no_key_either_gets_no_guess():
    """'did you mean imports?' for train.imports holds only where the key without its prefix is
    one: xyz.notakey is not in the schema, and no 'did you mean notakey?' is made up."""
    from stabletrain.cli import compose_config, explain

    ovs = ["model=gpt_test", "xyz.notakey=1"]
    with pytest.raises(Exception) as e:
        compose_config(ovs)
    said = explain(e.value, ovs)
    assert said.startswith("unknown key 'xyz.notakey': not in the config schema"), said
    assert "did you mean" not in said


# --- compare_runs ------------------------------------------------------------------------------------

def _run(path, lr, frac=None, steps=50):
    path.mkdir()
    extra = {} if frac is None else {"adamw2/frac_bounded": frac}
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "lr": lr, **extra}) + "\n"
                                                      for s in range(0, steps, 10)))
    path.joinpath("summary.json").write_text(json.dumps({"status": "completed", "step": steps - 10}))
    return path


@pytest.fixture
def figures(monkeypatch):
    from stabletrain.analysis import plots as P

    out = []
    monkeypatch.setattr(P, "_save", lambda fig, where, name: out.append(fig))
    return out


def test_a_label_breaks_after_the_commas_of_a_sweeps_settings():
    """A sweep point's label 'a=1,b=2' wraps after its commas (and at spaces), never inside a setting."""
    from stabletrain.analysis.plots import _wrapped

    assert _wrapped("optim.tau=0.001,deescalate.alpha=0.05 seed=1", 20) == \
        "optim.tau=0.001,\ndeescalate.alpha=0.05\nseed=1"
    assert _wrapped("a=1,b=2 c=3", 20) == "a=1,b=2 c=3"


def test_one_run_keeps_its_lr_panel(tmp_path, figures):
    """The bound's share replaces the lr panel only where several runs share one schedule: a run
    alone with AdamW²'s telemetry still draws its scheduled lr."""
    from stabletrain.analysis import plots as P

    P.compare_runs([_run(tmp_path / "a", 1e-3, 0.5)], tmp_path / "cmp", labels=["a"])
    assert figures[-1].axes[2].get_title() == "scheduled lr"


def test_runs_without_adamw2s_telemetry_keep_the_lr_panel(tmp_path, figures):
    """Two AdamW runs with one schedule log no bound: the panel stays the scheduled lr, not an
    empty 'fraction of tensors at the bound'."""
    from stabletrain.analysis import plots as P

    P.compare_runs([_run(tmp_path / "a", 1e-3), _run(tmp_path / "b", 1e-3)], tmp_path / "cmp", labels=["a", "b"])
    assert figures[-1].axes[2].get_title() == "scheduled lr"


def test_a_run_lacking_the_bound_is_said_to_lack_the_bound(tmp_path, figures):
    """Where the bound's panel replaced the lr's, a run without AdamW²'s telemetry is said not to
    log 'bound' (it logged its lr, which the figure does not draw)."""
    from stabletrain.analysis import plots as P

    P.compare_runs([_run(tmp_path / "a", 1e-3, 0.5), _run(tmp_path / "b", 1e-3)], tmp_path / "cmp",
                   labels=["with", "without"])
    assert figures[-1].axes[2].get_title().startswith("AdamW²: fraction of tensors at the bound")
    slot = next(ax for ax in figures[-1].axes if ax.get_legend() is not None)
    texts = [" ".join(t.get_text().split()) for t in slot.get_legend().get_texts()]
    assert texts[0].startswith("with") and "not logged" in texts[1], texts
    logged = texts[1].split("not logged: ")[1]
    assert "bound" in logged and "lr" not in logged.replace("validation", ""), texts


# --- a rank that went away -----------------------------------------------------------------------

def test_a_peer_gone_is_gloos_and_ncclss_wording_of_a_collective_only():
    """is_peer_gone reads gloo's 'Connection closed by peer' (what a SIGKILLed rank leaves its
    peers) and NCCL's remote error, of a collective's error only: a broken pipe of this process's
    own stdout is no other rank's death."""
    from stabletrain.engine.distributed import is_peer_gone

    assert is_peer_gone(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                     "[127.0.0.1]:60412"))
    assert is_peer_gone(RuntimeError("NCCL error: remote process exited or there was a network error, "
                                     "NCCL version 2.21.5 ncclRemoteError"))
    assert not is_peer_gone(BrokenPipeError(32, "Broken pipe"))
    assert not is_peer_gone(RuntimeError("CUDA out of memory"))


# --- found by the audit: declared keys that another reader reads ---------------------------------

@pytest.mark.usefixtures("own_code_is_forgotten")
@pytest.mark.parametrize("swept", [["norm.placement=pre,post"], ["attention=stable", "norm.alpha=0.1,0.4"]])
def test_a_key_of_a_declared_group_read_elsewhere_may_be_swept(tmp_path, swept):
    """A norm of one's own that declares keys=("eps",): norm.placement is still read by the model
    (pre/post), norm.alpha by attention=stable; a sweep over either launches different runs."""
    from stabletrain.cli import check_overrides

    path = _module(tmp_path, "eps_norm", """
        import torch
        from stabletrain.layers.norm import NORMS

        @NORMS.register("eps_own", layer=torch.nn.LayerNorm, keys=("eps",))
        def eps_own(cfg, dim, **kw):
            return torch.nn.LayerNorm(dim, eps=cfg.eps or 1e-5)
    """)
    check_overrides(["-m", f"imports=[{path}]", "model=gpt_test", "norm.name=eps_own", *swept])
