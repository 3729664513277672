"""The data streams against their recipes: each batch, window, validation set and augmentation
seed compared with the value the documented recipe gives (seed * 100_003 + epoch or step,
SeedSequence([seed, draw]), the fixed validation seeds), not only with a second run of the same
code, which a deterministic bug passes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from stabletrain.build import data_from_config
from stabletrain.data import Shard, TokenWindows, epoch_indices
from tests.helpers import make_cfg


# --- epoch permutations ------------------------------------------------------------------


def test_each_epoch_has_its_own_permutation_seeded_by_seed_and_epoch():
    idx = epoch_indices(10, seed=3, start=0, count=30)
    for e in range(3):
        want = torch.randperm(10, generator=torch.Generator().manual_seed(3 * 100_003 + e))
        assert torch.equal(idx[10 * e:10 * (e + 1)], want)
    assert not torch.equal(idx[:10], idx[10:20])  # a new order every epoch, not one order repeated


def test_repeated_augmentation_takes_ceil_n_over_repeats_samples_and_whole_epochs():
    idx = epoch_indices(10, seed=1, start=0, count=20, repeats=3)
    assert len(idx) == 20
    perm0 = torch.randperm(10, generator=torch.Generator().manual_seed(100_003))
    perm1 = torch.randperm(10, generator=torch.Generator().manual_seed(100_004))
    # ceil(10 / 3) = 4 distinct samples, each 3 times in a row, cut at 10 draws
    assert idx[:10].tolist() == perm0[:4].repeat_interleave(3)[:10].tolist()
    assert idx[10:].tolist() == perm1[:4].repeat_interleave(3)[:10].tolist()
    assert torch.equal(epoch_indices(10, 1, 9, 5, repeats=3), idx[9:14])  # a window across the epoch boundary


# --- in-memory images (digits) -------------------------------------------------------------


def test_image_ranks_take_their_slice_of_the_same_global_batch():
    d = data_from_config(make_cfg("model=vit_test"))
    idx = epoch_indices(d.n_train, 0, 5 * 8, 8)  # step 5 of batch 8, seed 0
    (x, y), = next(d.train_iter(5, Shard(8)))
    assert torch.equal(y, d.t["y_train"][idx]) and torch.equal(x, d.t["x_train"][idx])
    parts = [mb for r in range(2) for mb in next(d.train_iter(5, Shard(8, rank=r, world=2, accum=2)))]
    assert [len(py) for _, py in parts] == [2, 2, 2, 2]
    assert torch.equal(torch.cat([py for _, py in parts]), y)
    assert torch.equal(torch.cat([px for px, _ in parts]), x)


def test_digits_val_is_a_fixed_split_served_whole_with_its_last_partial_batch():
    d = data_from_config(make_cfg("model=vit_test"))
    d2 = data_from_config(make_cfg("model=vit_test", "seed=5"))
    assert d.n_val == 359 and d.n_train == 1438  # round(1797 * 0.2)
    assert torch.equal(d.t["y_val"], d2.t["y_val"]) and torch.equal(d.t["x_train"], d2.t["x_train"])
    from sklearn.datasets import load_digits

    target = torch.tensor(load_digits().target)
    perm = torch.randperm(1797, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(d.t["y_val"], target[perm[:359]]) and torch.equal(d.t["y_train"], target[perm[359:]])
    batches = list(d.val_batches(100, 10))
    assert [len(y) for _, y in batches] == [100, 100, 100, 59]
    assert torch.equal(torch.cat([y for _, y in batches]), d.t["y_val"])


# --- text windows ----------------------------------------------------------------------------


def windows(train_len=5000, val_len=1000, seq=32, seed=0):
    train = np.arange(train_len, dtype=np.uint16)
    val = (np.arange(val_len) + 20_000).astype(np.uint16)  # val ids never occur in train
    return TokenWindows(train, val, 65536, seq, seed)


def test_text_windows_start_where_the_seeded_draw_says_and_targets_shift_by_one():
    d = windows(seed=2)
    for step in (0, 1, 7):
        (x, y), = next(d.train_iter(step, Shard(4)))
        g = torch.Generator().manual_seed(2 * 100_003 + step)
        starts = torch.randint(0, 5000 - 32 - 1, (4,), generator=g)
        want = starts[:, None] + torch.arange(33)
        assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])


def test_consecutive_steps_and_seeds_draw_other_windows():
    a = [next(windows(seed=0).train_iter(s, Shard(8)))[0][0][:, 0] for s in (0, 1)]
    b = next(windows(seed=1).train_iter(0, Shard(8)))[0][0][:, 0]
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], b)


def test_text_windows_never_cross_the_end_of_the_file():
    seq = 8
    d = windows(train_len=seq + 3, seq=seq)  # three valid starts at most
    seen = set()
    for step in range(200):
        (x, y), = next(d.train_iter(step, Shard(4)))
        assert x.shape == y.shape == (4, seq)
        assert int(y.max()) <= seq + 2  # the file's last token
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen |= set(x[:, 0].tolist())
    assert seen <= {0, 1, 2}


def test_text_val_is_fixed_and_drawn_from_val_only():
    d0, d7 = windows(seed=0), windows(seed=7)
    b0, b7 = list(d0.val_batches(4, 3)), list(d7.val_batches(4, 3))
    g = torch.Generator().manual_seed(4321)
    for (x, y), (x7, _) in zip(b0, b7):
        starts = torch.randint(0, 1000 - 33, (4,), generator=g)
        want = 20_000 + starts[:, None] + torch.arange(33)
        assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:]) and torch.equal(x, x7)


def test_pytext_val_is_the_tail_of_the_text_and_train_its_head():
    from stabletrain.data.embedded import pytext_bytes

    d = data_from_config(make_cfg("model=gpt_test"))
    arr = pytext_bytes()
    assert len(d.train) + len(d.val) == len(arr)
    assert len(d.val) == len(arr) - int(len(arr) * 0.9)  # data.val_fraction=0.2, halved for text
    assert np.array_equal(d.train, arr[:len(d.train)]) and np.array_equal(d.val, arr[len(d.train):])


# --- image loader: per-sample seeding --------------------------------------------------------


class NoisyIndex(Dataset):
    """Sample ``i`` is ``i`` plus three numbers from torch's RNG (a stand-in random transform)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.rand(3) + i, i % 2


