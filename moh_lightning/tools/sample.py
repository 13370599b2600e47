"""``moh sample``: class-conditional images from a trained diffusion checkpoint, in ADM's ``.npz`` layout."""
from __future__ import annotations

import difflib
import json
from pathlib import Path

import numpy as np
import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from PIL import Image
from tqdm.auto import tqdm

from moh_lightning.outputs import check_output_folder, created_folder
from moh_lightning.tasks.checkpoints import read_checkpoint
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion, Sampler, to_uint8


def sample(
        checkpoint: str,
        out_dir: str = "samples",
        num_samples: PositiveInt = 100,
        classes: list[int | str] | None = None,
        cfg_scale: PositiveFloat | None = None,
        sampler: Sampler | None = None,
        steps: PositiveInt | None = None,
        seed: int = 0,
        batch_size: PositiveInt = 50,
        vae: str | None = None,
        latent_scale: PositiveFloat = 0.18215,
        device: str = "cpu",
        overwrite: bool = False,
) -> Path:
    """Samples images from a trained ClassConditionalDiffusion checkpoint (its EMA weights).

    Writes ``out_dir/images/NNNNNN_cC.png`` (``NNNNNN_cC_<name>.png`` where the checkpoint names its classes),
    ``out_dir/samples.npz`` (ADM layout: ``arr_0`` (N, H, W, 3) uint8, ``arr_1`` the labels), ``out_dir/grid.png``
    (one row per class) and ``out_dir/sample_args.json`` (the settings, and each class sampled with its name). Files,
    rows and names follow the order of ``classes`` as given; drawn classes come in label order.

    Args:
        checkpoint: Path of a ``.ckpt`` written by ``moh fit`` with a ClassConditionalDiffusion model.
        out_dir: Folder for the outputs (created); one that holds anything already is refused unless ``overwrite``.
        num_samples: Number of images.
        classes: Conditioning classes, repeated in turn to ``num_samples``: names (``"[zero, seven]"``, the class
            folders the checkpoint was trained on) or numbers (``"[0, 7]"``; quote a name that is a number); drawn
            uniformly when omitted.
        cfg_scale: Classifier-free guidance scale (1 disables guidance); omitted: the checkpoint's ``cfg_scale``.
        sampler: ``ddpm`` (learned variance, ancestral) or ``ddim`` (deterministic); omitted: the checkpoint's.
        steps: Respaced sampling steps (DiT uses 250 DDPM steps); omitted: the checkpoint's ``sample_steps``.
        seed: Seed of the noise and of drawn classes.
        batch_size: Images sampled at once.
        vae: Hub id or local folder of the AutoencoderKL that decodes latents; omitted: the one the checkpoint's
            data module used, or none for pixel-space models.
        latent_scale: Latent scaling factor of that VAE (0.18215 for Stable Diffusion's).
        device: Torch device to sample on.
        overwrite: Write into an ``out_dir`` that holds files already, replacing those of the same names.
    """
    path = Path(checkpoint)
    if not path.is_file():
        raise SystemExit(f"moh sample: --checkpoint {checkpoint}: no such file; pass a .ckpt written by `moh fit`.")
    out = check_output_folder(out_dir, "--out_dir", overwrite)
    raw = read_checkpoint(path, ClassConditionalDiffusion, "sample")  # one line for anything but a DiT checkpoint
    task = ClassConditionalDiffusion.load_from_checkpoint(path, map_location=device, weights_only=True)
    task.eval()
    cfg_scale = task.hparams.cfg_scale if cfg_scale is None else cfg_scale
    sampler = sampler or task.hparams.sampler
    steps = steps or task.hparams.sample_steps
    if vae is None:
        data_hparams = raw.get("datamodule_hyper_parameters") or {}
        vae = data_hparams.get("vae")
        latent_scale = data_hparams.get("latent_scale", latent_scale)
    decoder = None
    if vae:
        from moh_lightning.data.latents import load_vae
        decoder = load_vae(vae, key="--vae").to(device).eval()

    names = task.hparams.get("class_names")
    generator = torch.Generator().manual_seed(seed)
    if classes:
        indices = [class_index(given, names, task.model.num_classes) for given in classes]
        labels = torch.tensor([indices[i % len(indices)] for i in range(num_samples)])
    else:
        labels = torch.randint(0, task.model.num_classes, (num_samples,), generator=generator)
    # The classes as asked (each once, in the order given; a class given twice keeps its first place).
    sampled = list(dict.fromkeys(labels.tolist())) if classes else sorted(set(labels.tolist()))
    with created_folder(out):
        _write_samples(task, labels, out, names, generator, decoder, latent_scale,
                       dict(cfg_scale=cfg_scale, sampler=sampler, steps=steps), batch_size, sampled)
        (out / "sample_args.json").write_text(json.dumps(
            dict(checkpoint=str(path), num_samples=num_samples, classes=classes, cfg_scale=cfg_scale,
                 sampler=sampler, steps=steps, seed=seed, vae=vae,
                 class_names={str(label): names[label] if names else None for label in sampled}), indent=2))
    shown = ", ".join(names[label] for label in sampled) if names else ", ".join(map(str, sampled))
    print(f"wrote {num_samples} samples of {shown} to {out}")
    return out


