"""ImageNet-style folders through torchvision, timm's transforms, mixup and losses."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from torch import nn
from torch.utils.data import DataLoader, Sampler

from stabletrain.config import ConfigError
from stabletrain.data import Batch, Data, Shard, epoch_indices


class _StepSampler(Sampler):
    """Micro-batches of this rank from step ``start`` on (the same stream as in-memory data)."""

    def __init__(self, n: int, seed: int, start: int, shard: Shard, repeats: int = 1):
        self.n, self.seed, self.start, self.shard, self.repeats = n, seed, start, shard, repeats

    def __iter__(self):
        step = self.start
        while True:
            idx = epoch_indices(self.n, self.seed, step * self.shard.batch_size, self.shard.batch_size, self.repeats)
            for micro in self.shard.split(idx):
                yield micro.tolist()
            step += 1


class ImageFolderData(Data):
    def __init__(self, cfg):
        from timm.data import create_transform
        from torchvision.datasets import ImageFolder

        d, m = cfg.data, cfg.model
        root = Path(d.root or "")
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise ConfigError(f"data.root={d.root} has no {split}/ folder: "
                                  "expected root/train/<class>/ and root/val/<class>/")
        size = d.img_size or m.img_size
        train_tf = create_transform(size, is_training=True, auto_augment=d.randaug, re_prob=d.erasing)
        val_tf = create_transform(size, is_training=False)
        self.train_set = ImageFolder(str(root / "train"), transform=train_tf)
        self.val_set = ImageFolder(str(root / "val"), transform=val_tf)
        super().__init__("vision", len(self.train_set), num_classes=len(self.train_set.classes), in_chans=3)
        self.seed, self.workers, self.repeats = cfg.seed, d.num_workers, d.repeated_aug

    def train_iter(self, start_step: int, shard: Shard) -> Iterator[list[Batch]]:
        sampler = _StepSampler(self.n_train, self.seed, start_step, shard, self.repeats)
        loader = DataLoader(self.train_set, batch_sampler=sampler,
                            num_workers=self.workers, pin_memory=True, persistent_workers=self.workers > 0)
        it = iter(loader)
        while True:
            yield [next(it) for _ in range(shard.accum)]

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[Batch]:
        loader = DataLoader(self.val_set, batch_size=batch_size, num_workers=self.workers)
        for i, b in enumerate(loader):
            if i >= max_batches:
                break
            yield b


def vision_loss(cfg, num_classes: int) -> tuple[object | None, nn.Module]:
    """(mixup_fn or None, train loss) from the data config (timm's Mixup and losses)."""
    d = cfg.data
    if d.mixup > 0 or d.cutmix > 0:
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        mix = Mixup(mixup_alpha=d.mixup, cutmix_alpha=d.cutmix, label_smoothing=d.label_smoothing,
                    num_classes=num_classes)
        return mix, SoftTargetCrossEntropy()
    return None, nn.CrossEntropyLoss(label_smoothing=d.label_smoothing)


