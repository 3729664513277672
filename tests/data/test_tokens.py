"""Token files: text -> train.bin + val.bin + meta.json (scripts/prepare_tokens.py), read by data=tokens.

Nothing here touches the network: Hugging Face data sets are built in memory and saved to
disk, the offline failure of a hub name is simulated, and gpt2 uses a stand-in encoding.
"""

import json
import math

import numpy as np
import pytest
import torch

from stabletrain.config import ConfigError
from stabletrain.build import data_from_config
from stabletrain.data import Shard
from stabletrain.data.token_files import prepare_from_sources, prepare_tokens, token_dtype
from tests.helpers import make_cfg, train

DOCS = {"a.txt": "Hello, wörld!\nline two\n", "sub/b.txt": "ünïcode ✓ and more text " * 3,
        "sub/c.txt": "the third document."}


def write_docs(root) -> list[bytes]:
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden").write_text("never read")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "a.pyc").write_bytes(b"\x00\xff\xfe binary")  # not UTF-8: skipped
    return [DOCS[k].encode("utf-8") for k in sorted(DOCS)]  # a folder's files, in sorted order


def bins(out):
    meta = json.loads((out / "meta.json").read_text())
    return [np.fromfile(out / f, dtype=meta["dtype"]) for f in ("train.bin", "val.bin")] + [meta]


def test_byte_tokens_are_the_exact_bytes_with_separators(tmp_path):
    docs = write_docs(tmp_path)
    meta = prepare_from_sources(tmp_path / "out", files=[str(tmp_path)], tokenizer="byte", val_fraction=0.0,
                                block_size=8)
    tr, va, m = bins(tmp_path / "out")
    stream = b"".join(d + b"\xff" for d in docs)
    assert bytes(np.concatenate([tr, va]).astype(np.uint8)) == stream
    tenth = math.ceil(len(stream) / 10)  # no document drawn: a tenth of a small text, from its end
    assert tr.dtype == np.uint16 and len(va) == tenth > 10
    assert m == meta and m["tokenizer"] == "byte" and m["vocab_size"] == 256 and m["dtype"] == "uint16"
    assert m["eot"] == 255 and m["train_tokens"] == len(tr) and m["val_tokens"] == len(va)
    assert m["train_documents"] == 3 and m["val_tail_tokens"] == tenth and m["sources"] == [str(tmp_path.resolve())]
    assert m["skipped_files"] == [str(tmp_path / "__pycache__" / "a.pyc")]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_val_is_whole_documents_drawn_at_random(tmp_path):
    docs = [f"document {i}\n".encode() for i in range(400)]

    def split(seed):
        m = prepare_tokens(tmp_path / str(seed), docs, val_fraction=0.1, block_size=8, seed=seed)
        tr, va, _ = bins(tmp_path / str(seed))
        return m, [bytes(a.astype(np.uint8)).split(b"\xff")[:-1] for a in (tr, va)]  # documents, each whole

    m, (train_docs, val_docs) = split(0)
    assert sorted(train_docs + val_docs) == sorted(docs) and 20 < len(val_docs) < 60
    assert train_docs == [d for d in docs if d in train_docs]  # order kept
    assert m["val_documents"] == len(val_docs) and m["val_tail_tokens"] == 0
    assert split(0)[1] == [train_docs, val_docs] and split(1)[1][1] != val_docs  # seeded


def test_val_gets_a_tenth_of_a_small_text_and_at_least_one_window(tmp_path):
    prepare_tokens(tmp_path, [b"x" * 199], val_fraction=0.0005, block_size=16)
    tr, va, _ = bins(tmp_path)
    assert len(va) == 20 and len(tr) == 200 - 20  # a tenth, not 0.0005 of it
    prepare_tokens(tmp_path / "short", [b"x" * 99], val_fraction=0.0005, block_size=16)
    tr, va, _ = bins(tmp_path / "short")
    assert len(va) == 18 and len(tr) == 100 - 18  # block_size + 2: data=tokens needs len > block_size + 1
    prepare_tokens(tmp_path / "long", [b"x" * 99_999], val_fraction=0.0005, block_size=16)
    tr, va, _ = bins(tmp_path / "long")
    assert len(va) == 100 * 16  # a hundred windows are enough
    with pytest.raises(ConfigError, match="train would hold 12 tokens, fewer than 18"):
        prepare_tokens(tmp_path / "small", [b"x" * 29], block_size=16)