def _write_samples(task: ClassConditionalDiffusion, labels: torch.Tensor, out: Path, names: list[str] | None,
                   generator: torch.Generator, decoder, latent_scale: float, settings: dict, batch_size: int,
                   rows: list[int]) -> None:
    """One image per label, sampled with ``settings`` batch by batch: ``out/images/``, ``samples.npz``, ``grid.png``
    (a row per class of ``rows``, in that order)."""
    (out / "images").mkdir(exist_ok=True)
    arrays = []
    for start in tqdm(range(0, len(labels), batch_size), desc="batches"):
        x = task.sample(labels[start:start + batch_size], generator=generator, progress=True, **settings)
        if decoder is not None:
            with torch.no_grad():
                x = decoder.decode(x / latent_scale).sample
        arrays.append(to_uint8(x))
    images = np.concatenate(arrays)
    for i, (image, label) in enumerate(zip(images, labels.tolist(), strict=True)):
        suffix = f"_{names[label]}" if names else ""
        Image.fromarray(image).save(out / "images" / f"{i:06d}_c{label}{suffix}.png")
    np.savez(out / "samples.npz", arr_0=images, arr_1=labels.numpy())
    save_class_grid(images, labels.numpy(), out / "grid.png", rows=rows)


def class_index(given: int | str, names: list[str] | None, num_classes: int) -> int:
    """The label of a class given by number or by name (``names``, the checkpoint's class names, in label order)."""
    if isinstance(given, int) and not isinstance(given, bool):
        if not 0 <= given < num_classes:
            raise SystemExit(f"moh sample: --classes {given}: the model has classes 0 to {num_classes - 1}.")
        return given
    if names and given in names:
        return names.index(given)
    if not names:
        raise SystemExit(f"moh sample: --classes {given!r}: this checkpoint has no class names (trained on data "
                         f"without them); give class numbers 0 to {num_classes - 1}.")
    nearest = difflib.get_close_matches(str(given), names, n=1)
    hint = f" (did you mean {nearest[0]!r}?)" if nearest else ""
    raise SystemExit(f"moh sample: --classes {given!r} is not a class of this checkpoint{hint}; its classes are "
                     f"{', '.join(names)}.")


def save_class_grid(images: np.ndarray, labels: np.ndarray, path: Path, per_class: int = 10,
                    rows: list[int] | None = None) -> None:
    """PNG grid with one row per class of ``rows`` (each class in ``labels`` in label order when None), in that order,
    and up to ``per_class`` samples of it."""
    grid = []
    for label in np.unique(labels) if rows is None else rows:
        row = images[labels == label][:per_class]
        row = np.concatenate([row, np.zeros((per_class - len(row), *row.shape[1:]), np.uint8)])
        grid.append(np.concatenate(list(row), axis=1))
    Image.fromarray(np.concatenate(grid, axis=0)).save(path)


__all__ = ["class_index", "sample", "save_class_grid"]
