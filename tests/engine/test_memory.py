"""The host-memory check of a CPU run: what the forward keeps for the backward, counted exactly."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from stabletrain.engine.memory import activation_bytes, check_host_memory, saved_bytes, traced_bytes
from stabletrain.engine.sharding import apply_activation_checkpointing
from stabletrain.errors import ConfigError
from stabletrain.models.registry import transformer_blocks
from tests.helpers import make_cfg, model_of, train

NO_AUTOCAST = contextlib.nullcontext


def test_an_mlp_keeps_its_input_hidden_layer_twice_and_output():
    """Linear keeps its input (for the weight's gradient), GELU its input, the second Linear
    GELU's output; the loss keeps the output. Weights are not activations."""
    d, h, c = 7, 33, 5
    mlp = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, c))
    assert saved_bytes(mlp, torch.randn(1, d), NO_AUTOCAST) == 4 * (d + h + h + c)
    assert activation_bytes(mlp, torch.randn(16, d), 100, NO_AUTOCAST) == 100 * 4 * (d + h + h + c)


class NormalisedLinear(nn.Module):
    """Like sigmaReparam: the weight the forward uses, W / |W|, is saved once, whatever the batch."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))

    def forward(self, x):
        return nn.functional.linear(x, self.weight / self.weight.norm())


def test_what_the_forward_keeps_once_is_not_counted_per_sample():
    d_in, d_out = 64, 32
    model = nn.Sequential(nn.Linear(d_in, d_in, bias=False), NormalisedLinear(d_in, d_out))
    one = saved_bytes(model, torch.randn(1, d_in), NO_AUTOCAST)
    # W / |W| (its input needs a gradient) and |W|; the sample's input, hidden state and output
    assert one == 4 * (d_out * d_in + 1 + d_in + d_in + d_out)
    per_sample = 4 * (d_in + d_in + d_out)
    assert activation_bytes(model, torch.randn(2, d_in), 100, NO_AUTOCAST) == one + 99 * per_sample


def test_the_measure_leaves_the_model_and_the_random_stream_as_they_were():
    model = model_of(make_cfg("model=vit_test", "reparam=sigma", "model.dropout=0.1"))
    model.eval()
    before = [b.clone() for b in model.buffers()]
    x = torch.randn(2, 3, 16, 16)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    saved_bytes(model, x, NO_AUTOCAST)
    assert torch.equal(torch.rand(3), expected) and not model.training
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def _batch(cfg, n: int) -> torch.Tensor:
    m = cfg.model
    if m.family == "gpt":
        return torch.randint(0, m.vocab_size, (n, m.block_size))
    return torch.randn(n, m.in_chans, m.img_size, m.img_size)


@pytest.mark.parametrize("overrides,checkpointed,bf16", [
    (["model=gpt_test"], False, False), (["model=gpt_test"], True, False), (["model=gpt_test"], False, True),
    (["model=vit_test", "reparam=sigma"], False, False), (["model=swin_test"], False, True),
    (["model=gpt_test", "attention=stable", "norm=stablenorm", "deescalate=block"], False, False),
    (["model=vit_test", "attention=qknorm", "init=stable"], True, False),
])
def test_the_fake_trace_counts_what_a_real_forward_of_the_micro_batch_keeps(overrides, checkpointed, bf16):
    """Shapes alone give the bytes: the traced figure for 3 samples is the real forward's."""
    cfg = make_cfg(*overrides)
    model = model_of(cfg)
    if checkpointed:
        apply_activation_checkpointing(transformer_blocks(model))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else NO_AUTOCAST
    x = _batch(cfg, 3)
    for micro in (1, 3):
        real = saved_bytes(model, x[:micro], autocast)
        if bf16:  # fake LayerNorm statistics under autocast are bf16, the CPU kernel's fp32: <1% on a Swin
            assert abs(traced_bytes(model, x, micro, autocast) / real - 1) < 0.02
        else:
            assert traced_bytes(model, x, micro, autocast) == real