def test_no_eot_concatenates_documents_and_val_is_the_tail(tmp_path):
    prepare_tokens(tmp_path, ["line one\n", "", "line two\n" * 3], eot=False, val_fraction=0.5, block_size=4)
    tr, va, m = bins(tmp_path)
    assert bytes(np.concatenate([tr, va]).astype(np.uint8)) == b"line one\n" + b"line two\n" * 3
    assert len(va) == 18 and m["eot"] is None


def test_dtype_follows_the_vocabulary():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(100_277) == np.uint32


def test_gpt2_documents_end_with_token_50256(tmp_path, monkeypatch):
    import tiktoken

    class Stand_in:  # what tiktoken's gpt2 Encoding offers, with one id per character
        eot_token = 50256

        def encode_ordinary_batch(self, texts):
            return [[ord(c) for c in t] for t in texts]

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: Stand_in())
    prepare_tokens(tmp_path, ["ab", b"c\xc3\xa9"], tokenizer="gpt2", block_size=1, val_fraction=0.0)
    tr, va, m = bins(tmp_path)
    assert np.concatenate([tr, va]).tolist() == [97, 98, 50256, 99, 233, 50256]
    assert m["tokenizer"] == "gpt2" and m["vocab_size"] == 50257 and m["dtype"] == "uint16"


def test_gpt2_offline_is_a_clear_error(tmp_path, monkeypatch):
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: (_ for _ in ()).throw(ConnectionError("offline")))
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    with pytest.raises(ConfigError, match="set TIKTOKEN_CACHE_DIR to a folder holding them, or use --tokenizer byte"):
        prepare_tokens(tmp_path, ["text"], tokenizer="gpt2")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))  # given, but without the files
    with pytest.raises(ConfigError, match=f"TIKTOKEN_CACHE_DIR={tmp_path / 'empty'} does not hold them"):
        prepare_tokens(tmp_path, ["text"], tokenizer="gpt2")


def test_hf_dataset_from_disk_with_its_own_validation_split(tmp_path):
    import datasets

    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": ["first doc", "second doc " * 5], "id": [1, 2]}),
        "validation": datasets.Dataset.from_dict({"body": ["held-out text " * 3], "id": [3]}),
    }).save_to_disk(str(tmp_path / "hf"))
    m = prepare_from_sources(tmp_path / "out", hf_disk=str(tmp_path / "hf"), text_field="body",
                             val_split="validation", block_size=8)
    tr, va, _ = bins(tmp_path / "out")
    assert bytes(tr.astype(np.uint8)) == b"first doc\xff" + b"second doc " * 5 + b"\xff"
    assert bytes(va.astype(np.uint8)) == b"held-out text " * 3 + b"\xff"
    assert m["val_documents"] == 1 and m["sources"][0]["val_split"] == "validation"
    with pytest.raises(ConfigError, match="--text-field 'text' is not a column.*'body'"):
        prepare_from_sources(tmp_path / "x", hf_disk=str(tmp_path / "hf"))


