"""init_weights=PATH: another run's weights start this one, and the model computes the source's
function at step 0 across any change of sigmaReparam."""

from pathlib import Path

import pytest
import torch
from torch import nn

from stabletrain.config import Components
from stabletrain.errors import ConfigError
from stabletrain.models.registry import build_model
from stabletrain.models.weights import load_weights
from tests.helpers import make_cfg

SIGMA = ["reparam=sigma"]
SIGMA_QKV = ["reparam=sigma", "reparam.qkv_split=q_k_v"]
SIGMA_QK = ["reparam=sigma_qk", "reparam.qkv_split=q_k_v"]


def _model(family: str, *over: str, seed: int = 0):
    cfg = make_cfg(f"model={family}", "model.drop_path=0.0", *over)
    torch.manual_seed(seed)
    model = build_model(cfg.model, Components.of(cfg)).eval()
    with torch.no_grad():  # gains away from 1, so that a mapping that dropped them would show
        for name, p in model.named_parameters():
            if name.endswith(".gamma"):
                p.uniform_(0.5, 2.0)
    return model


def _input(family: str):
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, 16)) if family.startswith("gpt") else torch.randn(2, 3, 16, 16)


@pytest.mark.parametrize("family", ["gpt_test", "vit_test"])
@pytest.mark.parametrize("there,here", [([], SIGMA), ([], SIGMA_QK), (SIGMA, []), (SIGMA_QKV, SIGMA_QK),
                                        (SIGMA_QK, SIGMA), ([], [])])
def test_the_loaded_model_computes_the_sources_function(tmp_path, family, there, here):
    """W_hat = gamma W / sigma on either side: into sigmaReparam, original = W and gamma = sigma1
    by an exact SVD; out of it, the weight its forward applied with its own u, v."""
    src = _model(family, *there)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    dst = _model(family, *here, seed=7)
    x = _input(family)
    with torch.no_grad():
        assert not torch.allclose(dst(x), src(x), atol=1e-3)
        note = load_weights(dst, tmp_path / "w.pt")
        torch.testing.assert_close(dst(x), src(x), rtol=1e-4, atol=1e-5)
    n = len(dst.state_dict())
    assert note.startswith(f"init_weights: {n} of the model's {n} " \
        f"tensors from {tmp_path / 'w.pt'}") and "kept" not in note


def test_the_same_sigma_reparam_loads_as_it_is(tmp_path):
    src = _model("gpt_test", *SIGMA_QKV)
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in src.state_dict().items()}}, tmp_path / "ckpt.pt")
    dst = _model("gpt_test", *SIGMA_QKV, seed=3)
    note = load_weights(dst, tmp_path / "ckpt.pt")
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert "through the weight applied" not in note and "unused" not in note


def test_a_head_of_another_shape_keeps_its_initialisation_and_is_named(tmp_path):
    src = _model("vit_test", "model.num_classes=10")
    torch.save({"state_dict": src.state_dict()}, tmp_path / "timm.pth")
    dst = _model("vit_test", "model.num_classes=5", seed=4)
    head = dst.head.weight.clone()
    note = load_weights(dst, tmp_path / "timm.pth")
    assert torch.equal(dst.head.weight, head) and torch.equal(dst.blocks[0].attn.qkv.weight,
                                                              src.blocks[0].attn.qkv.weight)
    assert "2 kept their initialisation: head.weight ((5, 32) here, (10, 32) there), head.bias ((5,) here, " \
           "(10,) there)" in note, note
    assert "2 of the source's unused: head.weight, head.bias" in note


