"""What docs/data.md promises of preparing and loading data (token files, the prepare script,
image folders), each test failing if its promise breaks.

Every expected value is worked out by hand from the inputs here; nothing touches the network.
"""

import json

import numpy as np
import pytest
import torch

from stabletrain.build import data_from_config
from stabletrain.config import ConfigError
from stabletrain.data import Shard
from stabletrain.data.token_files import load_token_files, prepare_from_sources, prepare_tokens
from tests.helpers import make_cfg


def read_bins(out):
    meta = json.loads((out / "meta.json").read_text())
    return [np.fromfile(out / f, dtype=meta["dtype"]) for f in ("train.bin", "val.bin")] + [meta]


def as_bytes(arr) -> bytes:
    return bytes(arr.astype(np.uint8))


# --- prepare_tokens: the validation split and meta.json ------------------------------------


def test_a_given_val_split_is_val_bin_as_it_is(tmp_path):
    """With val_docs (--val-split) val.bin is that split: the tenth-of-a-small-text top-up applies only
    without one, and a split of at least block_size + 2 tokens takes nothing from train; meta.json
    then records no val_fraction."""
    m = prepare_tokens(tmp_path, [b"t" * 999], val_docs=[b"v" * 19], block_size=8, val_fraction=0.3)
    tr, va, meta = read_bins(tmp_path)
    assert as_bytes(tr) == b"t" * 999 + b"\xff"  # 1000 tokens; a tenth of the text would be 102 > 20
    assert as_bytes(va) == b"v" * 19 + b"\xff"
    assert meta == m and m["val_tail_tokens"] == 0 and m["val_documents"] == 1 and m["val_fraction"] is None


def test_with_end_of_text_val_is_the_drawn_documents_only(tmp_path):
    """Each document goes to val.bin with probability val_fraction; the only top-up is to a tenth of
    the text or 100 windows, whichever is less (here 100 windows of 2 tokens: 200), never to
    val_fraction of the stream (that is the --no-eot rule)."""
    docs = [b"%09d\n" % i for i in range(1000)]  # 10 bytes + the end-of-text byte: 11 tokens each
    m = prepare_tokens(tmp_path, docs, val_fraction=0.5, block_size=2, seed=0)
    tr, va, _ = read_bins(tmp_path)
    assert m["val_documents"] < 500  # seed 0 draws 473: fewer than half the stream, no top-up for that
    assert m["val_tail_tokens"] == 0 and len(va) == 11 * m["val_documents"] and len(tr) == 11 * m["train_documents"]
    assert as_bytes(va).split(b"\xff")[:-1] == [d for d in docs if d in as_bytes(va).split(b"\xff")]


def test_meta_records_the_seed_and_block_size(tmp_path):
    """meta.json lists the seed of the validation draw and the block_size the files were written for."""
    m = prepare_tokens(tmp_path, [b"x" * 100] * 20, val_fraction=0.2, block_size=8, seed=7)
    assert m["seed"] == 7 and m["block_size"] == 8
    assert json.loads((tmp_path / "meta.json").read_text())["seed"] == 7


def test_str_documents_are_encoded_as_utf8_bytes(tmp_path):
    """Byte tokens are a document's UTF-8 bytes: Hugging Face rows arrive as str."""
    prepare_tokens(tmp_path, ["é✓", "ab"], val_fraction=0.0, block_size=1)
    tr, va, _ = read_bins(tmp_path)
    assert np.concatenate([tr, va]).tolist() == [0xC3, 0xA9, 0xE2, 0x9C, 0x93, 0xFF, 0x61, 0x62, 0xFF]


def test_an_unknown_tokenizer_is_refused(tmp_path):
    """Only byte and gpt2 exist: another name is an error, not a silent byte-level run."""
    with pytest.raises(ConfigError, match="tokenizer 'gpt-2' is unknown; choose byte or gpt2"):
        prepare_tokens(tmp_path, ["text " * 50], tokenizer="gpt-2", block_size=4)
    assert not (tmp_path / "meta.json").exists()


