"""activation_checkpointing=true: each block's forward is recomputed in backward, with the same numbers.

Dropout and drop path draw their masks in the forward; non-reentrant checkpointing saves the
RNG state and replays it on recomputation, so losses and gradients equal the plain model's
(with the same seed) whatever the stochastic layers do.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from stabletrain.engine.sharding import apply_activation_checkpointing
from stabletrain.models.registry import transformer_blocks
from tests.helpers import QUIET, losses, make_cfg, model_of, train

CASES = {
    "vit_test": ["model=vit_test", "model.drop_path=0.3", "model.num_classes=10"],
    "swin_test": ["model=swin_test", "model.drop_path=0.3", "model.num_classes=10"],
    "gpt_test": ["model=gpt_test", "model.dropout=0.2"],
}


def _batch(cfg):
    g = torch.Generator().manual_seed(1)
    m = cfg.model
    if m.family == "gpt":
        x = torch.randint(0, m.vocab_size, (4, m.block_size), generator=g)
        return x, torch.randint(0, m.vocab_size, (4, m.block_size), generator=g)
    return torch.randn(4, m.in_chans, m.img_size, m.img_size, generator=g), torch.randint(0, 10, (4,), generator=g)


def _loss_and_grads(model, x, y):
    torch.manual_seed(123)  # the same masks for both models, if the recomputation replays them
    model.train()
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(CASES))
def test_checkpointed_blocks_give_the_same_loss_and_gradients(name):
    cfg = make_cfg(*CASES[name])
    torch.manual_seed(0)
    plain = model_of(cfg)
    ckpt = copy.deepcopy(plain)
    keys = list(ckpt.state_dict())
    blocks = transformer_blocks(ckpt)
    assert apply_activation_checkpointing(blocks) == len(blocks) > 0
    assert list(ckpt.state_dict()) == keys  # checkpoints and monitors see the same names
    assert [n for n, _ in transformer_blocks(ckpt)] == [n for n, _ in blocks]

    x, y = _batch(cfg)
    calls = []
    orig = torch.utils.checkpoint.checkpoint

    def counting(*a, **kw):
        calls.append(kw.get("use_reentrant"))
        return orig(*a, **kw)

    torch.utils.checkpoint.checkpoint = counting
    try:
        l_ckpt, g_ckpt = _loss_and_grads(ckpt, x, y)
    finally:
        torch.utils.checkpoint.checkpoint = orig
    assert calls == [False] * len(blocks)  # every block, non-reentrant
    l_plain, g_plain = _loss_and_grads(plain, x, y)
    torch.testing.assert_close(l_ckpt, l_plain)
    assert g_ckpt.keys() == g_plain.keys()
    for n in g_plain:
        torch.testing.assert_close(g_ckpt[n], g_plain[n], msg=n)
    # the stochastic layers really drew masks: another seed gives another loss
    torch.manual_seed(7)
    assert not torch.equal(F.cross_entropy(*_flat(plain(x), y)), l_plain)


def _flat(out, y):
    return (out.flatten(0, -2) if out.dim() > 2 else out), y.flatten()


def test_pre_hooks_see_the_block_input_and_eval_does_not_checkpoint():
    cfg = make_cfg(*CASES["gpt_test"])
    model = model_of(cfg)
    blocks = transformer_blocks(model)
    apply_activation_checkpointing(blocks)
    seen = []
    name, blk = blocks[1]
    blk.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    inputs = []
    blocks[0][1].register_forward_hook(lambda m, args, out: inputs.append(out.detach().clone()))
    x, _ = _batch(cfg)
    model.eval()
    with torch.no_grad():
        model(x)
    assert len(seen) == 1 and torch.equal(seen[0], inputs[0])
    model.train()
    model(x).sum().backward()  # the recomputation runs the block's forward, not its hooks
    assert len(seen) == 2 and torch.equal(seen[1], inputs[1])


def test_training_with_activation_checkpointing_logs_the_same_losses(tmp_path):
    args = ["model=gpt_test", "model.dropout=0.1", "steps=3", "logger.log_every=1", "eval_every=1000", *QUIET]
    train(tmp_path / "plain", *args)
    train(tmp_path / "ckpt", *args, "activation_checkpointing=true")
    a, b = losses(tmp_path / "plain"), losses(tmp_path / "ckpt")
    assert a.keys() == b.keys() and len(a) == 3
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-6), s


def test_a_run_says_how_many_blocks_it_checkpoints(tmp_path):
    """The option took effect invisibly: no start line, not even in a dry run, said so."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, "model=gpt_test", "activation_checkpointing=true"), tmp_path)
    assert "activation checkpointing: 2 block(s) recompute their activations in the backward pass" in t.notes
    assert all(getattr(b, "activation_checkpointed", False) for _, b in transformer_blocks(t.model))
