"""Data as step-indexed streams: batch ``s`` is a pure function of (seed, s).

Every training batch is drawn from ``seed`` and the optimizer step alone, so a resumed run
sees exactly the batches it would have seen, and the global batch is the same whatever the
world size: rank ``r`` takes its slice of it, split into micro-batches. Vision data walks a
seeded permutation per epoch; text draws random windows per step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from stabletrain.errors import ConfigError
from stabletrain.registry import Registry, option_value

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Shard:
    """This process's share of a global batch: ``rank`` of ``world``, in ``accum`` micro-batches."""

    batch_size: int
    rank: int = 0
    world: int = 1
    accum: int = 1

    @property
    def micro(self) -> int:
        return self.batch_size // (self.world * self.accum)

    def split(self, global_idx: torch.Tensor) -> list[torch.Tensor]:
        per_rank = self.batch_size // self.world
        mine = global_idx[self.rank * per_rank:(self.rank + 1) * per_rank]
        return list(mine.split(self.micro))


def epoch_indices(n: int, seed: int, start: int, count: int, repeats: int = 1) -> torch.Tensor:
    """Indices ``start .. start+count`` of the infinite stream of per-epoch permutations.

    ``repeats > 1`` is repeated augmentation (001 Table 13, ``data.repeated_aug``): an epoch of
    ``n`` draws holds ``ceil(n / repeats)`` distinct samples, each ``repeats`` times in a row,
    so each copy goes through the random transforms separately. Copies land in the same
    micro-batch (ViTs have no batch statistics that would care).
    """
    out, pos = [], start
    while pos < start + count:
        epoch, off = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        if repeats > 1:
            perm = perm[:-(-n // repeats)].repeat_interleave(repeats)[:n]
        take = min(n - off, start + count - pos)
        out.append(perm[off:off + take])
        pos += take
    return torch.cat(out)


@dataclass
class Data:
    kind: str  # vision | text
    n_train: int  # samples (vision) or tokens (text)
    num_classes: int = 0
    in_chans: int = 3
    vocab_size: int = 0
    seq_len: int = 0
    n_val: int = 0  # samples or tokens of the validation set
    source: str = ""  # what the start line names: the option and its files (build.data_from_config)
    extra: dict = field(default_factory=dict)

    def steps_per_epoch(self, batch_size: int) -> int:
        per = batch_size * (self.seq_len if self.kind == "text" else 1)
        return max(1, self.n_train // per)


class TensorImages(Data):
    """Images held in memory (the embedded digits)."""

    def __init__(self, t: dict[str, torch.Tensor], num_classes: int, seed: int, repeats: int = 1):
        super().__init__("vision", len(t["y_train"]), num_classes=num_classes, in_chans=t["x_train"].shape[1],
                         n_val=len(t["y_val"]))
        self.t, self.seed, self.repeats = t, seed, repeats

    def train_iter(self, start_step: int, shard: Shard) -> Iterator[list[Batch]]:
        step = start_step
        while True:
            idx = epoch_indices(self.n_train, self.seed, step * shard.batch_size, shard.batch_size, self.repeats)
            yield [(self.t["x_train"][i], self.t["y_train"][i]) for i in shard.split(idx)]
            step += 1

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[Batch]:
        x, y = self.t["x_val"], self.t["y_val"]
        for i in range(min(max_batches, math.ceil(len(y) / batch_size))):
            yield x[i * batch_size:(i + 1) * batch_size], y[i * batch_size:(i + 1) * batch_size]


class TokenWindows(Data):
    """Random windows of ``seq_len + 1`` tokens from a 1-D token array (bytes or uint16)."""

    def __init__(self, train: np.ndarray, val: np.ndarray, vocab_size: int, seq_len: int, seed: int,
                 names: tuple[str, str] = ("the training tokens", "the validation tokens"), remedy: str = ""):
        for arr, name, fix in zip((train, val), names, ("", remedy)):  # ``remedy``: a val split too short
            if len(arr) <= seq_len + 1:  # a window is seq_len inputs and the next token of the last
                raise ConfigError(f"{name}: {len(arr)} tokens, too few for a window of model.block_size="
                                  f"{seq_len} (+1): lower model.block_size" + (f", or {fix}" if fix else ""))
        super().__init__("text", len(train), vocab_size=vocab_size, seq_len=seq_len, n_val=len(val))
        self.train, self.val, self.seed = train, val, seed

    def _windows(self, arr: np.ndarray, starts: torch.Tensor) -> Batch:
        rows = np.stack([arr[s:s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def train_iter(self, start_step: int, shard: Shard) -> Iterator[list[Batch]]:
        step = start_step
        hi = len(self.train) - self.seq_len - 1
        while True:
            g = torch.Generator().manual_seed(self.seed * 100_003 + step)
            starts = torch.randint(0, hi, (shard.batch_size,), generator=g)
            yield [self._windows(self.train, s) for s in shard.split(starts)]
            step += 1

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(4321)
        hi = len(self.val) - self.seq_len - 1
        for _ in range(max_batches):
            yield self._windows(self.val, torch.randint(0, hi, (batch_size,), generator=g))


# name -> ``(data_cfg, model_cfg, seed) -> Data``; info: ``kind`` (vision | text: which model
# families it fits), ``check`` (``data_cfg -> None``, raising ConfigError before any work) and
# ``reads``: which of the OPTION_KEYS it reads (undeclared: any), so that a ``data.path`` given
# to another data set is refused rather than trained past
DATASETS = Registry("data", __name__, declares=("kind", "check", "reads"),
                    requires={"kind": "vision or text: the model families it fits"}, call="(data_cfg, model_cfg, seed)",
                    returns=(lambda d: isinstance(d, Data), "a stabletrain.data.Data"))
# the data keys only some data sets read; the rest (img_size, mixup, ...) every one of a kind does
OPTION_KEYS = ("path", "root", "tokenizer", "val_fraction", "num_workers", "randaug", "erasing")
IMAGE_FILES = ("root", "num_workers", "randaug", "erasing")


def resolve_name(data_cfg, default: str) -> str:
    name = option_value(data_cfg.name)
    return default if name == "auto" else name


def _exists(key: str, path: str | None, option: str, what: str) -> None:
    """``data.root`` unset or missing: one line saying which, and what it should be."""
    if not path:
        raise ConfigError(f"data={option} needs {key}=PATH, {what}")
    if not os.path.exists(path):
        raise ConfigError(f"{key}={path} does not exist: point data={option} at {what}")


@DATASETS.register("digits", kind="vision", reads=("val_fraction",))
def digits(d, m, seed: int) -> Data:
    from stabletrain.data.embedded import digits_tensors

    return TensorImages(digits_tensors(d.img_size or m.img_size, d.val_fraction), 10, seed, d.repeated_aug)


def _check_imagefolder(d) -> None:
    _exists("data.root", d.root, "imagefolder", "a folder with train/ and val/ class folders")
    from stabletrain.data.vision import check_imagefolder

    check_imagefolder(d.root)


@DATASETS.register("imagefolder", kind="vision", check=_check_imagefolder, reads=IMAGE_FILES)
def imagefolder(d, m, seed: int) -> Data:
    from stabletrain.data.vision import imagefolder_data

    return imagefolder_data(d, m.img_size, seed)


def _cifar(name: str):
    def check(d) -> None:
        from stabletrain.data.vision import check_cifar_files

        check_cifar_files(name, d.root)

    @DATASETS.register(name, kind="vision", check=check, reads=IMAGE_FILES)
    def build(d, m, seed: int) -> Data:
        from stabletrain.data.vision import cifar_data

        return cifar_data(d, m.img_size, seed, name)


_cifar("cifar10")
_cifar("cifar100")


@DATASETS.register("pytext", kind="text", reads=("tokenizer", "val_fraction"))
def pytext(d, m, seed: int) -> Data:
    """The Python standard library's sources as bytes (or GPT-2 tokens): text on any machine."""
    from stabletrain.data.embedded import pytext_bytes
    from stabletrain.data.tokenizer import encode

    arr, vocab = encode(pytext_bytes(), d.tokenizer)
    # the text's last val_fraction / 2 validates (10% at the default 0.2): every pytext figure in the
    # README and docs/methods.md was measured with this split, so it stays
    cut = int(len(arr) * (1 - d.val_fraction / 2))
    return _token_windows(arr[:cut], arr[cut:], vocab, m, seed, ("the embedded text's training part",
                                                                  "the embedded text's validation part"),
                          "raise data.val_fraction")


def _check_tokens(d) -> None:
    _exists("data.path", d.path, "tokens", "a train.bin (scripts/prepare_tokens.py writes one)")


@DATASETS.register("tokens", kind="text", check=_check_tokens, reads=("path",))
def tokens(d, m, seed: int) -> Data:
    from stabletrain.data.token_files import META, load_token_files

    train, val, vocab = load_token_files(d.path or "")
    path = Path(d.path)
    # bins without a meta.json are read as nanoGPT's GPT-2 files; a byte-level set that lost its
    # meta.json would train as GPT-2 ids: said where the vocabulary is refused
    assumed = "" if path.with_name(META).is_file() else (
        f" ({path.parent} has no {META}: its tokens are taken as nanoGPT's GPT-2 ids; files of "
        f"scripts/prepare_tokens.py have one, so write them again if it was lost)")
    return _token_windows(train, val, vocab, m, seed, (str(path), str(path.with_name("val.bin"))),
                          f"write the files again with scripts/prepare_tokens.py --block-size {m.block_size}", assumed)


def _token_windows(train: np.ndarray, val: np.ndarray, vocab: int, m, seed: int, names: tuple[str, str],
                   remedy: str, assumed: str = "") -> TokenWindows:
    if m.vocab_size < vocab:  # the embedding would index out of range on the first batch
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary {vocab}{assumed}: "
                          f"set model.vocab_size={-(-vocab // 64) * 64} (or larger)")
    return TokenWindows(train, val, vocab, m.block_size, seed, names, remedy)


def task_loss(data: Data, data_cfg):
    """``(mixup or None, criterion)`` for the data's task; ``criterion(logits, y)`` in fp32.

    Text: next-token cross-entropy over every position. Vision: timm's, with mixup/cutmix's
    soft targets and label smoothing per ``data_cfg``."""
    if data.kind == "text":
        return None, next_token_loss
    from stabletrain.data.vision import vision_loss

    mixup, loss = vision_loss(data_cfg, data.num_classes)
    return mixup, lambda logits, y: loss(logits.float(), y)


def next_token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