def test_the_trace_allocates_nothing_and_leaves_the_model_as_it_was():
    """100000 samples of gpt_test would keep ~24 GB: traced, that is a number, and the model's
    buffers (sigmaReparam's power-iteration vectors) and the random stream are untouched."""
    cfg = make_cfg("model=gpt_test", "reparam=sigma", "model.dropout=0.1")
    model = model_of(cfg).eval()
    before = [b.clone() for b in model.buffers()]
    x = _batch(cfg, 3)
    two, three = saved_bytes(model, x[:2], NO_AUTOCAST), saved_bytes(model, x, NO_AUTOCAST)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert traced_bytes(model, x, 100_000, NO_AUTOCAST) == two + 99_998 * (three - two)
    assert torch.equal(torch.rand(3), expected) and not model.training
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


class ReadsAValue(nn.Module):
    """A forward that reads a tensor's value, which fake tensors do not have."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(x) * (1.0 if x.sum().item() > 0 else -1.0)


def test_a_forward_fake_tensors_cannot_run_is_measured_for_real():
    d = 8
    model = ReadsAValue(d)
    x = torch.randn(2, d)
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with pytest.raises(DataDependentOutputException):
        traced_bytes(model, x, 5, NO_AUTOCAST)
    assert activation_bytes(model, x, 5, NO_AUTOCAST) == 5 * 4 * (d + d)  # fc's input, the output


def test_activation_checkpointing_shrinks_the_estimate():
    model = model_of(make_cfg("model=gpt_test"))
    x = torch.randint(0, 64, (2, 32))
    full = saved_bytes(model, x, NO_AUTOCAST)
    apply_activation_checkpointing(transformer_blocks(model))
    assert saved_bytes(model, x, NO_AUTOCAST) < full / 2


def test_a_step_that_cannot_fit_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(10, 1000), nn.GELU(), nn.Linear(1000, 10))  # 8 KB per sample
    x = torch.randn(4, 10)
    check_host_memory(model, x, micro=100, autocast=NO_AUTOCAST, available=10**9)
    with pytest.raises(ConfigError, match=r"needs at least 8\.1 MB more memory \(the activations of a micro-batch "
                                          r"of 1000 samples\), more than the 5\.0 MB free here; .*"
                                          r"set activation_checkpointing=true, or train on a GPU"):
        check_host_memory(model, x, micro=1000, autocast=NO_AUTOCAST, available=5 * 10**6)


def test_a_compiled_model_and_a_dry_run_are_warned_not_refused():
    """Inductor may save less than the eager forward that was measured: no certainty, no refusal."""
    model = nn.Sequential(nn.Linear(10, 1000), nn.GELU(), nn.Linear(1000, 10))
    note = check_host_memory(model, torch.randn(4, 10), micro=1000, autocast=NO_AUTOCAST, compiled=True,
                             available=5 * 10**6)
    assert note.startswith("warning: uncompiled, a training step would need at least 8.1 MB more memory")
    assert check_host_memory(model, torch.randn(4, 10), micro=10, autocast=NO_AUTOCAST, compiled=True,
                             available=5 * 10**6) is None
    note = check_host_memory(model, torch.randn(4, 10), micro=1000, autocast=NO_AUTOCAST, dry_run=True,
                             available=5 * 10**6)
    assert note.startswith("warning: a training step would need at least 8.1 MB")  # a dry run trains nothing


def test_the_run_checks_before_it_trains(tmp_path, monkeypatch):
    import stabletrain.engine.memory as M

    monkeypatch.setattr(M, "available_bytes", lambda: 1000)
    with pytest.raises(ConfigError, match="a training step needs at least"):
        train(tmp_path, "model=vit_test", "steps=1")
    assert not tmp_path.exists()  # refused while built: no directory left to mistake for a run's
    (tmp_path / ".hydra").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="a training step needs at least"):
        train(tmp_path, "model=vit_test", "steps=1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", ".lock", "notes.txt"]  # not only the run's: kept