def test_hf_name_offline_says_network_or_local_copy(tmp_path, monkeypatch, capsys):
    import datasets

    from scripts.prepare_tokens import main

    calls = []

    def offline(*args, **kw):  # what datasets raises for an uncached name without network
        calls.append(args)
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    rc = main(["--out", str(tmp_path), "--hf", "wikitext", "--hf-config", "wikitext-2-raw-v1", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and calls == [("wikitext", "wikitext-2-raw-v1")]
    assert err.count("\n") == 1 and err.startswith("error: cannot load the Hugging Face data set 'wikitext ")
    assert "ConnectionError" in err and "needs network" in err and "--hf-disk" in err
    assert not any(tmp_path.iterdir())


def test_the_script_names_skipped_files_and_its_progress_ends_at_what_it_read(tmp_path, capsys):
    from scripts.prepare_tokens import main

    write_docs(tmp_path)
    assert main(["--out", str(tmp_path / "out"), "--files", str(tmp_path), "--block-size", "8"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 file(s) that are not UTF-8 text, e.g. " + str(tmp_path / "__pycache__" / "a.pyc") in err
    # the bar's last state, then the note on validation and the skip line
    final = err.replace("\r", "\n").strip().splitlines()[-3]
    assert "100%" in final and "3/3" in final, final


@pytest.mark.parametrize("reachable", [True, False])
def test_an_unreachable_hub_switches_to_the_cache_at_once(monkeypatch, reachable):
    """Offline, datasets retries for half a minute before failing: one connection attempt decides."""
    import socket

    from stabletrain.data import token_files

    tried = []

    def connect(address, timeout):
        tried.append(address)
        if not reachable:
            raise OSError("Name or service not known")
        return socket.socket()

    monkeypatch.setattr(socket, "create_connection", connect)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                "all_proxy"):
        monkeypatch.setenv(var, "")  # recorded, so that what the call sets is undone after the test
        monkeypatch.delenv(var)
    note = token_files.offline_if_hub_unreachable()
    assert tried == [("huggingface.co", 443)]
    if reachable:
        assert note is None and "HF_HUB_OFFLINE" not in token_files.os.environ
    else:
        assert "huggingface.co cannot be reached" in note and token_files.os.environ["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the user's choice: nothing is tried
    assert token_files.offline_if_hub_unreachable() is None and len(tried) == 1
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # the way out is the proxy: nothing is tried
    assert token_files.offline_if_hub_unreachable() is None and len(tried) == 1


def test_interrupted_run_keeps_the_previous_files(tmp_path):
    prepare_tokens(tmp_path, ["old text " * 10], block_size=4)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def docs():
        yield "new text " * 10
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(tmp_path, docs(), block_size=4)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # and no .tmp files left


def test_data_tokens_reads_vocab_and_dtype_from_meta(tmp_path):
    ids = np.arange(70_000, 70_000 + 3000, dtype=np.uint32)  # ids that need uint32
    ids.tofile(tmp_path / "train.bin")
    ids[:500].tofile(tmp_path / "val.bin")
    meta = {"vocab_size": 80_000, "dtype": "uint32", "train_tokens": 3000, "val_tokens": 500}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    cfg = make_cfg("model=gpt_test", "data=tokens", f"data.path={tmp_path / 'train.bin'}", "model.vocab_size=80000")
    d = data_from_config(cfg)
    x, y = next(d.train_iter(0, Shard(4)))[0]
    assert d.vocab_size == 80_000 and x.min() >= 70_000 and torch.equal(x[:, 1:], y[:, :-1])

    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller than the data's vocabulary 80000: "
                                          "set model.vocab_size=80000"):
        data_from_config(make_cfg("model=gpt_test", "data=tokens", f"data.path={tmp_path / 'train.bin'}"))
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "train_tokens": 2999}))
    with pytest.raises(ConfigError, match="holds 3000 tokens but .*meta.json says 2999"):
        data_from_config(cfg)


def test_bins_without_meta_are_gpt2_uint16(tmp_path):
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    path = f"data.path={tmp_path / 'train.bin'}"
    cfg = make_cfg("model=gpt_test", "data=tokens", path, "model.vocab_size=50304")
    assert data_from_config(cfg).vocab_size == 50257
    # the refusal says the vocabulary was assumed: a byte-level set that lost its meta.json
    with pytest.raises(ConfigError, match=r"vocabulary 50257 \(.* has no meta.json: its tokens are taken as "
                                          r"nanoGPT's GPT-2 ids; .*\): set model.vocab_size=50304"):
        data_from_config(make_cfg("model=gpt_test", "data=tokens", path))


def test_prepared_text_trains(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("".join(f"Sentence number {i} of a small book.\n" for i in range(200)))
    from scripts.prepare_tokens import main

    assert main(["--out", str(tmp_path / "tok"), "--files", str(text), "--block-size", "32", "--quiet"]) == 0
    s = train(tmp_path / "run", "model=gpt_test", "data=tokens", f"data.path={tmp_path / 'tok' / 'train.bin'}",
              "steps=2", "batch_size=4", "eval_every=2", "eval_batches=1")
    assert s["status"] == "completed" and math.isfinite(s["final"]["val/loss"])


def test_inputs_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="exactly one input"):
        prepare_from_sources(tmp_path, files=["a.txt"], hf="wikitext")
    with pytest.raises(ConfigError, match="--files .*nope.txt: no such file"):
        prepare_from_sources(tmp_path, files=[str(tmp_path / "nope.txt")])
    with pytest.raises(ConfigError, match="--val-split applies to --hf"):
        prepare_from_sources(tmp_path, files=[str(tmp_path)], val_split="validation")