# --- --files: hidden folders and sorted order ---------------------------------------------


def test_files_in_hidden_folders_are_skipped_and_folders_read_in_sorted_order(tmp_path):
    """Folders are read recursively in sorted path order; hidden files and hidden folders are skipped."""
    (tmp_path / "in" / "a").mkdir(parents=True)
    (tmp_path / "in" / ".git").mkdir()
    (tmp_path / "in" / "b.txt").write_text("B" * 9)  # written first, sorted after a/c.txt
    (tmp_path / "in" / "a" / "c.txt").write_text("C" * 9)
    (tmp_path / "in" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "in" / "a" / ".notes").write_text("hidden")
    prepare_from_sources(tmp_path / "out", files=[str(tmp_path / "in")], val_fraction=0.0, block_size=1)
    tr, va, _ = read_bins(tmp_path / "out")
    assert as_bytes(np.concatenate([tr, va])) == b"C" * 9 + b"\xff" + b"B" * 9 + b"\xff"


# --- reading token files ------------------------------------------------------------------


def write_bins(folder, train_ids, val_ids, meta):
    np.asarray(train_ids, dtype=meta.get("dtype", "uint16")).tofile(folder / "train.bin")
    if val_ids is not None:
        np.asarray(val_ids, dtype=meta.get("dtype", "uint16")).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "train.bin"


def test_a_missing_val_bin_is_one_line(tmp_path):
    """data=tokens expects val.bin beside data.path: its absence is a ConfigError naming it."""
    path = write_bins(tmp_path, np.arange(3000) % 256, None, {"vocab_size": 256, "dtype": "uint16"})
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'val.bin'} is missing: data=tokens expects val.bin"):
        load_token_files(path)


def test_a_vocab_size_of_zero_is_refused(tmp_path):
    """vocab_size must be a positive integer."""
    path = write_bins(tmp_path, [0] * 3000, [0] * 500, {"vocab_size": 0, "dtype": "uint16"})
    with pytest.raises(ConfigError, match="vocab_size=0 must be a positive integer"):
        load_token_files(path)


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_id_equal_to_the_vocabulary_is_refused(tmp_path, split):
    """Ids run 0 .. vocab_size - 1: an id of vocab_size would index past the embedding."""
    ids = {"train": np.arange(3000) % 256, "val": np.arange(500) % 256}
    ids[split][7] = 256
    path = write_bins(tmp_path, ids["train"], ids["val"], {"vocab_size": 256, "dtype": "uint16"})
    with pytest.raises(ConfigError, match=rf"{split}.bin holds token id 256 >= vocab_size 256"):
        load_token_files(path)


def test_uint8_bins_of_byte_tokens_are_read_though_they_look_like_text(tmp_path):
    """dtype uint8 is a supported token dtype; only a file not named .bin is checked for being text."""
    text = b"plain ascii text, one byte a token. " * 100
    path = write_bins(tmp_path, np.frombuffer(text, np.uint8), np.frombuffer(text[:600], np.uint8),
                      {"vocab_size": 256, "dtype": "uint8"})
    train_ids, val_ids, vocab = load_token_files(path)
    assert vocab == 256 and as_bytes(train_ids) == text and len(val_ids) == 600


