"""Bad data input is one ConfigError line naming the problem and the fix, never a traceback
or a run that goes on with wrong data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from stabletrain.config import ConfigError
from stabletrain.build import data_from_config
from stabletrain.data import Shard, epoch_indices, token_files
from stabletrain.data.token_files import load_token_files
from tests.helpers import cli, make_cfg, train

# --- token files -------------------------------------------------------------------------


def write_bins(folder, train_ids, val_ids, meta: dict | str | None = None):
    np.asarray(train_ids).tofile(folder / "train.bin")
    np.asarray(val_ids).tofile(folder / "val.bin")
    if meta is not None:
        (folder / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return folder / "train.bin"


def ids(n: int, top: int = 200) -> np.ndarray:
    return (np.arange(n) % top).astype(np.uint16)


BYTE_META = {"vocab_size": 256, "dtype": "uint16"}


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_bin_that_is_not_whole_tokens_names_file_size_and_dtype(tmp_path, split):
    path = write_bins(tmp_path, ids(3000), ids(500), BYTE_META)
    f = tmp_path / f"{split}.bin"
    f.write_bytes(f.read_bytes()[:-1])
    size = f.stat().st_size
    with pytest.raises(ConfigError, match=rf"{split}.bin is {size} bytes, not a whole number of uint16 tokens "
                                          r"\(2 bytes each, the dtype .*meta.json gives\)"):
        load_token_files(path)


def test_without_meta_the_size_check_says_the_dtype_was_assumed(tmp_path):
    path = write_bins(tmp_path, ids(3000), ids(500))
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ConfigError, match="6001 bytes, .*read as nanoGPT's uint16 for want of a meta.json"):
        load_token_files(path)


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_bin_is_one_line(tmp_path, split):
    path = write_bins(tmp_path, ids(3000), ids(500), BYTE_META)
    (tmp_path / f"{split}.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"{split}.bin is empty \(0 bytes\)"):
        load_token_files(path)


@pytest.mark.parametrize("meta,needle", [
    ('{"vocab_size": 256, "dtype": "uint16"', r"meta.json is not valid JSON \(JSONDecodeError"),
    ("[256, 2]", "meta.json holds a JSON list, not an object"),
    ({"vocab_size": 256}, "meta.json lacks the key 'dtype'"),
    ({"vocab_size": 256, "dtype": "float32"}, r"dtype='float32' is not supported; token files hold uint8"),
    ({"dtype": "uint16"}, "meta.json lacks the key 'vocab_size'"),
    ({"vocab_size": "256", "dtype": "uint16"}, "vocab_size='256' must be a positive integer"),
    ({"vocab_size": 25.6, "dtype": "uint16"}, "vocab_size=25.6 must be a positive integer"),
    ({"vocab_size": True, "dtype": "uint16"}, "vocab_size=True must be a positive integer"),
    ({**BYTE_META, "train_tokens": "3000"}, "train_tokens='3000' must be a positive integer"),
])
def test_a_bad_meta_json_names_the_key(tmp_path, meta, needle):
    path = write_bins(tmp_path, ids(3000), ids(500), meta)
    with pytest.raises(ConfigError, match=needle) as e:
        load_token_files(path)
    assert "\n" not in str(e.value) and "scripts/prepare_tokens.py" in str(e.value)


@pytest.mark.parametrize("split", ["train", "val"])
def test_ids_beyond_the_meta_vocabulary_name_file_id_and_vocab(tmp_path, split):
    bad = {"train": ids(3000), "val": ids(500)}
    bad[split][123] = 300
    path = write_bins(tmp_path, bad["train"], bad["val"], BYTE_META)
    with pytest.raises(ConfigError, match=rf"{split}.bin holds token id 300 >= vocab_size 256 of .*meta.json: "
                                          r".*vocab_size \(> 300\).*model.vocab_size"):
        load_token_files(path)


def test_ids_beyond_gpt2_in_bins_without_meta(tmp_path):
    path = write_bins(tmp_path, (np.arange(3000) + 57_000).astype(np.uint16), ids(500))
    with pytest.raises(ConfigError, match="train.bin holds token id 59999 >= 50257, the vocabulary assumed for bins "
                                          "without a meta.json"):
        load_token_files(path)


def test_ids_at_the_top_of_the_vocabulary_are_fine(tmp_path):
    path = write_bins(tmp_path, ids(3000, 256), ids(500, 256), BYTE_META)
    train_ids, val_ids, vocab = load_token_files(path)
    assert vocab == 256 and int(train_ids.max()) == 255 and len(val_ids) == 500


def test_the_scan_reads_whole_files_in_chunks_and_samples_huge_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "SCAN_CHUNK", 100)
    arr = ids(3000)
    arr[1234] = 999  # in chunk 12 of 30
    path = write_bins(tmp_path, arr, ids(500), BYTE_META)
    with pytest.raises(ConfigError, match="train.bin holds token id 999"):
        load_token_files(path)  # 6000 bytes, under SCAN_BYTES: every chunk is read
    monkeypatch.setattr(token_files, "SCAN_BYTES", 5 * 100 * 2)  # room for 5 of the 30 chunks
    assert load_token_files(path)[2] == 256  # chunks 0, 7, 14, 22, 29: chunk 12 is not read
    arr[2999] = 999  # the last chunk is always read
    write_bins(tmp_path, arr, ids(500), BYTE_META)
    with pytest.raises(ConfigError, match="train.bin holds token id 999"):
        load_token_files(path)


def test_cli_prints_a_bad_token_file_as_one_line(tmp_path):
    path = write_bins(tmp_path, ids(3000), ids(500), BYTE_META)
    path.write_bytes(path.read_bytes()[:-1])
    r = cli("model=gpt_test", "data=tokens", f"data.path={path}", "model.vocab_size=256", "steps=1",
            f"hydra.run.dir={tmp_path / 'run'}", timeout=180)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: {path} is 5999 bytes, not a whole number of uint16 tokens (2 bytes each, "
                                f"the dtype {tmp_path / 'meta.json'} gives): it is truncated or holds another "
                                "dtype; run scripts/prepare_tokens.py again")


# --- RandAugment strings -----------------------------------------------------------------


@pytest.mark.parametrize("spec,why", [
    ("bogus-m9", " (Unknown AutoAugment config section)"),
    ("rand-mx9", " (Unknown RandAugment config section)"),
    ("rand-m9x", " (invalid literal for int() with base 10: '9x')"),
    ("random-m9", ""),
    ("none", " (Unknown AA policy none)"),
])
def test_a_string_timm_refuses_is_one_line(spec, why):
    from stabletrain.data.vision import check_randaug

    with pytest.raises(ConfigError) as e:
        check_randaug(spec)
    assert str(e.value) == (f"data.randaug={spec} is not a timm RandAugment string{why}; use e.g. "
                            "rand-m9-mstd0.5-inc1 (or augmix-m5-w4-d2, original-mstd0.5, or null for none)")


@pytest.mark.parametrize("spec", [None, "", "rand-m9-mstd0.5-inc1", "rand-m9-n2-p0.5-mmax10", "rand",
                                  "augmix-m5-w4-d2", "original-mstd0.5", "v0", "3a"])
def test_every_string_timm_takes_passes(spec):
    from stabletrain.data.vision import check_randaug

    check_randaug(spec)


def test_building_the_transforms_checks_the_string():
    from stabletrain.data.vision import image_transforms

    with pytest.raises(ConfigError, match="data.randaug=bogus-m9 is not a timm RandAugment string"):
        image_transforms(make_cfg("model=vit_test", "data.randaug=bogus-m9").data, 16)


# --- image folders -----------------------------------------------------------------------


def image_folder(root, classes=("ant", "bee"), per_class=(4, 2)):
    """root/train/<class>/ and root/val/<class>/ with small random JPEGs; returns root."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val"), per_class):
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / split / c / f"{i}.jpg")
    return root


