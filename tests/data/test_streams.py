"""Embedded data, step-indexed streams, and clear errors for missing data."""

import numpy as np
import pytest
import torch

from stabletrain.config import ConfigError
from stabletrain.build import data_from_config
from stabletrain.data import Shard, epoch_indices
from tests.helpers import cli, make_cfg


def test_digits_are_real_and_split():
    d = data_from_config(make_cfg("model=vit_test"))
    assert d.kind == "vision" and d.num_classes == 10 and d.in_chans == 1
    x, y = next(d.val_batches(512, 1))
    assert x.shape[1:] == (1, 16, 16) and set(y.tolist()) == set(range(10))
    assert d.n_train + len(y) == 1797


def test_pytext_is_stdlib_bytes():
    d = data_from_config(make_cfg("model=gpt_test"))
    assert d.kind == "text" and d.vocab_size == 256
    text = bytes(d.train[:20000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import" in text


@pytest.mark.parametrize("fraction", [0.2, 0.35])
def test_pytext_validates_on_the_last_half_of_its_val_fraction(fraction):
    """As config.py and docs/data.md say (0.2 gives 10%, the split every pytext figure in the docs
    was measured with); digits take all of it."""
    d = data_from_config(make_cfg("model=gpt_test", f"data.val_fraction={fraction}"))
    assert d.n_val / (d.n_train + d.n_val) == pytest.approx(fraction / 2, abs=1e-6)
    from stabletrain.data.embedded import pytext_bytes
    from stabletrain.data.tokenizer import encode

    whole, _ = encode(pytext_bytes(), "byte")
    assert np.array_equal(d.val, whole[d.n_train:]) and np.array_equal(d.train, whole[:d.n_train])


def test_epoch_stream_is_a_permutation_per_epoch():
    idx = epoch_indices(10, seed=3, start=0, count=30)
    for e in range(3):
        assert sorted(idx[10 * e:10 * (e + 1)].tolist()) == list(range(10))
    assert torch.equal(epoch_indices(10, 3, 7, 9), idx[7:16])  # any window of the same stream


def test_ranks_and_micro_batches_partition_the_global_batch():
    d = data_from_config(make_cfg("model=gpt_test"))
    whole = next(d.train_iter(5, Shard(8)))
    assert len(whole) == 1 and whole[0][0].shape == (8, 32)
    parts = [next(d.train_iter(5, Shard(8, rank=r, world=2, accum=2))) for r in range(2)]
    xs = torch.cat([x for p in parts for x, _ in p])
    assert torch.equal(xs, whole[0][0])
    x, y = whole[0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets


def test_tokens_bin(tmp_path):
    arr = (np.arange(5000) % 50000).astype(np.uint16)
    arr.tofile(tmp_path / "train.bin")
    arr[:1000].tofile(tmp_path / "val.bin")
    d = data_from_config(make_cfg("model=gpt_test", "data=tokens", f"data.path={tmp_path / 'train.bin'}",
                            "model.vocab_size=50304"))
    x, y = next(d.train_iter(0, Shard(4)))[0]
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_gpt2_tokenizer_offline_gives_a_clear_error(monkeypatch):
    import tiktoken

    def offline(_name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(ConfigError, match="TIKTOKEN_CACHE_DIR|data.tokenizer=byte"):
        data_from_config(make_cfg("model=gpt_test", "data.tokenizer=gpt2"))


def test_data_must_fit_the_model():
    with pytest.raises(ConfigError, match="does not fit"):
        data_from_config(make_cfg("model=gpt_test", "data=digits"))


@pytest.mark.parametrize("args,needle", [
    (["model=nope"], "model=nope is not an option of 'model'"),
    (["optimm.lr=0.1"], "optimm.lr"),
    (["optim.lr=-1"], "optim.lr=-1.0 must be > 0"),
    (["steps=abc"], "steps"),
    (["data=imagefolder", "data.root=/nonexistent"], "data.root=/nonexistent"),
    (["norm=stablenorm", "norm.alpha=0.7"], "norm.alpha=0.7 must be in [0, 0.5]"),
    (["optim.tau=0"], "optim.tau=0.0 must be > 0"),
    (["model=gpt_test", "data=tokens", "data.path=/nope.bin"], "data.path=/nope.bin"),
    (["norm.eps_mode=foo"], "foo"),
])
def test_bad_input_is_one_clear_line(args, needle, tmp_path):
    r = cli(*args, f"hydra.run.dir={tmp_path}", timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in r.stderr


def test_recipe_required_value_is_named(tmp_path):
    r = cli("experiment=deesc_vit_cifar", f"hydra.run.dir={tmp_path}", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: optim.lr is required by this recipe (the paper does not give it): "
                                "set optim.lr=VALUE")


def test_repeated_augmentation_stream():
    idx = epoch_indices(10, seed=1, start=0, count=10, repeats=2)
    pairs = idx.view(5, 2)
    assert torch.equal(pairs[:, 0], pairs[:, 1]) and len(set(pairs[:, 0].tolist())) == 5
    plain = torch.randperm(10, generator=torch.Generator().manual_seed(100_003))
    assert torch.equal(epoch_indices(10, 1, 0, 10), plain)
    d = data_from_config(make_cfg("model=vit_test", "data.repeated_aug=3"))
    (x, y), = next(d.train_iter(0, Shard(6)))
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2]) and y[0] == y[2]


def test_randaugment_posterize_at_the_magnitude_cap_gives_a_black_image():
    """The recipes' rand-m9-mstd0.5-inc1 reaches magnitude 10 now and then, where posterize
    keeps 0 bits; Pillow 13 refuses that, older Pillow returned black, and so do we."""
    from PIL import Image

    from stabletrain.data.vision import image_transforms

    cfg = make_cfg("experiment=adamw2_vit_b", "model=vit_test")
    train_tf, _ = image_transforms(cfg.data, cfg.model.img_size)
    ra = next(t for t in train_tf.transforms if hasattr(t, "ops"))
    op = next(o for o in ra.ops if o.name == "PosterizeIncreasing")
    op.magnitude, op.magnitude_std, op.prob = 10, 0, 1.0
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 20, 3), dtype=np.uint8))
    assert not np.asarray(op(img)).any()
    op.magnitude = 5  # 4 - int(0.4 * 5) = 2 bits: timm's own posterize
    assert np.array_equal(np.asarray(op(img)), np.asarray(img) & 0b11000000)