def test_a_data_set_dict_without_the_val_split_names_its_splits(tmp_path):
    """--hf-disk with a DatasetDict lacking --val-split: one line listing the splits it has."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["some text " * 20]})}).save_to_disk(
        str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"has splits \['train'\], not 'validation': pass --split/--val-split"):
        prepare_from_sources(tmp_path / "out", hf_disk=str(tmp_path / "hf"), val_split="validation", block_size=8)


# --- scripts/prepare_tokens.py ------------------------------------------------------------


def test_the_script_passes_the_seed_and_its_block_size_defaults_to_1024(tmp_path):
    """--seed reaches the draw and meta.json; without --block-size val.bin gets 1024 + 2 tokens."""
    from scripts.prepare_tokens import main

    text = tmp_path / "one.txt"
    text.write_text("y" * 2999)  # 3000 tokens with the end-of-text byte; a tenth (300) is less than 1026
    assert main(["--out", str(tmp_path / "out"), "--files", str(text), "--seed", "7", "--quiet"]) == 0
    tr, va, meta = read_bins(tmp_path / "out")
    assert meta["seed"] == 7 and meta["block_size"] == 1024
    assert len(va) == 1026 and len(tr) == 3000 - 1026


def test_the_script_refuses_an_out_that_is_a_file(tmp_path, capsys):
    """--out names a folder: a file there is one error line and exit status 2, the file untouched."""
    from scripts.prepare_tokens import main

    (tmp_path / "in.txt").write_text("text " * 100)
    (tmp_path / "out").write_text("keep me")
    assert main(["--out", str(tmp_path / "out"), "--files", str(tmp_path / "in.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {tmp_path / 'out'} is a file; give a folder for train.bin, val.bin and meta.json\n"
    assert (tmp_path / "out").read_text() == "keep me"


def test_the_scripts_val_split_becomes_val_bin(tmp_path):
    """--val-split SPLIT: val.bin is that split of the --hf-disk data set, train.bin the --split one."""
    import datasets

    from scripts.prepare_tokens import main

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a" * 99]}),
                          "validation": datasets.Dataset.from_dict({"text": ["b" * 19]})}).save_to_disk(
        str(tmp_path / "hf"))
    assert main(["--out", str(tmp_path / "out"), "--hf-disk", str(tmp_path / "hf"), "--val-split", "validation",
                 "--block-size", "8", "--quiet"]) == 0
    tr, va, meta = read_bins(tmp_path / "out")
    assert as_bytes(tr) == b"a" * 99 + b"\xff" and as_bytes(va) == b"b" * 19 + b"\xff"
    assert meta["sources"][0]["val_split"] == "validation" and meta["val_documents"] == 1


# --- Data: steps per epoch, token windows -------------------------------------------------


def test_steps_per_epoch_is_whole_batches_of_samples_or_of_windows():
    """An epoch is n_train // batch_size steps (CIFAR: 50000 // 128 = 390), of batch_size x seq_len
    tokens for text, and at least one step."""
    from stabletrain.data import Data

    assert Data("vision", 50_000).steps_per_epoch(128) == 390
    assert Data("text", 1000, seq_len=10).steps_per_epoch(4) == 25  # 1000 tokens / (4 x 10)
    assert Data("text", 1039, seq_len=10).steps_per_epoch(4) == 25
    assert Data("vision", 10).steps_per_epoch(64) == 1


def test_a_val_bin_of_exactly_one_window_is_too_few(tmp_path):
    """A window is block_size inputs and the next token: block_size + 1 tokens leave no window to
    draw (randint(0, 0)), so they are refused in one line; block_size + 2 are enough."""
    meta = {"vocab_size": 256, "dtype": "uint16"}
    cfg = make_cfg("model=gpt_test", "data=tokens", f"data.path={tmp_path / 'train.bin'}", "model.block_size=16")
    write_bins(tmp_path, np.arange(3000) % 256, np.arange(17) % 256, meta)
    with pytest.raises(ConfigError, match=r"val.bin: 17 tokens, too few for a window of model.block_size=16"):
        data_from_config(cfg)
    write_bins(tmp_path, np.arange(3000) % 256, np.arange(18) % 256, meta)
    x, y = next(data_from_config(cfg).val_batches(2, 1))
    assert x.tolist() == [list(range(16))] * 2 and y.tolist() == [list(range(1, 17))] * 2


# --- image folders ------------------------------------------------------------------------

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
COLOUR = (200, 100, 50)


def uniform_folder(root, n=(4, 2), mode="RGB"):
    """root/{train,val}/{ant,bee}/ holding n PNGs of one colour each."""
    from PIL import Image

    for split, k in zip(("train", "val"), n):
        for c in ("ant", "bee"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(k):
                Image.new(mode, (20, 20), COLOUR if mode == "RGB" else 120).save(root / split / c / f"{i}.png")
    return root


def folder_cfg(root, *extra):
    return make_cfg("model=vit_test", "data=imagefolder", f"data.root={root}", "data.num_workers=0",
                    "data.randaug=null", *extra)


def test_imagefolder_val_is_unaugmented_and_imagenet_normalised(tmp_path):
    """Evaluation resizes and centre-crops (no flip, jitter or erasing) and normalises with timm's
    ImageNet mean/std: a one-colour image is that colour, normalised, at every pixel."""
    d = data_from_config(folder_cfg(uniform_folder(tmp_path), "data.erasing=0.5"))
    x, y = next(d.val_batches(4, 1))
    expect = [(c / 255 - m) / s for c, m, s in zip(COLOUR, IMAGENET_MEAN, IMAGENET_STD)]
    assert x.shape == (4, 3, 16, 16) and y.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(x, torch.tensor(expect).view(1, 3, 1, 1).expand(4, 3, 16, 16), atol=2e-3, rtol=0)


def test_data_img_size_sets_the_size_of_train_and_val_images(tmp_path):
    """data.img_size overrides the model's img_size (16 for vit_test) in both splits' transforms."""
    d = data_from_config(folder_cfg(uniform_folder(tmp_path), "data.img_size=24"))
    (xt, _), = next(d.train_iter(0, Shard(4)))
    xv, _ = next(d.val_batches(4, 1))
    assert xt.shape == (4, 3, 24, 24) and xv.shape == (4, 3, 24, 24)


def test_data_erasing_erases_a_patch_of_training_images(tmp_path):
    """data.erasing is random erasing's probability: at 1.0 every training image of one colour gets a
    patch of another value; at 0 each stays one colour (crop, flip and colour jitter keep it uniform)."""
    uniform_folder(tmp_path)

    def spread(erasing):  # per image, the largest range of values within a channel
        (x, _), = next(data_from_config(folder_cfg(tmp_path, f"data.erasing={erasing}")).train_iter(0, Shard(8)))
        return (x.amax(dim=(2, 3)) - x.amin(dim=(2, 3))).amax(dim=1)

    assert (spread(0.0) < 1e-2).all()
    assert (spread(1.0) > 0.1).all()


def test_an_unreadable_val_image_is_replaced_and_counted(tmp_path, capsys):
    """bad_samples counts the files replaced in both splits: an empty val file is replaced by the
    next readable one in folder order and counted once."""
    uniform_folder(tmp_path)
    (tmp_path / "val" / "ant" / "1.png").write_bytes(b"")
    d = data_from_config(folder_cfg(tmp_path))
    x, y = next(d.val_batches(4, 1))
    assert x.shape == (4, 3, 16, 16) and y.tolist() == [0, 1, 1, 1]  # ant/1 -> bee/0
    assert d.bad_samples() == 1
    assert f"cannot read image {tmp_path / 'val' / 'ant' / '1.png'}" in capsys.readouterr().err


def test_grayscale_images_are_read_as_rgb(tmp_path):
    """ImageNet holds some grayscale JPEGs: every image is read as RGB, so batches keep 3 channels."""
    uniform_folder(tmp_path)
    uniform_folder(tmp_path / "gray", mode="L")
    for f in (tmp_path / "gray" / "train" / "ant").iterdir():
        f.rename(tmp_path / "train" / "ant" / f"gray_{f.name}")
    d = data_from_config(folder_cfg(tmp_path))
    (x, _), = next(d.train_iter(0, Shard(12)))
    assert x.shape == (12, 3, 16, 16)


def test_a_missing_data_path_is_refused_before_the_run_folder_is_made(tmp_path):
    """A data.path that does not exist is one line from the pre-flight check: no run folder is left."""
    from tests.helpers import cli

    r = cli("model=gpt_test", "data=tokens", f"data.path={tmp_path / 'nope' / 'train.bin'}",
            f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (f"error: data.path={tmp_path / 'nope' / 'train.bin'} does not "
                                                      "exist: point data=tokens at a train.bin "
                                                      "(scripts/prepare_tokens.py writes one)")
    assert not (tmp_path / "run").exists()