def folder_cfg(root, *extra):
    return make_cfg("model=vit_test", "data=imagefolder", f"data.root={root}", "data.num_workers=0", *extra)


def test_a_missing_split_folder_is_one_line(tmp_path):
    from stabletrain.data.vision import check_imagefolder

    shutil.rmtree(image_folder(tmp_path) / "val")
    with pytest.raises(ConfigError, match=f"data.root={tmp_path} has no val/ folder: expected root/train/<class>/"):
        check_imagefolder(str(tmp_path))
    with pytest.raises(ConfigError, match="has no val/ folder"):
        data_from_config(folder_cfg(tmp_path))


def test_a_split_without_class_folders_is_one_line(tmp_path):
    from stabletrain.data.vision import check_imagefolder

    shutil.rmtree(image_folder(tmp_path) / "val")
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "README").write_text("images go in class folders")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'val'}/ has no class folders"):
        check_imagefolder(str(tmp_path))


def test_a_class_folder_without_images_names_the_folder(tmp_path):
    image_folder(tmp_path)
    for split in ("train", "val"):
        (tmp_path / split / ".ipynb_checkpoints").mkdir()  # ImageFolder would take it for a class
        (tmp_path / split / ".ipynb_checkpoints" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'train' / '.ipynb_checkpoints'}/ holds no image files "
                                          r"\(.jpg .jpeg .png .*\): every folder in train/ is a class"):
        data_from_config(folder_cfg(tmp_path))