def test_every_value_of_a_sweep_is_checked_before_it_starts(tmp_path):
    r = cli("-m", "optim.lr=1e-3,-1,2e-3", "model=vit_test", "steps=1", f"hydra.sweep.dir={tmp_path}", timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("error: optim.lr=-1.0 must be > 0 (e.g. optim.lr=1e-3) "
                                                      "(sweep point optim.lr=-1; no point was launched)")
    assert not any(tmp_path.rglob("summary.json"))  # no point ran


def test_image_evaluation_draws_nothing_from_the_global_rng():
    """A DataLoader without its own generator draws its seed from torch's global one, which
    dropout and drop path use: an evaluation would shift a run's masks by when it happened."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from stabletrain.data.vision import ImageData

    ds = TensorDataset(torch.randn(10, 3, 4, 4), torch.arange(10) % 2)
    d = ImageData(SimpleNamespace(num_workers=0, repeated_aug=1), 0, ds, ds, 2)
    torch.manual_seed(1)
    expect = torch.rand(3)
    torch.manual_seed(1)
    assert len(list(d.val_batches(4, 10))) == 3
    assert torch.equal(torch.rand(3), expect)


def test_a_partial_evaluation_scores_a_fixed_random_part_of_the_val_set():
    """An ImageFolder lists the val images class by class: 2 batches of 4 of 40 images must not be
    the first two classes. The part is the same for every call, run and seed; all of it when it fits.
    The start lines say how much is scored and the eval_batches that score all of it."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from stabletrain.build import eval_note
    from stabletrain.data.vision import ImageData

    labels = torch.arange(40) // 4  # 10 classes in order, 4 images each
    ds = TensorDataset(torch.arange(40).float().view(40, 1, 1, 1).expand(40, 3, 2, 2), labels)

    def scored(seed, batches):
        d = ImageData(SimpleNamespace(num_workers=0, repeated_aug=1), seed, ds, ds, 10)
        return torch.cat([y for _, y in d.val_batches(4, batches)])

    part = scored(0, 2)
    assert len(part) == 8 and len(set(part.tolist())) > 2  # not classes 0 and 1 only
    assert torch.equal(part, scored(0, 2)) and torch.equal(part, scored(7, 2))
    assert torch.equal(scored(0, 10), labels)  # all of it: in order
    d = ImageData(SimpleNamespace(num_workers=0, repeated_aug=1), 0, ds, ds, 10)
    cfg = SimpleNamespace(batch_size=4, eval_batches=2)
    assert eval_note(d, cfg) == ("validation: 8 of the 40 val images per evaluation (eval_batches=2 of 4, a fixed "
                                 "random part); eval_batches=10 scores them all")
    assert eval_note(d, SimpleNamespace(batch_size=4, eval_batches=10)) is None
