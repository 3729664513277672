"""Image data sets through torchvision, timm's transforms, mixup and losses.

One pipeline (:class:`ImageData`: transforms, the step-indexed sampler, repeated augmentation,
rank sharding, workers) serves every image source; ImageNet-style folders and CIFAR differ
only in how their two data sets are constructed and which normalisation they use.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from stabletrain.config import ConfigError
from stabletrain.data import Batch, Data, Shard, epoch_indices

# Per-channel mean and std of each training set's pixels in [0, 1]: the widely used constants.
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


class _StepSampler(Sampler):
    """Micro-batches of this rank from step ``start`` on (the same stream as in-memory data),
    as ``(index, draw)`` pairs: ``draw`` numbers the sample's place in the whole run's stream."""

    def __init__(self, n: int, seed: int, start: int, shard: Shard, repeats: int = 1):
        self.n, self.seed, self.start, self.shard, self.repeats = n, seed, start, shard, repeats

    def __iter__(self):
        step, size = self.start, self.shard.batch_size
        while True:
            idx = epoch_indices(self.n, self.seed, step * size, size, self.repeats)
            draws = torch.arange(step * size, (step + 1) * size)
            for micro, where in zip(self.shard.split(idx), self.shard.split(draws)):
                yield list(zip(micro.tolist(), where.tolist()))
            step += 1


class _SeededDraws(Dataset):
    """``dataset[index]`` with its random transforms seeded by ``(seed, draw)``.

    An augmentation is then a function of the sample's place in the run, whatever the worker
    that loads it or the step a run resumed from (a DataLoader seeds its workers anew on every
    start), and it leaves the process's random generators as it found them (with no workers
    the transforms would otherwise draw from the training's own).
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        index, draw = key
        s = int(np.random.SeedSequence([self.seed, draw]).generate_state(1)[0])
        py, npy = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                random.seed(s)
                np.random.seed(s)
                torch.manual_seed(s)
                return self.dataset[index]
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def image_transforms(d, img_size: int, mean=None, std=None, eval_crop_pct=None):
    """(train, eval) transforms from timm at the data's (or the model's) image size.

    ``mean``/``std`` None are timm's ImageNet defaults; ``eval_crop_pct`` None is timm's
    resize-then-centre-crop (0.875), 1.0 keeps the whole image (CIFAR: identity at 32 px).
    """
    from timm.data import create_transform

    check_randaug(d.randaug)
    size = d.img_size or img_size
    norm = {} if mean is None else {"mean": mean, "std": std}
    train_tf = create_transform(size, is_training=True, auto_augment=d.randaug, re_prob=d.erasing, **norm)
    val_tf = create_transform(size, is_training=False, crop_pct=eval_crop_pct, **norm)
    _posterize_zero_bits(train_tf)
    return train_tf, val_tf


def check_randaug(spec: str | None) -> None:
    """ConfigError (one line) unless timm builds an augmentation from ``data.randaug``.

    The check is building it the way :func:`image_transforms` does, so timm's own dispatch
    (``rand...``, ``augmix...``, else an AutoAugment policy) decides and every string timm
    takes passes; timm itself only asserts, deep in a traceback.
    """
    if not spec:
        return
    from timm.data import create_transform

    try:
        create_transform(32, is_training=True, auto_augment=spec)
    except Exception as e:  # AssertionError for unknown names and sections, ValueError for bad numbers
        why = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"data.randaug={spec} is not a timm RandAugment string" + (f" ({why})" if why else "")
                          + "; use e.g. rand-m9-mstd0.5-inc1 (or augmix-m5-w4-d2, original-mstd0.5, "
                          "or null for none)") from e