def _shards(folder: Path, model: nn.Module, step: int) -> None:
    """``model``'s tensors saved at ``step`` in ``folder`` as a sharded run's save writes them."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "step": torch.tensor(step)}, checkpoint_id=str(folder), no_dist=True)


def _loaded_into_a_fresh_model(pt: Path, src: nn.Module) -> None:
    dst = _model("gpt_test", seed=5)
    load_weights(dst, pt)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_runs_checkpoint_reads_its_model_shards(tmp_path):
    """A parallel=fsdp run's last.pt is marked "dcp" (an earlier version's named "last_dcp"): its
    last_dcp/ holds the model (and optimizer)."""
    src = _model("gpt_test")
    _shards(tmp_path / "last_dcp", src, 3)
    torch.save({"step": 3, "dcp": "last_dcp"}, tmp_path / "last.pt")
    _loaded_into_a_fresh_model(tmp_path / "last.pt", src)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_reads_the_shards_of_its_own_step(tmp_path):
    """A save cut off between its shards and last.pt leaves last.pt beside the next step's shards,
    its own moved to .last_dcp.old (engine.sharding.save_dcp): the weights of another step were read."""
    from stabletrain.engine.checkpoint import dcp_dir
    from stabletrain.engine.sharding import previous_dcp

    own, newer = _model("gpt_test"), _model("gpt_test", seed=3)
    assert dcp_dir(tmp_path / "last.pt").name == "last_dcp" and previous_dcp(tmp_path).name == ".last_dcp.old"
    _shards(tmp_path / "last_dcp", newer, 4)
    _shards(tmp_path / ".last_dcp.old", own, 3)
    torch.save({"step": 3, "dcp": True}, tmp_path / "last.pt")
    _loaded_into_a_fresh_model(tmp_path / "last.pt", own)
    dst = _model("gpt_test", seed=5)
    torch.save({"step": 2, "dcp": True}, tmp_path / "last.pt")  # neither holds its step
    with pytest.raises(ConfigError, match=r"sharded weights \(step 2\) are not beside it \(last_dcp/ holds step 4; "
                                          r"\.last_dcp\.old/ holds step 3\).*ring checkpoints"):
        load_weights(dst, tmp_path / "last.pt")
    torch.save({"step": 2, "dcp": "step_000002_dcp"}, tmp_path / "step_000002.pt")
    with pytest.raises(ConfigError, match=r"are not beside it \(no step_000002_dcp/\)"):
        load_weights(dst, tmp_path / "step_000002.pt")


def test_what_cannot_start_a_run_is_one_line(tmp_path):
    dst = _model("gpt_test")
    with pytest.raises(ConfigError, match=r"init_weights=.*nowhere.pt: no such file; pass a run's directory"):
        load_weights(dst, tmp_path / "nowhere.pt")
    with pytest.raises(ConfigError, match="a directory without checkpoints/last.pt"):
        load_weights(dst, tmp_path)
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint or state dict"):
        load_weights(dst, tmp_path / "junk.pt")
    torch.save(_model("vit_test").state_dict(), tmp_path / "vit.pt")  # its blocks fit, its embeddings do not
    with pytest.raises(ConfigError, match=r"13 of its 32 tensors fit this model's 16 \(names or shapes differ: "
                                          r"wte.weight \(not there\)\); start from a run of the same model"):
        load_weights(dst, tmp_path / "vit.pt")
    torch.save({"model": _model("vit_test").state_dict(), "config": "model:\n  family: vit\n"}, tmp_path / "run.pt")
    with pytest.raises(ConfigError, match="a vit run's weights, this run's model is a gpt; start from a gpt run"):
        load_weights(dst, tmp_path / "run.pt", make_cfg("model=gpt_test").model)


def test_a_run_starts_from_another_runs_weights(tmp_path, capsys):
    """init_weights=<run dir>: the built trainer's model and weight average hold that run's last
    weights, under another optimizer and sigmaReparam; resume=PATH loads its checkpoint instead."""
    from stabletrain.build import build_trainer
    from tests.helpers import train

    base = ["model=gpt_test", "batch_size=8", "logger.wandb=disabled", "monitor=off"]
    train(tmp_path / "a", *base, "steps=3")
    ck = torch.load(tmp_path / "a/checkpoints/last.pt", weights_only=True)
    src = _model("gpt_test")
    src.load_state_dict(ck["model"])
    cfg = make_cfg(*base, "steps=2", "optim=adamw2", *SIGMA, "ema.decay=0.9", f"init_weights={tmp_path / 'a'}")
    trainer = build_trainer(cfg, tmp_path / "b")
    x = _input("gpt_test")
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(x), src(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(trainer.ema.module.eval()(x), src(x), rtol=1e-4, atol=1e-5)
    assert any(n.startswith(f"init_weights: 40 of the model's 40 tensors from {tmp_path / 'a/checkpoints/last.pt'}")
               for n in trainer.notes), trainer.notes
    cfg = make_cfg(*base, "steps=4", f"init_weights={tmp_path / 'a'}", f"resume={tmp_path / 'a/checkpoints/last.pt'}")
    notes = build_trainer(cfg, tmp_path / "c").notes
    assert f"init_weights={tmp_path / 'a'} is not loaded: resume={tmp_path / 'a/checkpoints/last.pt'} continues " \
           "that checkpoint's weights" in notes


def test_timms_own_vit_starts_a_sigma_reparam_run_with_its_function(tmp_path):
    """A timm checkpoint of the same ViT (timm's tensor names) into reparam=sigma."""
    import timm

    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=16, patch_size=4,
                            embed_dim=32, depth=2, num_heads=2).eval()
    torch.save({"state_dict": ref.state_dict()}, tmp_path / "model_best.pth.tar")
    dst = _model("vit_test", "model.num_classes=10", *SIGMA)
    load_weights(dst, tmp_path / "model_best.pth.tar")
    x = _input("vit_test")
    with torch.no_grad():
        torch.testing.assert_close(dst(x), ref(x), rtol=1e-4, atol=1e-5)


