"""The ViT family: image classification with a Vision Transformer (Dosovitskiy et al. 2021;
Lecture 23). Images -> :class:`qkv.models.vit.ViT` -> test accuracy, a confusion matrix, and
the attention of the last layer and its rollout over a test image.

Run directory: ``config.json`` of family ``"vit"`` (its ``data`` section holds the class names
and the normalisation the model was trained with), ``eval.json`` (test accuracy, confusion
matrix), ``confusion.png``, ``loss.png``, ``attention.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.data.images import ImageBatches, ImageData, load_image_dataset
from qkv.families.base import FamilyBase, files_lines, loss_curve, trained_line
from qkv.figures import ConfusionMatrix, ImageOverlays, Picture
from qkv.models.vit import ViT, ViTConfig
from qkv.pipelines.images import ImageClassifier, attention_maps, predict
from qkv.training.run import Prepared, Run


@dataclass
class ImageDataConfig:
    """Which images, and how they are augmented."""

    dataset: str = "fashion-mnist"  # fashion-mnist, mnist, digits, or a folder of class sub-folders
    val_size: int = 5000  # Fashion-MNIST: training images held out for validation
    shift: int = 0  # random shifts of up to this many pixels while training (0 = none)
    flip: bool = False  # random horizontal flips while training (not for digits or text)
    erase: float = 0.0  # probability of blanking a random rectangle of a training image (random erasing)
    image_size: int = 28  # folder datasets: every image is resized to this square size
    split_seed: int = 0  # seed of the deterministic train/validation/test split

    def __post_init__(self) -> None:
        if self.val_size < 1:
            raise ValueError(f"val_size must be >= 1, got {self.val_size}")
        if self.shift < 0:
            raise ValueError(f"shift must be >= 0, got {self.shift}")
        if not 0.0 <= self.erase <= 1.0:
            raise ValueError(f"erase must be a probability in [0, 1], got {self.erase}")
        if self.image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {self.image_size}")


def load_data(data_cfg: ImageDataConfig, on_note: Callable[[str], None] | None = None) -> ImageData:
    return load_image_dataset(data_cfg.dataset, val_size=data_cfg.val_size, seed=data_cfg.split_seed,
                              image_size=data_cfg.image_size, on_note=on_note)


def fit_model_config(model_cfg: ViTConfig, data: ImageData) -> ViTConfig:
    """The model config with the data's image size, channels and classes; a clear error if the
    patch size does not fit these images."""
    C, H, W = data.shape
    if H != W:
        raise ValueError(f"{data.name} images are {H}x{W}; the ViT needs square images")
    if H % model_cfg.patch_size:
        fits = [p for p in range(2, H + 1) if H % p == 0]
        raise ValueError(f"patch_size {model_cfg.patch_size} does not divide the {H}x{H} images of "
                         f"{data.name}; use --patch_size {' or '.join(map(str, fits[:4]))}")
    return dataclasses.replace(model_cfg, image_size=H, channels=C, n_classes=len(data.classes))


def confusion_matrix(labels: Tensor, preds: Tensor, n_classes: int) -> Tensor:
    """(n_classes, n_classes) counts: row = true class, column = predicted class."""
    return torch.bincount(labels * n_classes + preds, minlength=n_classes**2).reshape(n_classes, n_classes)


def evaluate_split(model: ViT, data: ImageData, mean: float, std: float, split: str = "test") -> dict:
    """Accuracy and confusion matrix on one split."""
    x, y = {"train": (data.train_x, data.train_y), "val": (data.val_x, data.val_y),
            "test": (data.test_x, data.test_y)}[split]
    preds = predict(model, x, mean, std).argmax(-1)
    cm = confusion_matrix(y, preds, len(data.classes))
    return {"split": split, "n": len(y), "accuracy": float((preds == y).float().mean()) if len(y) else 0.0,
            "classes": list(data.classes), "confusion": cm.tolist()}


class ViTFamily(FamilyBase):
    name = "vit"
    kind = "image"
    unit = "img"
    help = "a Vision Transformer on images (default: Fashion-MNIST)"
    description = (
        "Train a Vision Transformer. With no options: the `fashion-cpu` preset on Fashion-MNIST "
        "(`qkv assets install fashion-mnist`); --dataset mnist|digits|FOLDER picks other images "
        "(a folder holds one sub-folder of images per class). At the end: test accuracy, a "
        "confusion matrix, and the attention of the last layer and its rollout over a test image.")
    model_config = ViTConfig
    data_config = ImageDataConfig
    from_data = ("image_size", "channels", "n_classes")
    default_preset = "fashion-cpu"

    def draft_model(self, model_args: dict[str, Any]) -> dict[str, Any]:
        # until the data is loaded, a size the patch divides lets every other field be checked
        return {**model_args, "image_size": model_args.get("patch_size", 4)}

    def prepare(self, model_cfg: ViTConfig, data_cfg: ImageDataConfig, resume_dir, on_note) -> Prepared:
        data = load_data(data_cfg, on_note)
        batches = ImageBatches(data, shift=data_cfg.shift, flip=data_cfg.flip, erase=data_cfg.erase)
        record = {"name": data.name, "classes": list(data.classes), "mean": batches.mean, "std": batches.std,
                  "sizes": {"train": len(data.train_y), "val": len(data.val_y), "test": len(data.test_y)}}
        return Prepared(fit_model_config(model_cfg, data), batches, data, data_record=record)

    def build(self, model_cfg: ViTConfig) -> ViT:
        return ViT(model_cfg)

    def check_resume(self, saved: dict[str, Any], prepared: Prepared) -> None:
        data, b = saved.get("data", {}), prepared.batches
        if data.get("classes") != list(prepared.state.classes) or abs(data.get("mean", 0) - b.mean) > 1e-6:
            raise ValueError(f"the images of {data.get('dataset')} changed since "
                             f"{saved['train']['out_dir']} was started (other classes or statistics); "
                             "start a new run instead of resuming")

    def evaluate(self, model: ViT, prepared: Prepared) -> dict[str, Any]:
        data, b = prepared.state, prepared.batches
        ev = evaluate_split(model, data, b.mean, b.std, "test")
        ev["val_accuracy"] = evaluate_split(model, data, b.mean, b.std, "val")["accuracy"]
        return ev

    def pictures(self, run: Run) -> dict[str, Picture]:
        data, b, ev = run.prepared.state, run.prepared.batches, run.eval
        pics = {"confusion matrix": Picture("confusion.png", ConfusionMatrix(
                    ev["confusion"], data.classes, title=f"{data.name} test: accuracy {ev['accuracy']:.2%}")),
                "loss plot": loss_curve(run)}
        image, label = data.test_x[0], int(data.test_y[0])
        probs, heads, rollout = attention_maps(run.model, image, b.mean, b.std)
        maps = [(f"head {h}", heads[h]) for h in range(len(heads))] + [("rollout", rollout)]
        pred = int(probs.argmax())
        title = f"true {data.classes[label]}, predicted {data.classes[pred]} ({probs[pred]:.0%})"
        pics["attention on a test image"] = Picture("attention.png", ImageOverlays(image, maps, title))
        return pics

    def headline(self, model_cfg: ViTConfig, data_cfg: ImageDataConfig) -> str:
        return (f"{model_cfg.n_layers} layers x {model_cfg.dim} wide, {model_cfg.patch_size}x"
                f"{model_cfg.patch_size} patches, {data_cfg.dataset}")

    def summary(self, run: Run, args: argparse.Namespace | None = None) -> str:
        ev, d = run.eval, run.run_dir
        return (f"\n{trained_line(run, 'images')}\n"
                f"test accuracy {ev['accuracy']:.2%} on {ev['n']:,} {run.prepared.state.name} images "
                f"(validation {ev['val_accuracy']:.2%})\n"
                + files_lines(run, {"weights": d / "model.safetensors"})
                + f"classify an image: qkv classify {d} IMAGE.png\n"
                f"see where it looks: qkv attend {d} IMAGE.png")

    def load(self, run_dir: Path, device: str = "cpu") -> ImageClassifier:
        def parse(c: dict) -> tuple[ViTConfig, tuple]:
            cfg, data = ViTConfig(**c["model"]), c["data"]
            classes = list(data["classes"])
            if len(classes) != cfg.n_classes:
                raise ValueError(f"it names {len(classes)} classes but the model has {cfg.n_classes}")
            name = str(data.get("name", data["dataset"]))  # the images' name, or the option given
            return cfg, (classes, float(data["mean"]), float(data["std"]), name)

        _, model, (classes, mean, std, dataset) = self.read_run(run_dir, "an image classifier", parse, device)
        return ImageClassifier(Path(run_dir).name, model, classes, mean, std, dataset, Path(run_dir))
