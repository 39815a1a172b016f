"""IDX and restricted-pickle readers, on small files the tests build themselves."""

from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest

from qkv.data.images import load_pickled_arrays, read_idx


def _idx_bytes(arr: np.ndarray, code: int) -> bytes:
    """An IDX file written from the format's definition (big-endian sizes and values)."""
    dt = {0x08: ">u1", 0x0B: ">i2", 0x0D: ">f4"}[code]
    head = bytes([0, 0, code, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    return head + arr.astype(dt).tobytes()


@pytest.mark.parametrize("code, dtype", [(0x08, np.uint8), (0x0B, np.int16), (0x0D, np.float32)])
@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_round_trip(tmp_path, code, dtype, compress) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.random((5, 4, 3)) * 100).astype(dtype)
    raw = _idx_bytes(arr, code)
    path = tmp_path / ("a.idx.gz" if compress else "a.idx")
    path.write_bytes(gzip.compress(raw) if compress else raw)
    got = read_idx(path)
    assert got.shape == (5, 4, 3) and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"\x01\x00" + b[2:], "not an IDX file"),
    (lambda b: b[:2] + b"\x42" + b[3:], "unknown IDX element type"),
    (lambda b: b[:-1], "truncated or damaged"),
    (lambda b: b + b"\x00", "truncated or damaged"),
    (lambda b: b[:6], "truncated IDX header"),
    (lambda b: b"", "not an IDX file"),
])
def test_read_idx_malformed(tmp_path, mutate, message) -> None:
    good = _idx_bytes(np.arange(24, dtype=np.uint8).reshape(2, 3, 4), 0x08)
    path = tmp_path / "bad.idx"
    path.write_bytes(mutate(good))
    with pytest.raises(ValueError, match=message):
        read_idx(path)


def test_read_idx_damaged_gzip(tmp_path) -> None:
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x02ab")[:-6])
    with pytest.raises(ValueError, match="damaged gzip"):
        read_idx(path)


def test_fashion_mnist_files_if_installed() -> None:
    root = "/usr/share/datasets/fashion-mnist"
    if not os.path.isdir(root):
        pytest.skip("asset missing: fashion-mnist (qkv assets install fashion-mnist)")
    x = read_idx(f"{root}/t10k-images-idx3-ubyte.gz")
    y = read_idx(f"{root}/t10k-labels-idx1-ubyte.gz")
    assert x.shape == (10000, 28, 28) and x.dtype == np.uint8
    assert y.shape == (10000,) and set(np.unique(y)) == set(range(10))
    assert np.bincount(y).tolist() == [1000] * 10  # the test split is balanced


def test_pickled_arrays_python2_style(tmp_path) -> None:
    arrays = ((np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], dtype=np.int64)),
              {"valid": np.ones(3)})
    path = tmp_path / "m.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps(arrays, protocol=2)))
    (a, b), d = load_pickled_arrays(path)
    np.testing.assert_array_equal(a, arrays[0][0])
    np.testing.assert_array_equal(b, arrays[0][1])
    np.testing.assert_array_equal(d["valid"], np.ones(3))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/qkv_pwned",))


def test_restricted_unpickler_refuses_anything_but_arrays(tmp_path) -> None:
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps([np.zeros(2), _Evil()], protocol=2))
    with pytest.raises(ValueError, match="only numpy arrays may be unpickled"):
        load_pickled_arrays(path)
    assert not os.path.exists("/tmp/qkv_pwned")


def test_truncated_pickle(tmp_path) -> None:
    path = tmp_path / "cut.pkl"
    path.write_bytes(pickle.dumps(np.zeros(100), protocol=2)[:40])
    with pytest.raises(ValueError, match="not a readable pickle"):
        load_pickled_arrays(path)


