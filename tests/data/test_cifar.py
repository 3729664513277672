"""data=cifar10 / cifar100: torchvision's pickle files, CIFAR normalisation, clear errors when missing.

The data sets here are tiny fakes in the real python-pickle layout; only torchvision's md5
check is patched (to "the file exists"), so everything else runs as on the real files.
"""

import os
import pickle

import numpy as np
import pytest
import torch
import torchvision

from stabletrain.config import ConfigError
from stabletrain.build import data_from_config
from stabletrain.data import Shard
from tests.helpers import QUIET, cli, make_cfg, train

# name: (folder, {file: images}, label key, meta file, meta key, classes, mean, std)
LAYOUT = {
    "cifar10": ("cifar-10-batches-py", {**{f"data_batch_{i}": 3 for i in range(1, 6)}, "test_batch": 5},
                "labels", "batches.meta", "label_names", 10,
                (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("cifar-100-python", {"train": 15, "test": 5}, "fine_labels", "meta", "fine_label_names", 100,
                 (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def fake_cifar(root, name: str) -> dict:
    """Random images and labels in CIFAR's pickle format under ``root``; returns what was written."""
    folder, files, label_key, meta_file, meta_key, classes, *_ = LAYOUT[name]
    d = root / folder
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for fname, n in files.items():
        entry = {"data": rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8),
                 label_key: rng.integers(0, classes, n).tolist()}
        if name == "cifar100":
            entry["coarse_labels"] = [c // 5 for c in entry[label_key]]
        (d / fname).write_bytes(pickle.dumps(entry))
        written[fname] = entry
    (d / meta_file).write_bytes(pickle.dumps({meta_key: [f"class{i}" for i in range(classes)]}))
    return written


@pytest.fixture
def no_md5(monkeypatch):
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


def cifar_cfg(name, root, *extra):
    return make_cfg("model=vit_test", "model.img_size=32", f"data={name}", f"data.root={root}",
                    "data.num_workers=0", *extra)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_eval_batch_is_the_pickled_pixels_normalised(tmp_path, no_md5, name):
    written = fake_cifar(tmp_path, name)
    *_, label_key, _, _, classes, mean, std = LAYOUT[name]
    test = written["test_batch" if name == "cifar10" else "test"]
    d = data_from_config(cifar_cfg(name, tmp_path))
    assert d.kind == "vision" and d.num_classes == classes and d.in_chans == 3
    assert d.n_train == sum(len(e[label_key]) for f, e in written.items() if "test" not in f)

    x, y = next(d.val_batches(batch_size=4, max_batches=len(test[label_key])))  # all of it: in order
    assert x.shape == (4, 3, 32, 32) and y.tolist() == test[label_key][:4]
    pixels = torch.tensor(test["data"][1], dtype=torch.float32).view(3, 32, 32) / 255  # CHW, as pickled
    expect = (pixels - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    torch.testing.assert_close(x[1], expect, atol=1e-5, rtol=0)

    (xt, yt), = next(d.train_iter(0, Shard(6)))
    train_labels = [v for f, e in written.items() if "test" not in f for v in e[label_key]]
    assert xt.shape == (6, 3, 32, 32) and set(yt.tolist()) <= set(train_labels)


def test_class_count_reaches_the_model(tmp_path, no_md5):
    from stabletrain.build import build_trainer

    fake_cifar(tmp_path / "data", "cifar100")
    t = build_trainer(make_cfg(*QUIET, "model=vit_test", "model.img_size=32", "data=cifar100",
                         f"data.root={tmp_path / 'data'}", "data.num_workers=0", "steps=1"), tmp_path / "run")
    assert t.model.head.out_features == 100 and t.model.patch_embed.img_size == (32, 32)


def test_cifar10_trains(tmp_path, no_md5):
    fake_cifar(tmp_path / "data", "cifar10")
    s = train(tmp_path / "run", "model=vit_test", "model.img_size=32", "data=cifar10",
              f"data.root={tmp_path / 'data'}", "data.num_workers=0", "data.randaug=rand-m9-mstd0.5-inc1",
              "data.erasing=0.25", "steps=2", "batch_size=4", "eval_every=2", "eval_batches=1")
    assert s["status"] == "completed" and "val/acc" in s["final"]


@pytest.mark.parametrize("name,folder,tarball", [("cifar10", "cifar-10-batches-py", "cifar-10-python.tar.gz"),
                                                 ("cifar100", "cifar-100-python", "cifar-100-python.tar.gz")])
def test_missing_files_name_the_folder_and_the_fix(tmp_path, name, folder, tarball):
    with pytest.raises(ConfigError) as e:
        data_from_config(cifar_cfg(name, tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path / folder}/ is missing" in msg
    assert "download=True" in msg and tarball in msg


def test_incomplete_folder_lists_the_missing_files(tmp_path, no_md5):
    fake_cifar(tmp_path, "cifar10")
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(ConfigError, match="lacks data_batch_3"):
        data_from_config(cifar_cfg("cifar10", tmp_path))


def test_files_failing_torchvisions_checksum_are_a_config_error(tmp_path):
    fake_cifar(tmp_path, "cifar10")  # right names, wrong md5 (no patch here)
    with pytest.raises(ConfigError, match="torchvision rejects"):
        data_from_config(cifar_cfg("cifar10", tmp_path))


def test_missing_root_is_one_line_before_training(tmp_path):
    r = cli("model=vit_test", "data=cifar10", f"data.root={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}",
            timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith(f"error: data=cifar10: {tmp_path / 'cifar-10-batches-py'}/ is missing")
    assert not (tmp_path / "run").exists()  # caught by the pre-flight check, before Hydra made a run dir


def test_unset_root_says_which_folder_to_point_at():
    with pytest.raises(ConfigError, match=r"data=cifar100 needs data.root=ROOT, the folder holding cifar-100-python/"):
        data_from_config(make_cfg("model=vit_test", "data=cifar100"))


def test_a_root_at_the_cifar_folder_itself_names_its_parent(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(ConfigError) as e:
        data_from_config(make_cfg("model=vit_test", "data=cifar10", f"data.root={tmp_path / 'cifar-10-batches-py'}"))
    assert str(e.value) == (f"data.root={tmp_path / 'cifar-10-batches-py'} is the cifar-10-batches-py/ folder itself; "
                            f"give the folder that holds it: data.root={tmp_path}")


def test_augmented_runs_repeat_from_a_seed_and_resume_exactly(tmp_path, no_md5):
    """RandAugment, random erasing and mixup in two loader workers: the same seed gives the same
    run, and a run stopped and resumed gives the uninterrupted one (each sample's augmentation
    is seeded by its place in the stream, not by the worker that loads it)."""
    from stabletrain.build import build_trainer
    from tests.helpers import losses
    from tests.engine.test_loop import _run_until

    fake_cifar(tmp_path / "data", "cifar10")
    args = ["model=vit_test", "model.img_size=32", "data=cifar10", f"data.root={tmp_path / 'data'}",
            "data.num_workers=2", "data.randaug=rand-m9-mstd0.5-inc1", "data.erasing=0.25", "data.mixup=0.8",
            "model.drop_path=0.1", "steps=6", "batch_size=4", "eval_every=1000", "logger.log_every=1"]
    train(tmp_path / "a", *args)
    train(tmp_path / "b", *args)
    t = build_trainer(make_cfg(*QUIET, *args, "ckpt_every=3"), tmp_path / "half")
    _run_until(t, 3)
    train(tmp_path / "half", *args, "resume=auto")
    a = losses(tmp_path / "a")
    assert len(a) == 6 and a == losses(tmp_path / "b") == losses(tmp_path / "half")