def test_images_in_subfolders_of_a_class_count(tmp_path):
    from stabletrain.data.vision import check_imagefolder

    image_folder(tmp_path)
    nested = tmp_path / "val" / "bee" / "more"
    nested.mkdir()
    for f in (tmp_path / "val" / "bee").glob("*.jpg"):
        f.rename(nested / f.name)
    check_imagefolder(str(tmp_path))  # ImageFolder walks class folders recursively, and so does the check


def test_a_val_class_train_lacks_is_refused(tmp_path):
    image_folder(tmp_path, classes=("ant", "bee", "cat"))
    (tmp_path / "val" / "cat").rename(tmp_path / "val" / "dog")
    with pytest.raises(ConfigError, match=rf"data.root={tmp_path}: val/ has class folders train/ lacks \(dog\), "
                                          r"which the model cannot learn: add them to train/ or remove them from val/"):
        data_from_config(folder_cfg(tmp_path))


def test_val_lacking_a_class_is_labelled_by_trains_class_names(tmp_path):
    """ImageFolder numbers each split's own folders: without ant, val's bee would get ant's label 0.
    Refused before; a small split may well lack a class, or hold an empty folder of one."""
    image_folder(tmp_path, classes=("ant", "bee", "cat"))
    shutil.rmtree(tmp_path / "val" / "ant")
    for f in (tmp_path / "val" / "cat").iterdir():  # an empty folder of a class
        f.unlink()
    d = data_from_config(folder_cfg(tmp_path))
    assert d.num_classes == 3 and d.n_val == 2
    assert [(Path(p).parent.name, y) for p, y in d.val_set.samples] == [("bee", 1), ("bee", 1)]
    assert d.source.startswith(f"imagefolder at {tmp_path} (val/ has images of 1 of the 3 classes)")
    _, y = next(d.val_batches(2, 1))
    assert y.tolist() == [1, 1]
    shutil.rmtree(tmp_path / "val" / "bee")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'val'}/ holds no image files .* in its class folders"):
        data_from_config(folder_cfg(tmp_path))


def test_a_long_class_difference_stays_short():
    from stabletrain.data.vision import _some

    assert _some([f"n{i:03d}" for i in range(900)]) == "n000, n001, n002, n003, n004 and 895 more"


# --- unreadable images -------------------------------------------------------------------


def spoil(root) -> list:
    """A truncated JPEG, an empty file and a file that is no image at all, in train/."""
    bad = [root / "train" / "ant" / "1.jpg", root / "train" / "bee" / "0.jpg", root / "train" / "bee" / "3.jpg"]
    bad[0].write_bytes(bad[0].read_bytes()[:300])
    bad[1].write_bytes(b"")
    bad[2].write_bytes(b"<html>not found</html>")
    return bad


def test_unreadable_images_are_replaced_with_one_warning_each(tmp_path, capsys):
    bad = spoil(image_folder(tmp_path))
    d = data_from_config(folder_cfg(tmp_path))
    stream = d.train_iter(0, Shard(8))
    for _ in range(3):  # three epochs of all 8 images
        (x, y), = next(stream)
        assert x.shape == (8, 3, 16, 16) and y.shape == (8,)
    x, y = next(d.val_batches(4, 1))
    assert x.shape == (4, 3, 16, 16)
    warnings = capsys.readouterr().err.strip().splitlines()
    unknown = "PIL cannot identify it as an image"
    assert sorted(warnings) == sorted(f"warning: cannot read image {f} ({why}); the next readable file in the folder "
                                      "takes its place, with its own class"
                                      for f, why in zip(bad, ("OSError: Truncated File Read", unknown, unknown)))
    assert d.bad_samples() == 3