def expected_sample(seed: int, index: int, draw: int) -> torch.Tensor:
    s = int(np.random.SeedSequence([seed, draw]).generate_state(1)[0])
    return torch.rand(3, generator=torch.Generator().manual_seed(s)) + index


@pytest.mark.parametrize("workers", [0, 2])
def test_each_image_sample_is_seeded_by_its_place_in_the_stream_whatever_the_workers(workers):
    from stabletrain.data.vision import ImageData

    d = ImageData(SimpleNamespace(num_workers=workers, repeated_aug=1), 3, NoisyIndex(), NoisyIndex(), 2)
    stream = d.train_iter(1, Shard(4, accum=2))
    for step in (1, 2, 3):
        got = torch.cat([x for x, _ in next(stream)])
        idx = epoch_indices(10, 3, 4 * step, 4)
        want = torch.stack([expected_sample(3, i, 4 * step + k) for k, i in enumerate(idx.tolist())])
        assert torch.equal(got, want), step


# --- image folders: val gets the eval transform ----------------------------------------------


def test_imagefolder_val_images_go_through_the_eval_transform_only(tmp_path):
    from PIL import Image

    from stabletrain.data.vision import image_transforms

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("ant", "bee"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(2):
                pixels = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / c / f"{i}.png")
    cfg = make_cfg("model=vit_test", "data=imagefolder", f"data.root={tmp_path}", "data.num_workers=0")
    d = data_from_config(cfg)
    _, val_tf = image_transforms(cfg.data, cfg.model.img_size)
    x, y = next(d.val_batches(4, 1))
    files = [tmp_path / "val" / c / f"{i}.png" for c in ("ant", "bee") for i in range(2)]
    want = torch.stack([val_tf(Image.open(f).convert("RGB")) for f in files])
    assert y.tolist() == [0, 0, 1, 1] and torch.equal(x, want)


# --- mixup / cutmix ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mixup", "cutmix"])
def test_mixup_and_cutmix_mix_labels_with_the_images_lambda(mode):
    from stabletrain.data.vision import vision_loss

    d = SimpleNamespace(mixup=0.8 if mode == "mixup" else 0.0, cutmix=1.0 if mode == "cutmix" else 0.0,
                        label_smoothing=0.0)
    mix, _ = vision_loss(d, 10)
    for trial in range(5):
        torch.manual_seed(trial)
        np.random.seed(trial)
        x = torch.rand(4, 3, 16, 16)
        y = torch.tensor([0, 1, 2, 3])
        xm, ym = mix(x.clone(), y)
        flip = x.flip(0)
        if mode == "mixup":  # every pixel is lam * x + (1 - lam) * x.flip(0), lam the same
            lam = ((xm - flip) / (x - flip))[0, 0, 0, 0].item()
            torch.testing.assert_close(xm, lam * x + (1 - lam) * flip)
        else:  # a box of the flipped batch pasted in: lam is the share of pixels kept
            kept = (xm == x).all(1) & ~(xm == flip).all(1)
            lam = kept[0].float().mean().item()
            assert ((xm == x) | (xm == flip)).all()
        eye = torch.eye(10)
        torch.testing.assert_close(ym, lam * eye[y] + (1 - lam) * eye[y.flip(0)], atol=1e-6, rtol=1e-5)


# --- topology ------------------------------------------------------------------------------------


def test_torchrun_rank_is_the_global_rank_not_the_local_one(monkeypatch):
    from stabletrain.topology import DistInfo, detect

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")  # second node, second GPU
    assert detect() == DistInfo(rank=5, world=8, local_rank=1)


def test_seeding_a_samples_transforms_leaves_the_trainings_rng_alone():
    """With no workers the transforms run in the training process: the per-sample seeding must
    not reseed the global generators that dropout / drop path draw from."""
    import random

    from stabletrain.data.vision import ImageData

    d = ImageData(SimpleNamespace(num_workers=0, repeated_aug=1), 3, NoisyIndex(), NoisyIndex(), 2)
    stream = d.train_iter(0, Shard(4))
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    next(stream)
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1] and np.random.rand() == want[2]
