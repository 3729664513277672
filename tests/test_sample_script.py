"""scripts/sample.py: a GPT run's model continues a prompt in its own tokens."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, make_cfg, train

BASE = ["model=gpt_test", "batch_size=8", "logger.wandb=disabled", "monitor=off"]


def _sample(*args: str):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sample.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    train(d, *BASE, "steps=20", "reparam=sigma", "ema.decay=0.5", "optim.lr=1e-2")
    return d


def _greedy(run_dir, prompt: bytes, n: int, weights: str = "model") -> str:
    """Argmax decoding by hand, from the checkpoint's tensors in a model composed as the run was."""
    from stabletrain.config import Components
    from stabletrain.models.registry import build_model

    cfg = make_cfg(*BASE, "reparam=sigma")
    model = build_model(cfg.model, Components.of(cfg)).eval()
    ck = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    model.load_state_dict(ck["model"] if weights == "model" else ck["ema"]["module"])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids[-cfg.model.block_size:]]))[0, -1].argmax()))
    return bytes(ids[len(prompt):]).split(b"\xff")[0].decode("utf-8", errors="replace")


@pytest.mark.parametrize("ema", [False, True])
def test_top_k_1_is_the_greedy_continuation_of_the_runs_model(run, ema):
    r = _sample(str(run), "--prompt", "def ", "--tokens", "40", "--top-k", "1", *(["--ema"] if ema else []))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "def " + _greedy(run, b"def ", 40, "ema" if ema else "model") + "\n"
    assert r.stderr.strip() == f"{run}: gpt at step 20" + (" (weight average)" if ema else "") + \
        ", 256-token vocabulary, temperature 0.8, top-k 1, seed 0"


def test_a_seed_draws_the_same_samples_and_another_seed_others(run):
    a, b, c = (_sample(str(run), "--tokens", "30", "--num", "2", "--seed", s, "--temperature", "2")
               for s in ("1", "1", "2"))
    assert a.returncode == 0 and a.stdout == b.stdout != c.stdout
    assert a.stdout.count("-" * 40) == 1


def test_what_sample_cannot_do_is_one_line(run, tmp_path):
    for args, error in ((["--temperature", "0"], "error: --temperature=0.0 must be above 0 (--top-k 1 is greedy)"),
                        (["--tokens", "0"], "error: --tokens=0 must be at least 1")):
        r = _sample(str(run), *args)
        assert r.returncode == 1 and r.stderr.strip() == error, r.stderr
    r = _sample(str(tmp_path))
    assert r.returncode == 1 and r.stderr.strip() == f"error: {tmp_path} has no config.yaml; give a run directory " \
        "(its hydra.run.dir)"
    torch.save({"model": {"transformer.wte.weight": torch.zeros(256, 32)}, "iter_num": 5}, tmp_path / "ckpt.pt")
    r = _sample(str(run), "--checkpoint", str(tmp_path / "ckpt.pt"))  # nanoGPT's: init_weights reads it, not sample
    assert r.returncode == 1 and r.stderr.strip() == f"error: {tmp_path / 'ckpt.pt'}: not a checkpoint of this run's " \
        "model (40 of its 40 tensors missing or of another shape: wte.weight); sample a checkpoint the run wrote, or " \
        "start a run from it with init_weights=PATH", r.stderr
    train(tmp_path / "vit", "model=vit_test", "steps=1", "logger.wandb=disabled", "monitor=off")
    r = _sample(str(tmp_path / "vit"))
    assert r.returncode == 1 and "trained a vit model, not a language model" in r.stderr