def test_the_note_counts_the_layers_mapped_across_sigma_reparam(tmp_path):
    torch.save(_model("gpt_test").state_dict(), tmp_path / "w.pt")
    note = load_weights(_model("gpt_test", *SIGMA_QK), tmp_path / "w.pt")
    assert "(2 layer(s) through the weight applied, across sigmaReparam)" in note, note  # the two qkv


@pytest.mark.parametrize("prefix", ["module.", "module._orig_mod.", "_orig_mod.module."])
def test_the_prefixes_of_ddp_and_compile_are_dropped_in_either_order(tmp_path, prefix):
    """DDP of a compiled model writes module._orig_mod.; a compiled DDP model _orig_mod.module."""
    src = _model("gpt_test")
    torch.save({prefix + k: v for k, v in src.state_dict().items()}, tmp_path / "w.pt")
    dst = _model("gpt_test", seed=2)
    load_weights(dst, tmp_path / "w.pt")
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_a_sigma_reparam_head_of_another_shape_keeps_all_its_tensors(tmp_path):
    """Its gamma and v have the same shapes there: taken alone they would scale this model's raw head."""
    src = _model("vit_test", "model.num_classes=10", *SIGMA)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    dst = _model("vit_test", "model.num_classes=5", *SIGMA, seed=4)
    head = {k: v.clone() for k, v in dst.state_dict().items() if k.startswith("head.")}
    note = load_weights(dst, tmp_path / "w.pt")
    for k, v in head.items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert f"{len(head)} kept their initialisation" in note, note


def test_a_source_that_fits_under_half_of_this_model_is_refused(tmp_path):
    """All of its tensors fit, but most of this model's would keep their initialisation."""
    torch.save(_model("gpt_test", "model.depth=1").state_dict(), tmp_path / "w.pt")
    with pytest.raises(ConfigError, match=r"init_weights=.*: 10 of its 10 tensors fit this model's 28 \(names or "
                                          r"shapes differ: blocks.1.norm1.weight \(not there\)\)"):
        load_weights(_model("gpt_test", "model.depth=4"), tmp_path / "w.pt")


@pytest.mark.parametrize("here", [[], SIGMA])
def test_non_finite_weights_are_refused_in_one_line(tmp_path, here):
    """A diverged run's weights: the run would only skip non-finite steps (and the SVD into sigmaReparam fails)."""
    sd = _model("gpt_test").state_dict()
    sd["blocks.0.mlp.fc1.weight"][0, 0] = float("nan")
    torch.save(sd, tmp_path / "w.pt")
    with pytest.raises(ConfigError, match=r"init_weights=.*w.pt: 1 of its 16 tensors hold non-finite values "
                                          r"\(blocks.0.mlp.fc1.weight\); start from weights before the run diverged"):
        load_weights(_model("gpt_test", *here), tmp_path / "w.pt")


def test_an_all_zero_weight_into_sigma_reparam_is_refused(tmp_path):
    """gamma / sigma would be 0 / 0: a forward of NaN, as apply_reparam refuses an all-zero weight."""
    src = _model("vit_test", "model.num_classes=10")
    with torch.no_grad():
        src.head.weight.zero_()
    torch.save(src.state_dict(), tmp_path / "w.pt")
    with pytest.raises(ConfigError, match=r"rows 0:10 of the loaded head.weight are all zero, which sigmaReparam "
                                          r"cannot scale"):
        load_weights(_model("vit_test", "model.num_classes=10", *SIGMA), tmp_path / "w.pt")