def test_mnist_pickle_if_installed() -> None:
    from qkv.assets import AssetMissingError, asset_path

    try:
        root = asset_path("mnist")
    except AssetMissingError:
        pytest.skip("asset missing: mnist (qkv assets install mnist)")
    (x, y), (vx, vy), (tx, ty) = load_pickled_arrays(root / "mnist.pkl.gz")
    assert x.shape == (50000, 784) and vx.shape == tx.shape == (10000, 784)
    assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
    assert set(np.unique(ty)) == set(range(10)) and len(y) == 50000 and len(vy) == 10000


def _tiny_data():
    import torch

    from qkv.data.images import ImageData

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (40, 1, 6, 6), generator=g, dtype=torch.uint8)
    y = torch.arange(40) % 4
    return ImageData("tiny", ("a", "b", "c", "d"), x, y, x[:8], y[:8], x[:8], y[:8])


def test_batches_normalise_with_training_statistics() -> None:
    import torch

    from qkv.data.images import ImageBatches

    data = _tiny_data()
    b = ImageBatches(data)
    xf = data.train_x.double() / 255
    assert b.mean == pytest.approx(float(xf.mean()), rel=1e-6)
    assert b.std == pytest.approx(float(xf.std()), rel=1e-5)
    x, y = b.get_batch("val", 5, torch.Generator().manual_seed(1))
    assert x.shape == (5, 1, 6, 6) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_shift_moves_images_with_black_fill() -> None:
    import torch

    from qkv.data.images import ImageBatches

    data = _tiny_data()
    b = ImageBatches(data, shift=2)
    x = torch.rand(3, 1, 6, 6)
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    got = b._shift(x, gen)
    gen.set_state(state)
    dy, dx = torch.randint(0, 5, (2, 3), generator=gen)
    for i in range(3):  # reference: pad with zeros, crop the 6x6 window at (dy, dx)
        padded = torch.zeros(1, 10, 10)
        padded[:, 2:8, 2:8] = x[i]
        expected = padded[:, int(dy[i]):int(dy[i]) + 6, int(dx[i]):int(dx[i]) + 6]
        torch.testing.assert_close(got[i], expected, rtol=0, atol=0)


def test_val_split_is_deterministic_and_disjoint() -> None:
    import torch

    from qkv.data.images import _split_val

    x = torch.arange(100).view(100, 1, 1, 1)
    y = torch.arange(100)
    a = _split_val(x, y, 10, seed=0)
    b = _split_val(x, y, 10, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    train_ids, val_ids = set(a[1].tolist()), set(a[3].tolist())
    assert len(val_ids) == 10 and not train_ids & val_ids and len(train_ids | val_ids) == 100
    with pytest.raises(ValueError, match="val_size"):
        _split_val(x, y, 100, seed=0)


def test_flip_mirrors_about_half_of_the_training_batch() -> None:
    import torch

    from qkv.data.images import ImageBatches

    data = _tiny_data()
    plain, flipped = ImageBatches(data), ImageBatches(data, flip=True)
    x0, _ = plain.get_batch("train", 64, torch.Generator().manual_seed(5))
    x1, _ = flipped.get_batch("train", 64, torch.Generator().manual_seed(5))
    same = [torch.equal(a, b) for a, b in zip(x0, x1, strict=True)]
    mirrored = [torch.equal(a.flip(-1), b) for a, b in zip(x0, x1, strict=True)]
    assert all(s or m for s, m in zip(same, mirrored, strict=True))
    assert 16 < sum(mirrored) < 48
    v0, _ = plain.get_batch("val", 8, torch.Generator().manual_seed(5))
    v1, _ = flipped.get_batch("val", 8, torch.Generator().manual_seed(5))
    assert torch.equal(v0, v1)  # no augmentation outside training


# --------------------------------------------------------------------------- digits, folders, files


def test_digits_splits() -> None:
    pytest.importorskip("sklearn", reason="package missing: scikit-learn (pip install -e '.[dev]')")
    import torch
    from sklearn.datasets import load_digits as sk_digits

    from qkv.data.images import load_digits

    d = load_digits()
    assert d.shape == (1, 8, 8) and d.train_x.dtype == torch.uint8
    assert (len(d.train_y), len(d.val_y), len(d.test_y)) == (1797 - 560, 200, 360)
    # every image is one of sklearn's, scaled 0..16 -> 0..255, and none is in two splits
    ref = {tuple(np.rint(im * 255 / 16).astype(np.uint8).ravel()): int(t)
           for im, t in zip(sk_digits().images, sk_digits().target, strict=True)}
    seen = []
    for x, y in ((d.train_x, d.train_y), (d.val_x, d.val_y), (d.test_x, d.test_y)):
        keys = [tuple(im.ravel().tolist()) for im in x]
        assert all(ref[k] == int(t) for k, t in zip(keys, y, strict=True))
        seen.append(len(x))
    assert sum(seen) == 1797
    again = load_digits()
    assert torch.equal(again.test_x, d.test_x)


def _write_png(path, array, mode=None) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode=mode).save(path)