def test_a_replacement_is_the_next_readable_image_and_leaves_other_draws_alone(tmp_path):
    from stabletrain.data.vision import _ReadableImages

    image_folder(tmp_path)
    cfg = folder_cfg(tmp_path, "data.randaug=rand-m9-mstd0.5-inc1", "data.erasing=0.25")
    clean = data_from_config(cfg)
    (x0, y0), = next(clean.train_iter(0, Shard(8)))
    bad = spoil(tmp_path)
    spoiled = data_from_config(cfg)
    assert isinstance(spoiled.train_set, _ReadableImages)
    (x1, y1), = next(spoiled.train_iter(0, Shard(8)))
    paths = [p for p, _ in spoiled.train_set.samples]
    is_bad = [p in map(str, bad) for p in paths]
    for slot, i in enumerate(epoch_indices(8, cfg.seed, 0, 8).tolist()):
        if not is_bad[i]:
            assert torch.equal(x0[slot], x1[slot]) and y0[slot] == y1[slot]  # the same image, the same draws
        else:  # the next readable file in folder order: ant/1 -> ant/2, bee/0 -> bee/1, bee/3 -> ant/0 (wraps)
            nxt = next(j % 8 for j in range(i + 1, i + 8) if not is_bad[j % 8])
            assert y1[slot] == spoiled.train_set.samples[nxt][1]
    (x2, _), = next(data_from_config(cfg).train_iter(0, Shard(8)))
    assert torch.equal(x1, x2)  # and the replacement is the same on every run


def test_a_folder_of_unreadable_images_is_one_line(tmp_path):
    image_folder(tmp_path)
    for f in (tmp_path / "val").rglob("*.jpg"):
        f.write_bytes(b"")
    d = data_from_config(folder_cfg(tmp_path))
    with pytest.raises(ConfigError, match=rf"none of the 4 image files in {tmp_path / 'val'}/ can be read"):
        next(d.val_batches(4, 1))


def test_a_run_over_unreadable_images_completes(tmp_path):
    spoil(image_folder(tmp_path / "data"))
    s = train(tmp_path / "run", "model=vit_test", "data=imagefolder", f"data.root={tmp_path / 'data'}",
              "data.num_workers=0", "steps=3", "batch_size=4", "eval_every=3", "eval_batches=1")
    assert s["status"] == "completed"


def test_workers_warn_too_once_a_file_in_the_run(tmp_path, capfd):
    """Each worker kept its own list of bad files: a bad file was warned about by every worker
    that met it, again in every epoch's other worker."""
    bad = spoil(image_folder(tmp_path))
    d = data_from_config(make_cfg("model=vit_test", "data=imagefolder", f"data.root={tmp_path}", "data.num_workers=2"))
    stream = d.train_iter(0, Shard(4))
    for _ in range(6):  # three epochs of 8 images in batches of 4, from two workers
        (x, _), = next(stream)
        assert x.shape == (4, 3, 16, 16)
    err = capfd.readouterr().err
    assert all(err.count(f"warning: cannot read image {f} ") == 1 for f in bad), err
    assert d.bad_samples() == len(bad)  # counted in the workers, seen here (shared memory)


def test_a_run_logs_how_many_images_it_replaced(tmp_path):
    import json

    bad = spoil(image_folder(tmp_path / "images"))
    s = train(tmp_path / "run", "model=vit_test", "data=imagefolder", f"data.root={tmp_path / 'images'}",
              "data.num_workers=1", "steps=2", "batch_size=8", "logger.log_every=1", "eval_every=1000")
    assert s["status"] == "completed"
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("data/bad_samples", 0) for r in recs) == len(bad)


# --- loader workers ----------------------------------------------------------------------


def test_loader_workers_are_capped_at_the_cpus_this_process_has(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    image_folder(tmp_path)
    # the config asks for 8 workers
    d = data_from_config(make_cfg("model=vit_test", "data=imagefolder", f"data.root={tmp_path}"))
    assert d.workers == 2
    # said on the data line: a 2-core machine running data=imagefolder's 8 workers was not told
    assert d.loader_words() == ", 2 loader workers (data.num_workers=8, capped at the 2 CPUs this process may use)"
    d = data_from_config(make_cfg("model=vit_test", "data=imagefolder", f"data.root={tmp_path}", "data.num_workers=1"))
    assert d.loader_words() == ", 1 loader worker"
    d = data_from_config(folder_cfg(tmp_path))
    assert d.workers == 0 and d.loader_words() == ""


def test_the_data_line_names_the_folder_and_the_size_images_are_trained_at(tmp_path):
    image_folder(tmp_path)
    d = data_from_config(folder_cfg(tmp_path))
    assert d.source == (f"imagefolder at {tmp_path}, images resized to 16 px (model.img_size; data.img_size sets "
                        f"another)")
    d = data_from_config(folder_cfg(tmp_path, "data.img_size=32"))
    assert d.source == f"imagefolder at {tmp_path}, images resized to 32 px"