def _posterize_zero_bits(transform) -> None:
    """Let timm's posterize keep 0 bits again. RandAugment's ``inc1`` posterize keeps
    ``4 - int(0.4 m)`` bits, 0 when ``mstd`` noise lifts the magnitude to its cap of 10: older
    Pillow returned a black image, Pillow 13 raises, which ended the recipes' runs on real
    images partway through. The ops of this transform get a posterize that returns black."""
    from PIL import Image
    from timm.data import auto_augment

    def posterize(img, bits_to_keep, **kw):
        if bits_to_keep <= 0:
            return Image.new(img.mode, img.size)
        return auto_augment.posterize(img, bits_to_keep, **kw)

    for t in getattr(transform, "transforms", []):
        for op in getattr(t, "ops", []):
            if getattr(op, "aug_fn", None) is auto_augment.posterize:
                op.aug_fn = posterize


VAL_PART_SEED = 1234  # which val images a partial evaluation scores (eval_batches x batch < the val set)


class ImageData(Data):
    """A train and a val data set of ``(image tensor, label)`` behind the step-indexed stream."""

    def __init__(self, d, seed: int, train_set: Dataset, val_set: Dataset, num_classes: int):
        super().__init__("vision", len(train_set), num_classes=num_classes, in_chans=3, n_val=len(val_set))
        self.train_set, self.val_set = train_set, val_set
        self.seed, self.workers, self.repeats = seed, loader_workers(d.num_workers), d.repeated_aug
        self.workers_asked = d.num_workers

    def loader_words(self) -> str:
        """How the images are loaded, for the data start line: the workers, and where
        data.num_workers asked for more than this process's CPUs."""
        if not self.workers_asked:
            return ""
        capped = (f" (data.num_workers={self.workers_asked}, capped at the {self.workers} CPUs this process may use)"
                  if self.workers < self.workers_asked else "")
        return f", {self.workers} loader worker{'s' * (self.workers != 1)}{capped}"

    def bad_samples(self) -> int:
        """Unreadable image files replaced so far, in the loader workers too (the trainer logs it)."""
        return sum(int(d.replaced) for d in (self.train_set, self.val_set) if hasattr(d, "replaced"))

    def train_iter(self, start_step: int, shard: Shard) -> Iterator[list[Batch]]:
        sampler = _StepSampler(self.n_train, self.seed, start_step, shard, self.repeats)
        # its own generator: starting an iterator would otherwise draw from torch's global one, and
        # a resumed run, which starts it at another moment, would get other dropout masks after it
        loader = DataLoader(_SeededDraws(self.train_set, self.seed), batch_sampler=sampler,
                            num_workers=self.workers, pin_memory=torch.cuda.is_available(),
                            persistent_workers=self.workers > 0,
                            generator=torch.Generator().manual_seed(self.seed + start_step))
        it = iter(loader)
        while True:
            yield [next(it) for _ in range(shard.accum)]

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[Batch]:
        part = self.val_set
        if max_batches * batch_size < len(part):
            # a part of the val set is a fixed random one, the same for every run and seed: the first
            # images would be the first classes only (an ImageFolder lists them class by class)
            pick = torch.randperm(len(part), generator=torch.Generator().manual_seed(VAL_PART_SEED))
            part = Subset(part, pick[:max_batches * batch_size].sort().values.tolist())
        # its own generator: the global one is the model's (dropout, drop path), and how often a run
        # evaluates may differ between a run and its resume
        loader = DataLoader(part, batch_size=batch_size, num_workers=self.workers,
                            generator=torch.Generator().manual_seed(self.seed))
        for i, b in enumerate(loader):
            if i >= max_batches:
                break
            yield b