def test_read_image_converts_with_notes(tmp_path) -> None:
    from qkv.data.images import read_image

    rgb = np.zeros((10, 20, 3), dtype=np.uint8)
    rgb[..., 0] = 200  # pure red
    _write_png(tmp_path / "red.png", rgb)
    x, notes = read_image(tmp_path / "red.png", 8, 1)
    assert tuple(x.shape) == (1, 8, 8)
    assert any("grey" in n for n in notes) and any("resized 20x10 to 8x8" in n for n in notes)
    assert abs(int(x[0, 4, 4]) - round(200 * 0.299)) <= 1  # ITU-R 601 luma of pure red
    grey = (np.arange(64, dtype=np.uint8) * 4).reshape(8, 8)
    _write_png(tmp_path / "g.png", grey)
    x, notes = read_image(tmp_path / "g.png", 8, 1)
    assert notes == [] and np.array_equal(x[0].numpy(), grey)
    x, notes = read_image(tmp_path / "g.png", 8, 3)
    assert tuple(x.shape) == (3, 8, 8) and all(np.array_equal(c.numpy(), grey) for c in x)
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    rgba[..., :3] = 255  # white, fully transparent: becomes the black background
    _write_png(tmp_path / "t.png", rgba)
    x, _ = read_image(tmp_path / "t.png", 8, 1)
    assert int(x.max()) == 0


@pytest.mark.parametrize("content, message", [
    (b"", "not a readable image"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 30, "not a readable image"),
    (b"hello, I am text", "not a readable image"),
])
def test_read_image_refuses_broken_files(tmp_path, content, message) -> None:
    from qkv.data.images import read_image

    path = tmp_path / "bad.png"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_image(path, 8, 1)
    with pytest.raises(ValueError, match="not found"):
        read_image(tmp_path / "missing.png", 8, 1)


def _class_folder(root, classes: dict[str, int], size=(12, 12), colour=False):
    rng = np.random.default_rng(0)
    for name, n in classes.items():
        for i in range(n):
            shape = (*size, 3) if colour else size
            _write_png(root / name / f"{i}.png", rng.integers(0, 256, shape, dtype=np.uint8))


def test_image_folder_dataset(tmp_path) -> None:
    import torch

    from qkv.data.images import load_image_folder

    _class_folder(tmp_path / "ds", {"cat": 20, "dog": 10, "zebra": 3})
    (tmp_path / "ds" / "dog" / "notes.txt").write_text("ignored")
    notes = []
    d = load_image_folder(tmp_path / "ds", image_size=8, on_note=notes.append)
    assert d.classes == ("cat", "dog", "zebra") and d.shape == (1, 8, 8)
    assert len(d.train_y) + len(d.val_y) + len(d.test_y) == 33
    for split_y in (d.val_y, d.test_y):  # stratified: every class present
        assert set(split_y.tolist()) == {0, 1, 2}
    assert torch.bincount(d.test_y).tolist() == [2, 1, 1]
    assert any("resized 33 of 33" in n for n in notes)
    again = load_image_folder(tmp_path / "ds", image_size=8)
    assert torch.equal(again.test_x, d.test_x)
    _class_folder(tmp_path / "rgb", {"a": 3, "b": 3}, colour=True)
    assert load_image_folder(tmp_path / "rgb", image_size=12).shape == (3, 12, 12)