def test_the_built_run_checks_the_sources_model_family(tmp_path):
    from stabletrain.build import build_trainer

    torch.save({"model": _model("vit_test").state_dict(), "config": "model:\n  family: vit\n"}, tmp_path / "run.pt")
    cfg = make_cfg("model=gpt_test", "logger=none", "monitor=off", f"init_weights={tmp_path / 'run.pt'}")
    with pytest.raises(ConfigError, match="a vit run's weights, this run's model is a gpt; start from a gpt run"):
        build_trainer(cfg, tmp_path / "b")


def test_a_resumed_run_continues_its_own_checkpoint_without_reading_the_source(tmp_path):
    """resume=auto (a requeued job) finds the run's last.pt: the source, moved away since, is not read,
    and no note says the step count starts afresh; with no checkpoint there, the source is loaded."""
    from stabletrain.build import build_trainer
    from tests.helpers import losses, train

    base = ["model=gpt_test", "batch_size=8", "logger.wandb=disabled", "logger.log_every=1", "monitor=off",
            "ckpt_every=2"]
    train(tmp_path / "a", *base, "steps=2")
    cfg = make_cfg(*base, "steps=4", "resume=auto", f"init_weights={tmp_path / 'a'}")
    notes = build_trainer(cfg, tmp_path / "b").notes
    assert any(str(n).startswith("init_weights: 16 of the model's 16") for n in notes)
    train(tmp_path / "b", *base, "steps=2", f"init_weights={tmp_path / 'a'}")
    (tmp_path / "a").rename(tmp_path / "gone")
    notes = build_trainer(cfg, tmp_path / "b").notes
    assert f"init_weights={tmp_path / 'a'} is not loaded: this run continues its own checkpoint, " \
           f"{tmp_path / 'b/checkpoints/last.pt'}" in notes, notes
    assert not any(str(n).startswith("init_weights:") for n in notes)
    train(tmp_path / "b", *base, "steps=4", "resume=auto", f"init_weights={tmp_path / 'a'}")
    assert sorted(losses(tmp_path / "b")) == [1, 2, 3, 4]


def test_the_note_says_a_sources_weight_average_is_not_what_is_loaded(tmp_path):
    """A run with ema.decay reports val_ema/* of its average; the live weights are what come over."""
    src = _model("gpt_test")
    torch.save({"model": src.state_dict(), "ema": {"module": src.state_dict(), "updates": 3}}, tmp_path / "a.pt")
    note = load_weights(_model("gpt_test"), tmp_path / "a.pt")
    assert "; its weight average (ema) is not loaded, its live weights are (scripts/export_weights.py --ema writes " \
           "the average as a file to start from);" in note, note
    torch.save({"model": src.state_dict(), "ema": None}, tmp_path / "b.pt")
    assert "weight average" not in load_weights(_model("gpt_test"), tmp_path / "b.pt")


