"""``moh load-authors-dit``: the authors' MoH-DiT (SkyworkAI/MoH ``MoH-DiT/models.py``) as a checkpoint ``moh sample``
reads, with their FID sampling protocol as its defaults.

The layout conversion and the check that their gates are the suite's are ``moh_lightning.models.dit.weights``.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from moh_lightning.configs import load_config
from moh_lightning.models.dit import DiTConfig, load_authors_weights, read_state_dict
from moh_lightning.outputs import check_output_file
from moh_lightning.tasks.checkpoints import one_line_errors, write_checkpoint
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion

#: The authors' released MoH-DiT: hub repo and the shipped experiment config that is the same network.
AUTHORS_DIT = {"MoH-DiT-XL/2-90": {"hub": "Chat-UniVi/MoH-DiT-XL-90", "experiment": "dit_xl2_90.yaml"}}
#: Sampling as their FID evaluation (``sample_ddp.py``): 250 DDPM steps, guidance 1.5 on 3 of the 4 latent channels.
AUTHORS_SAMPLING = {"sampler": "ddpm", "sample_steps": 250, "cfg_scale": 1.5, "cfg_channels": 3}


def experiment_init_args(experiment: str) -> dict:
    """The merged ``model`` / ``data`` sections of an experiment config, the configs it ``extends`` first (resolved as
    ``moh fit --config`` resolves it: a file, else the shipped config of that name)."""
    return load_config(experiment)


def load_authors_dit_tool(
        source: str = AUTHORS_DIT["MoH-DiT-XL/2-90"]["hub"],
        out: str = "authors_dit.ckpt",
        experiment: str = AUTHORS_DIT["MoH-DiT-XL/2-90"]["experiment"],
        cfg_scale: float = AUTHORS_SAMPLING["cfg_scale"],
        cfg_channels: int | None = AUTHORS_SAMPLING["cfg_channels"],
        overwrite: bool = False,
) -> Path:
    """Loads the authors' MoH-DiT into the suite's DiT and writes a checkpoint ``moh sample`` reads.

    Sampling defaults are the authors' FID protocol (``sample_ddp.py``): 250 DDPM steps, guidance 1.5 on 3 of the 4
    latent channels, SD-VAE ``ft-ema``; ``moh sample`` options override them.

    Args:
        source: Their weights: a ``.pt`` file (a state dict or a ``train.py`` checkpoint, whose EMA is used), a hub
            repo id, or ``owner/name/file``.
        out: The checkpoint to write; refused when it exists, unless ``overwrite``.
        experiment: The experiment config of the same network (``dit_xl2_90.yaml`` for MoH-DiT-XL/2-90).
        cfg_scale: Default classifier-free guidance of ``moh sample``.
        cfg_channels: Latent channels guided by default (their code guides 3; None guides all).
        overwrite: Replace an ``out`` that exists.
    """
    check_output_file(out, "--out", overwrite)
    with one_line_errors("load-authors-dit"):
        config = experiment_init_args(experiment)
    model_section, data_section = config.get("model") or {}, config.get("data") or {}
    if not str(model_section.get("class_path", "")).endswith("ClassConditionalDiffusion"):
        raise SystemExit(f"moh load-authors-dit: --experiment {experiment}: not a diffusion experiment "
                         f"(model.class_path {model_section.get('class_path')!r}).")
    init_args = dict(model_section.get("init_args") or {})
    arch = DiTConfig(**init_args.pop("arch", {}))
    hparams = {**init_args, "sampler": AUTHORS_SAMPLING["sampler"], "sample_steps": AUTHORS_SAMPLING["sample_steps"],
               "cfg_scale": cfg_scale, "cfg_channels": cfg_channels}
    with one_line_errors("load-authors-dit"):
        state = read_state_dict(source)  # before building the model: a bad source stops at once
        task = ClassConditionalDiffusion(arch, **hparams)
        load_authors_weights(task.model, state)
    data_hparams = {**(data_section.get("init_args") or {}),
                    "provenance": f"The authors' MoH-DiT weights {source} (SkyworkAI/MoH), loaded by "
                                  f"`moh load-authors-dit` as {Path(experiment).name}."}
    path = write_checkpoint(out, ClassConditionalDiffusion, {"arch": asdict(arch), **hparams}, task.state_dict(),
                            data_hparams)
    print(f"wrote {path}: the authors' weights as {Path(experiment).name} ({arch.activated_fraction:.1%} of heads "
          f"active); sample with `moh sample --checkpoint {path}`")
    return path


__all__ = ["AUTHORS_DIT", "AUTHORS_SAMPLING", "experiment_init_args", "load_authors_dit_tool"]