def loader_workers(requested: int) -> int:
    """``data.num_workers``, at most the CPUs this process may run on: the image configs ask
    for 4 or 8, and more workers than CPUs only contend (the samples do not depend on it)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(requested, cpus)


def check_imagefolder(root: str | None) -> None:
    """ConfigError (one line) unless ``root`` has train/ and val/ class folders, each of train's
    holding an image, val's a subset of train's, and val an image somewhere.

    val is labelled by train's classes by name (:func:`imagefolder_data`): a class val lacks is
    fine, one train lacks the model cannot predict. Cheap: it lists the class folders and stops
    at the first image in each.
    """
    if not root:
        raise ConfigError("data=imagefolder needs data.root=DIR, the folder holding train/<class>/ and val/<class>/")
    classes = {}
    for split in ("train", "val"):
        folder = Path(root) / split
        if not folder.is_dir():
            raise ConfigError(f"data.root={root} has no {split}/ folder: "
                              "expected root/train/<class>/ and root/val/<class>/")
        classes[split] = sorted(e.name for e in os.scandir(folder) if e.is_dir())
        if not classes[split]:
            raise ConfigError(f"{folder}/ has no class folders: expected {folder}/<class>/<image files>")
    # val's labels are train's, by class name: val may lack a class (a small data set's split),
    # but a class train lacks is one the model cannot predict
    unknown = sorted(set(classes["val"]) - set(classes["train"]))
    if unknown:
        raise ConfigError(f"data.root={root}: val/ has class folders train/ lacks ({_some(unknown)}), which the "
                          f"model cannot learn: add them to train/ or remove them from val/")
    for c in classes["train"]:
        if not _holds_an_image(Path(root) / "train" / c):
            raise ConfigError(f"{Path(root) / 'train' / c}/ holds no image files ({' '.join(_image_exts())}): "
                              f"every folder in train/ is a class; add its images or remove the folder")
    if not any(_holds_an_image(Path(root) / "val" / c) for c in classes["val"]):
        raise ConfigError(f"{Path(root) / 'val'}/ holds no image files ({' '.join(_image_exts())}) in its class "
                          f"folders: add some to score the model on")


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _image_exts() -> tuple[str, ...]:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    return IMG_EXTENSIONS


def _holds_an_image(folder: Path) -> bool:
    exts = _image_exts()
    return any(f.lower().endswith(exts) for _, _, files in os.walk(folder, followlinks=True) for f in files)


class _ReadableImages(Dataset):
    """An ImageFolder's ``(transformed image, label)`` pairs, where a file that cannot be read
    (corrupt, truncated, empty) is replaced by the next one in the folder that can.

    A long run then survives one bad file among a million, and the batch keeps its shape. The
    replacement goes through the same transform call, so under :class:`_SeededDraws` it takes
    the random draws of the slot it fills and every other sample keeps its own.
    """

    def __init__(self, folder, transform):
        self.root, self.samples, self.classes, self.transform = folder.root, folder.samples, folder.classes, transform
        # the files found unreadable and how many, in shared memory: what one loader worker finds,
        # the others and the trainer know, so a bad file is read, warned about and counted once in
        # the run, not once per worker and per epoch
        self.bad = torch.zeros(len(self.samples), dtype=torch.bool).share_memory_()
        self.replaced = torch.zeros((), dtype=torch.int64).share_memory_()
        # two workers can meet one bad file at once (one of them filling a slot after it): who
        # flags it, warns and counts it is decided under this lock; good files are read without it
        self.flagging = multiprocessing.Lock()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        for k in range(len(self.samples)):
            i = (index + k) % len(self.samples)
            if self.bad[i]:
                continue
            path, label = self.samples[i]
            img, why = _read_image(path)
            if img is not None:
                return self.transform(img), label
            with self.flagging:
                if not self.bad[i]:
                    self.bad[i] = True
                    self.replaced += 1
                    print(f"warning: cannot read image {path} ({why}); the next readable file in the folder "
                          "takes its place, with its own class", file=sys.stderr)
        raise ConfigError(f"none of the {len(self.samples)} image files in {self.root}/ can be read")


def _read_image(path: str):
    """The RGB image at ``path`` and None, or None and why PIL cannot read it (the caller flags the
    file, so that no process reads it again)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB"), None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # what PIL raises for bad files
        return None, ("PIL cannot identify it as an image" if isinstance(e, UnidentifiedImageError)
                      else f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")


def imagefolder_data(d, img_size: int, seed: int) -> ImageData:
    """``root/train/<class>/*`` and ``root/val/<class>/*`` (ImageNet's layout); ``d`` is the
    ``data`` group, ``img_size`` the model's (``data.img_size`` overrides it)."""
    from torchvision.datasets import ImageFolder

    check_imagefolder(d.root)
    root = Path(d.root)
    train_tf, val_tf = image_transforms(d, img_size)
    train_folder = ImageFolder(str(root / "train"))
    train_set = _ReadableImages(train_folder, train_tf)
    # val labelled by train's classes, by folder name: val may lack a class, or hold an empty
    # folder of one, without every later label shifting (ImageFolder numbers each split's own)
    present = {e.name for e in os.scandir(root / "val") if e.is_dir()}
    val_folder = SimpleNamespace(root=str(root / "val"), classes=train_folder.classes, samples=ImageFolder.make_dataset(
        str(root / "val"), {c: i for c, i in train_folder.class_to_idx.items() if c in present},
        extensions=_image_exts(), allow_empty=True))
    val_set = _ReadableImages(val_folder, val_tf)
    data = ImageData(d, seed, train_set, val_set, len(train_set.classes))
    scored = len({label for _, label in val_set.samples})
    if scored < len(train_set.classes):
        data.extra["val_classes"] = f"val/ has images of {scored} of the {len(train_set.classes)} classes"
    return data


def _cifar_class(name: str):
    from torchvision.datasets import CIFAR10, CIFAR100

    return {"cifar10": CIFAR10, "cifar100": CIFAR100}[name]


def check_cifar_files(name: str, root: str | None) -> None:
    """ConfigError (one line: what is missing, how to get it) unless torchvision's CIFAR files are there.

    Checks the file names only; torchvision verifies their checksums when it loads them.
    """
    cls = _cifar_class(name)
    def get(where: str) -> str:
        return (f"get it where there is network with torchvision.datasets.{cls.__name__}('DIR', download=True) "
                f"and copy DIR/{cls.base_folder}/ into {where}, or extract {cls.url} into {where}")

    if not root:
        raise ConfigError(f"data={name} needs data.root=ROOT, the folder holding {cls.base_folder}/; {get('ROOT')}")
    if Path(root).name == cls.base_folder and not (Path(root) / cls.base_folder).is_dir():
        raise ConfigError(f"data.root={root} is the {cls.base_folder}/ folder itself; give the folder that holds "
                          f"it: data.root={Path(root).parent}")
    folder = Path(root) / cls.base_folder
    files = [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        what = f"{folder}/ is missing" if not folder.is_dir() else f"{folder}/ lacks {', '.join(missing)}"
        raise ConfigError(f"data={name}: {what}; {get(root)}")


def cifar_data(d, img_size: int, seed: int, name: str) -> ImageData:
    """CIFAR-10/100 from torchvision's python-pickle files in ``data.root``; never downloads."""
    check_cifar_files(name, d.root)
    cls = _cifar_class(name)
    mean, std = CIFAR_STATS[name]
    train_tf, val_tf = image_transforms(d, img_size, mean, std, eval_crop_pct=1.0)
    try:
        train_set = cls(d.root, train=True, transform=train_tf, download=False)
        val_set = cls(d.root, train=False, transform=val_tf, download=False)
    except RuntimeError as e:  # files present but torchvision's md5 check failed
        raise ConfigError(f"data={name}: torchvision rejects the files in {Path(d.root) / cls.base_folder} "
                          f"({e}); extract {cls.url} there again") from e
    return ImageData(d, seed, train_set, val_set, len(train_set.classes))


def vision_loss(d, num_classes: int) -> tuple[object | None, nn.Module]:
    """(mixup_fn or None, train loss) from the data config ``d`` (timm's Mixup and losses)."""
    if d.mixup > 0 or d.cutmix > 0:
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        mix = Mixup(mixup_alpha=d.mixup, cutmix_alpha=d.cutmix, label_smoothing=d.label_smoothing,
                    num_classes=num_classes)
        return mix, SoftTargetCrossEntropy()
    return None, nn.CrossEntropyLoss(label_smoothing=d.label_smoothing)