def test_a_val_bin_shorter_than_a_window_names_the_file_and_the_fix(tmp_path):
    """Files prepared for a shorter context: the error names val.bin and the --block-size that fits."""
    prepare_tokens(tmp_path, [b"x" * 3000], val_fraction=0.0, block_size=8)  # val.bin: a tenth, 301 tokens
    cfg = make_cfg("model=gpt_test", "data=tokens", f"data.path={tmp_path / 'train.bin'}", "model.block_size=512")
    with pytest.raises(ConfigError) as e:
        data_from_config(cfg)
    assert str(e.value) == (f"{tmp_path / 'val.bin'}: 301 tokens, too few for a window of model.block_size=512 "
                            f"(+1): lower model.block_size, or write the files again with scripts/prepare_tokens.py "
                            f"--block-size 512")
    with pytest.raises(ConfigError, match="the embedded text's validation part: .* raise data.val_fraction"):
        data_from_config(make_cfg("model=gpt_test", "model.block_size=5000000"))


@pytest.mark.parametrize("name,what", [("val.bin", "the validation file"), ("meta.json", "the meta file")])
def test_data_path_at_the_val_or_meta_file_names_train_bin(tmp_path, name, what):
    prepare_tokens(tmp_path, [b"x" * 3000], block_size=8)
    with pytest.raises(ConfigError) as e:
        data_from_config(make_cfg("model=gpt_test", "data=tokens", f"data.path={tmp_path / name}"))
    assert str(e.value) == (f"data.path={tmp_path / name} is {what}; point it at the training file beside it: "
                            f"data.path={tmp_path / 'train.bin'}")


def test_files_that_are_all_skipped_say_so(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.bin").write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(ConfigError, match=r"^no text to tokenize: all 1 file\(s\) were skipped as not UTF-8 text "
                                          r"\(e.g. .*a.bin\); give text files$"):
        prepare_from_sources(tmp_path / "out", files=[str(tmp_path / "in")], block_size=8)


@pytest.mark.parametrize("vocab,noted", [(50304, True), (256, False), (320, False)])
def test_a_vocabulary_far_larger_than_the_datas_is_said(vocab, noted):
    """A GPT-2 recipe on byte-level text keeps its 50304 rows, as the recipe says, but says that
    50048 of them are never used; nanoGPT's padding to a multiple of 64 is not remarked on."""
    from stabletrain.build import fit_model_to_data

    cfg = make_cfg("model=gpt_test", f"model.vocab_size={vocab}")
    notes = fit_model_to_data(cfg, data_from_config(cfg))
    assert bool(notes) == noted
    if noted:
        assert notes == ["model.vocab_size=50304 for data of 256 token ids: 50048 embedding rows are never used "
                         "(model.vocab_size=256 would drop them)"]


def test_the_script_says_when_no_document_was_drawn_for_validation(tmp_path, capsys):
    from scripts.prepare_tokens import main

    text = tmp_path / "one.txt"
    text.write_text("a single document " * 200)
    assert main(["--out", str(tmp_path / "out"), "--files", str(text), "--block-size", "8", "--quiet"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["val_documents"] == 0 and meta["val_tokens"] == 361  # a tenth, cut from train's end
    assert ("note: no document was drawn for validation (--val-fraction 0.0005 of 1 documents): val.bin is the "
            "last 361 tokens of the text, cut from the end of train") in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "zero"), "--files", str(text), "--block-size", "0", "--quiet"]) == 2
    assert capsys.readouterr().err == "error: --block-size 0 must be >= 1: the model's context (model.block_size)\n"
    assert not (tmp_path / "zero").exists()


def test_a_text_file_given_as_token_files_says_how_to_make_them(tmp_path):
    from stabletrain.data.token_files import load_token_files

    text = tmp_path / "mytext.txt"
    text.write_text("é" * 600 + " the rest of a book\n")  # the first kilobyte ends inside a character
    with pytest.raises(ConfigError, match=rf"^data.path={text} is text, and data=tokens reads token files: write "
                                          rf"them with python scripts/prepare_tokens.py --files {text} --out DIR"):
        load_token_files(text)
    prepare_tokens(tmp_path / "tok", [b"some text " * 300], block_size=64)
    binary = tmp_path / "tok" / "train.txt"  # token ids under another name are not taken for text
    (tmp_path / "tok" / "train.bin").rename(binary)
    train_ids, _, vocab = load_token_files(binary)
    assert vocab == 256 and bytes(train_ids[:10].astype(np.uint8)).startswith(b"some text")
