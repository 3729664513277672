"""Data as step-indexed streams: batch ``s`` is a pure function of (seed, s).

Every training batch is drawn from ``seed`` and the optimizer step alone, so a resumed run
sees exactly the batches it would have seen, and the global batch is the same whatever the
world size: rank ``r`` takes its slice of it, split into micro-batches. Vision data walks a
seeded permutation per epoch; text draws random windows per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from stabletrain.config import ConfigError
from stabletrain.layers.norm import _enum

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
    extra: dict = field(default_factory=dict)

    def steps_per_epoch(self, batch_size: int) -> int:
        per = batch_size * (self.seq_len if self.kind == "text" else 1)
        return max(1, self.n_train // per)


class TensorImages(Data):
    """Images held in memory (the embedded digits)."""

    def __init__(self, t: dict[str, torch.Tensor], num_classes: int, seed: int, repeats: int = 1):
        super().__init__("vision", len(t["y_train"]), num_classes=num_classes, in_chans=t["x_train"].shape[1])
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

    def __init__(self, train: np.ndarray, val: np.ndarray, vocab_size: int, seq_len: int, seed: int):
        if len(train) <= seq_len + 1 or len(val) <= seq_len + 1:
            raise ConfigError(f"token data too short for sequences of {seq_len} tokens")
        super().__init__("text", len(train), vocab_size=vocab_size, seq_len=seq_len)
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


def build_data(cfg) -> Data:
    """The data set ``cfg.data.name`` shaped for ``cfg.model``."""
    d, m = cfg.data, cfg.model
    name = _enum(d.name)
    family = _enum(m.family)
    if name == "auto":
        name = "pytext" if family == "gpt" else "digits"
    text = name in ("pytext", "tokens")
    if text != (family == "gpt"):
        fits = "pytext or data=tokens" if family == "gpt" else "digits, cifar10, cifar100 or imagefolder"
        raise ConfigError(f"data={name} does not fit model={m.name} (a {family} model); use data={fits}")
    if name == "digits":
        from stabletrain.data.embedded import digits_tensors

        return TensorImages(digits_tensors(d.img_size or m.img_size, d.val_fraction), 10, cfg.seed, d.repeated_aug)
    if name == "imagefolder":
        from stabletrain.data.vision import imagefolder_data

        return imagefolder_data(cfg)
    if name in ("cifar10", "cifar100"):
        from stabletrain.data.vision import cifar_data

        return cifar_data(cfg, name)
    if name == "pytext":
        from stabletrain.data.embedded import pytext_bytes
        from stabletrain.data.tokenizer import encode

        arr, vocab = encode(pytext_bytes(), d.tokenizer)
        cut = int(len(arr) * (1 - d.val_fraction / 2))
        train, val = arr[:cut], arr[cut:]
    elif name == "tokens":
        from stabletrain.data.token_files import load_token_files

        train, val, vocab = load_token_files(d.path or "")
    else:
        raise ConfigError(f"data={name!r} is unknown; choose auto, digits, cifar10, cifar100, imagefolder, "
                          "pytext or tokens")
    if m.vocab_size < vocab:  # the embedding would index out of range on the first batch
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary {vocab}: "
                          f"set model.vocab_size={-(-vocab // 64) * 64} (or larger)")
    return TokenWindows(train, val, vocab, m.block_size, cfg.seed)