def test_image_folder_errors(tmp_path) -> None:
    from qkv.data.images import load_image_folder

    with pytest.raises(ValueError, match="not found"):
        load_image_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class sub-folders"):
        load_image_folder(tmp_path / "empty")
    _class_folder(tmp_path / "one", {"only": 4})
    with pytest.raises(ValueError, match="only one class"):
        load_image_folder(tmp_path / "one")
    _class_folder(tmp_path / "hole", {"a": 3})
    (tmp_path / "hole" / "b").mkdir()
    with pytest.raises(ValueError, match="has no images"):
        load_image_folder(tmp_path / "hole")
    _class_folder(tmp_path / "broken", {"a": 3, "b": 3})
    (tmp_path / "broken" / "b" / "9.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"9\.png is not a readable image"):
        load_image_folder(tmp_path / "broken")


def test_unknown_dataset_name(tmp_path) -> None:
    from qkv.data.images import load_image_dataset

    with pytest.raises(ValueError, match="fashion-mnist, mnist, digits or a folder"):
        load_image_dataset(str(tmp_path / "nowhere"))


def test_read_image_16_bit_and_float(tmp_path) -> None:
    from PIL import Image

    from qkv.data.images import read_image

    a16 = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)  # up to 63,000 of 65,535
    Image.fromarray(a16).save(tmp_path / "deep.png")
    x, notes = read_image(tmp_path / "deep.png", 8, 1)
    assert any("8 bits" in n for n in notes)
    np.testing.assert_allclose(x[0].numpy(), np.rint(a16 / 65535 * 255), atol=1)
    f = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    Image.fromarray(f).save(tmp_path / "f.tif")
    x, _ = read_image(tmp_path / "f.tif", 8, 1)
    np.testing.assert_allclose(x[0].numpy(), np.rint(f * 255), atol=1)


def test_image_folder_ignores_hidden_files(tmp_path) -> None:
    from qkv.data.images import load_image_folder

    _class_folder(tmp_path / "ds", {"a": 3, "b": 3})
    (tmp_path / "ds" / "a" / "._0.png").write_bytes(b"AppleDouble junk")
    d = load_image_folder(tmp_path / "ds", image_size=8)
    assert len(d.train_y) + len(d.val_y) + len(d.test_y) == 6


def test_erase_blanks_one_rectangle_to_the_mean_in_about_p_of_the_images() -> None:
    """Random erasing: a chosen image differs from the plain batch only inside one axis-aligned
    rectangle of 2-25% of its area, set to the training mean (0 after normalising); about p of
    the images are chosen; validation batches are untouched."""
    import torch

    from qkv.data.images import ImageBatches

    data = _tiny_data()
    plain, erased = ImageBatches(data), ImageBatches(data, erase=0.5)
    x0, _ = plain.get_batch("train", 200, torch.Generator().manual_seed(7))
    x1, _ = erased.get_batch("train", 200, torch.Generator().manual_seed(7))
    H, W = x0.shape[-2:]
    changed = 0
    for a, b in zip(x0, x1, strict=True):
        diff = (a != b).any(0)  # (H, W)
        if not diff.any():
            continue
        changed += 1
        blank = (b == 0).all(0)
        ys, xs = torch.nonzero(diff, as_tuple=True)
        box = blank[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
        assert box.all()  # the changed pixels lie in one rectangle that is all mean
        assert box.numel() <= 0.25 * H * W + H + W  # rounding of the sides
    assert 60 < changed < 140
    v0, _ = plain.get_batch("val", 8, torch.Generator().manual_seed(5))
    v1, _ = erased.get_batch("val", 8, torch.Generator().manual_seed(5))
    assert torch.equal(v0, v1)