def _export(*args: str):
    import subprocess
    import sys

    from tests.helpers import ROOT

    return subprocess.run([sys.executable, str(ROOT / "scripts" / "export_weights.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("average", [False, True])
def test_an_exported_sigma_reparam_vit_loads_into_timms_own_model_with_its_function(tmp_path, average):
    """sigmaReparam folded into the weights its forward applies: timm's ViT of the same shape
    computes what the run's model (or its weight average) computes."""
    import timm

    live, avg = _model("vit_test", "model.num_classes=10", *SIGMA), _model("vit_test", "model.num_classes=10", *SIGMA,
                                                                            seed=1)
    torch.save({"step": 5, "model": live.state_dict(), "ema": {"module": avg.state_dict(), "updates": 5},
                "config": "model:\n  family: vit\n"}, tmp_path / "last.pt")
    r = _export(str(tmp_path / "last.pt"), str(tmp_path / "out.pt"), *(["--ema"] if average else []))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"wrote {tmp_path / 'out.pt'}: the {'weight average' if average else 'weights'} of "
                                f"{tmp_path / 'last.pt'} (a vit run at step 5), 32 tensors, 10 sigmaReparam layer(s) "
                                "folded into the weights they apply")
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=16, patch_size=4,
                            embed_dim=32, depth=2, num_heads=2).eval()
    ref.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    x = _input("vit_test")
    with torch.no_grad():
        torch.testing.assert_close(ref(x), (avg if average else live)(x), rtol=1e-4, atol=1e-5)


def test_export_says_in_one_line_what_it_cannot_export(tmp_path):
    sd = _model("gpt_test").state_dict()
    torch.save({"model": sd, "ema": None}, tmp_path / "a.pt")
    r = _export(str(tmp_path / "a.pt"), str(tmp_path / "out.pt"), "--ema")
    assert r.returncode == 1 and r.stderr.strip() == f"error: {tmp_path / 'a.pt'}: holds no weight average (its run " \
        "had ema.decay null); leave the average out"
    r = _export(str(tmp_path / "none.pt"), str(tmp_path / "out.pt"))
    assert r.returncode == 1 and r.stderr.startswith(f"error: {tmp_path / 'none.pt'}: no such file")
    sd["blocks.0.mlp.fc1.weight"][0, 0] = float("inf")
    torch.save(sd, tmp_path / "b.pt")
    r = _export(str(tmp_path / "b.pt"), str(tmp_path / "out.pt"))
    assert r.returncode == 1 and "1 tensor(s) hold non-finite values (blocks.0.mlp.fc1.weight)" in r.stderr
    r = _export(str(tmp_path / "a.pt"), str(tmp_path / "no/out.pt"))
    assert r.returncode == 1 and "is not a directory" in r.stderr and not (tmp_path / "out.pt").exists()


def test_a_run_starts_from_an_exported_weight_average(tmp_path):
    """export --ema, then init_weights=OUT: the weight average starts a run (into sigmaReparam here)."""
    from tests.helpers import train

    base = ["model=gpt_test", "batch_size=8", "logger.wandb=disabled", "monitor=off"]
    train(tmp_path / "a", *base, "steps=3", "ema.decay=0.5")
    assert _export(str(tmp_path / "a"), str(tmp_path / "avg.pt"), "--ema").returncode == 0
    ck = torch.load(tmp_path / "a/checkpoints/last.pt", weights_only=True)
    src = _model("gpt_test")
    src.load_state_dict(ck["ema"]["module"])
    dst = _model("gpt_test", *SIGMA, seed=3)
    load_weights(dst, tmp_path / "avg.pt")
    x = _input("gpt_test")
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=1e-4, atol=1e-5)


def _fake_run(run: Path, model: dict, ema: dict | None, sharded: bool = False) -> Path:
    """A run's checkpoints/last.pt (and ring) as the trainer writes them; sharded: the tensors in last_dcp/."""
    import torch.distributed.checkpoint as dcp

    (run / "checkpoints").mkdir(parents=True)
    ck = {"step": 2, "config": "model:\n  family: gpt\n", "ema": None if ema is None else {"updates": 2}}
    if sharded:
        dcp.save({"model": model, "step": torch.tensor(2), **({"ema": ema} if ema is not None else {})},
                 checkpoint_id=str(run / "checkpoints" / "last_dcp"), no_dist=True)
        ck["dcp"] = True  # as the trainer writes it (earlier versions wrote the folder's name)
    else:
        ck |= {"model": model, "ema": None if ema is None else {"module": ema, "updates": 2}}
    torch.save(ck, run / "checkpoints" / "last.pt")
    torch.save(ck, run / "checkpoints" / "step_000002.pt")
    return run / "checkpoints" / "last.pt"


def test_export_writes_over_no_checkpoint_of_its_run_nor_onto_a_folder(tmp_path):
    """OUT = the source (or another checkpoint of its run) would leave a plain state dict where
    resume needs the optimizer; OUT = a folder was a traceback and left a .tmp file beside it."""
    last = _fake_run(tmp_path / "run", _model("gpt_test").state_dict(), None)
    ring = last.with_name("step_000002.pt")
    before = last.read_bytes(), ring.read_bytes()
    r = _export(str(tmp_path / "run"), str(last))
    assert r.returncode == 1 and r.stderr.strip() == f"error: {last}: it would replace the file being read " \
        f"({last}); write elsewhere", r.stderr
    r = _export(str(tmp_path / "run"), str(ring))
    assert r.returncode == 1 and r.stderr.strip() == f"error: {ring} is in {last.parent}, the run's own " \
        "checkpoints; write elsewhere", r.stderr
    assert (last.read_bytes(), ring.read_bytes()) == before
    for out in (tmp_path / "run", f"{tmp_path}/"):
        r = _export(str(tmp_path / "run"), str(out))
        assert r.returncode == 1 and r.stderr.strip() == f"error: {Path(out)} is a directory; name the file to " \
            "write", r.stderr
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.endswith(".tmp")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    torch.save(_model("gpt_test").state_dict(), tmp_path / "own.pt")  # a state dict beside another: fine
    assert _export(str(tmp_path / "own.pt"), str(tmp_path / "other.pt")).returncode == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_runs_weight_average_is_read_from_its_shards(tmp_path):
    """--ema of a parallel=fsdp run: the ema.* tensors of last_dcp/, not model.*; a run without
    ema.decay says so as an unsharded one does; GPT's tied lm_head comes back as its wte."""
    from stabletrain.models.weights import read_weights

    live, avg = _model("gpt_test").state_dict(), _model("gpt_test", seed=1).state_dict()
    pt = _fake_run(tmp_path / "a", live, avg, sharded=True)
    for average, want in ((False, live), (True, avg)):
        got, where, family, has_avg, _, _ = read_weights(tmp_path / "a", average=average)
        assert (where, family, has_avg) == (pt, "gpt", True) and sorted(got) == sorted(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        assert got["lm_head.weight"] is got["wte.weight"]
    _fake_run(tmp_path / "b", live, None, sharded=True)
    with pytest.raises(ConfigError) as e:
        read_weights(tmp_path / "b", average=True, key="")
    assert str(e.value) == f"{tmp_path / 'b/checkpoints/last.pt'}: holds no weight average (its run had ema.decay " \
        "null); leave the average out"
    r = _export(str(tmp_path / "b"), str(tmp_path / "out.pt"))
    assert r.returncode == 0, r.stderr
    out = torch.load(tmp_path / "out.pt", weights_only=True)  # one tensor on disk, as torch.save of the model writes
    assert out["lm_head.weight"].data_ptr() == out["wte.weight"].data_ptr()


def test_a_state_dict_asked_for_its_average_is_not_blamed_on_a_run(tmp_path):
    torch.save(_model("gpt_test").state_dict(), tmp_path / "w.pt")
    r = _export(str(tmp_path / "w.pt"), str(tmp_path / "out.pt"), "--ema")
    assert r.returncode == 1 and r.stderr.strip() == f"error: {tmp_path / 'w.pt'}: holds no weight average (one set " \
        "of weights; a run with ema.decay set writes both); leave the average out", r.stderr


def test_export_refuses_only_the_runs_own_checkpoints(tmp_path):
    """A run's checkpoint copied elsewhere, or state dicts in a folder of one's own called
    checkpoints/, export beside themselves: only a run's checkpoints/ with its last.pt is kept whole."""
    sd = _model("gpt_test").state_dict()
    (tmp_path / "keep").mkdir()
    torch.save({"step": 2, "config": "model:\n  family: gpt\n", "model": sd, "ema": None}, tmp_path / "keep/a.pt")
    (tmp_path / "checkpoints").mkdir()
    torch.save(sd, tmp_path / "checkpoints/own.pt")
    for src, out in (("keep/a.pt", "keep/b.pt"), ("checkpoints/own.pt", "checkpoints/b.pt")):
        r = _export(str(tmp_path / src), str(tmp_path / out))
        assert r.returncode == 0 and (tmp_path / out).is_file(), r.stderr


def test_an_export_keeps_the_runs_dtypes(tmp_path):
    """The fold is computed in float64 and written in the weight's own dtype: no file twice the size."""
    sd = _model("vit_test", *SIGMA_QKV).state_dict()
    torch.save(sd, tmp_path / "w.pt")
    assert _export(str(tmp_path / "w.pt"), str(tmp_path / "out.pt")).returncode == 0
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {v.dtype for v in out.values()} == {torch.float32}, {k: v.dtype for k, v in out.items()}


def test_timms_own_checkpoint_exports_its_weight_average(tmp_path):
    """timm's train.py writes the average as state_dict_ema beside state_dict."""
    from stabletrain.models.weights import read_weights

    live, avg = _model("vit_test").state_dict(), _model("vit_test", seed=1).state_dict()
    torch.save({"epoch": 3, "state_dict": live, "state_dict_ema": avg}, tmp_path / "timm.pth.tar")
    for average, want in ((False, live), (True, avg)):
        got = read_weights(tmp_path / "timm.pth.tar", average=average)[0]
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_an_export_cut_off_leaves_no_file_behind(tmp_path, monkeypatch, capsys):
    """A write that fails (a full disk) leaves neither OUT nor its .tmp beside it."""
    from scripts.export_weights import main

    torch.save(_model("gpt_test").state_dict(), tmp_path / "w.pt")

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="No space left"):
        main([str(tmp_path / "w.pt"), str(tmp_path / "out.pt")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pt"]
