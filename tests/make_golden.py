"""Writes the golden files of ``tests/data``: the authors' own code run on tiny random-weight models.

The tests compare the suite against these files, so they never need the authors' repositories; this script does. It
takes a local clone of each reference, imports its files from there (nothing of theirs is copied into the project)
and records inputs, weights and outputs in ``tests/data/golden_<name>.safetensors``, with the repository, its commit,
the files run, the command and every patch applied in the file's metadata:

    python tests/make_golden.py diffusion --repo <clone of facebookresearch/DiT>
    python tests/make_golden.py inception-score --repo <clone of openai/guided-diffusion>
    python tests/make_golden.py moh-dit --repo <clone of SkyworkAI/MoH>
    python tests/make_golden.py moh-vit --repo <clone of SkyworkAI/MoH>
    python tests/make_golden.py transnext --repo <clone of DaiShiResearch/TransNeXt>
    PYTHONPATH=<transformers 4.44.2> python tests/make_golden.py moh-llama --repo <clone of SkyworkAI/MoH>

MoH-LLaMA3's modelling file imports transformers internals of its time (``is_torch_fx_available``,
``Cache.get_usable_length``) that transformers 5 removed: install ``transformers==4.44.2 tokenizers==0.19.1
huggingface_hub==0.24.6`` with ``pip install --target <folder> --no-deps`` and put that folder first on PYTHONPATH for
that command only. Every other command runs in the project's environment, on CPU, in fp32 unless stated.

Weights and float inputs are drawn at random and rounded to fp16 values, stored as fp16 (half the bytes) and cast to
fp32 before either code base uses them, so both compute on exactly the same numbers.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

DATA = Path(__file__).parent / "data"

# The tiny networks, in the authors' parametrisation. Each covers every router layout their code has: all heads
# shared, shared + routed, routed only, and top-k equal to the routed count (their code still counts a loss there).
MOH_DIT = {"input_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 32, "num_classes": 5, "head_dim": 8,
           "num_heads": [2, 4, 6, 6, 4], "shared_head": [2, 4, 4, 0, 2], "routed_head": [0, 0, 1, 2, 2]}
MOH_VIT = {"img": 64, "dims": [8, 24, 32, 32], "heads": [2, 6, 4, 4], "depths": [1, 1, 2, 1], "mlp": [4, 4, 2, 2],
           "sr": [8, 4, 2, 1], "shared": [2, 2, 0, 2], "routed": [0, 2, 2, 2], "classes": 5}
LLAMA = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 259, "max_position_embeddings": 64, "rope_theta": 5000.0,
         "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False}


def commit_of(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def fp16_values(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest fp16 value, kept in fp32 (what is stored is exactly what is computed on)."""
    return t.half().float()


def randomise(state: dict[str, torch.Tensor], seed: int, keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Random values for every float tensor but ``keep``, scaled so each term of the network matters: matrices
    N(0, 1/fan_in) (routers' logits of unit scale, so top-k choices vary by token), norm gains 1 + N(0, 0.01),
    TransNeXt's temperatures 1 + N(0, 0.09), other vectors N(0, 0.01)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state.items():
        if name in keep or not value.is_floating_point():
            out[name] = value
            continue
        t = torch.randn(value.shape, generator=generator)
        if value.dim() == 1 and "norm" in name.rsplit(".", 2)[-2] and name.endswith("weight"):
            t = 1 + 0.1 * t
        elif name.endswith("temperature"):
            t = 1 + 0.3 * t
        elif value.dim() >= 2:
            t = t / math.sqrt(max(math.prod(value.shape[1:]), 1))
        else:
            t = 0.1 * t
        out[name] = fp16_values(t)
    return out


@contextmanager
def captured_gates():
    """Every head-gate tensor their attention layers multiply the heads by, in call order.

    Their MoH layers (ViT, DiT, LLaMA3) all gate with ``torch.einsum("bne,bned->bned", gates, heads)``; this spies on
    that call and returns their own (B, N, h) gates, nothing re-computed."""
    gates, einsum = [], torch.einsum

    def spy(equation, *operands):
        if equation == "bne,bned->bned":
            gates.append(operands[0].detach().float().clone())
        return einsum(equation, *operands)

    torch.einsum = spy
    try:
        yield gates
    finally:
        torch.einsum = einsum


def import_file(name: str, path: Path) -> types.ModuleType:
    """Their file as a module of its own name (their ``models.py`` must not meet this folder's ``models.py``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stub_pkg_resources() -> str:
    """TransNeXt's files ask ``pkg_resources`` whether the CUDA package ``swattention`` is installed; the environment
    has no ``pkg_resources``, so a stub says it is not, and their native PyTorch attention runs."""
    module = types.ModuleType("pkg_resources")

    class DistributionNotFound(Exception):
        pass

    def get_distribution(name):
        raise DistributionNotFound(name)

    module.DistributionNotFound, module.get_distribution = DistributionNotFound, get_distribution
    sys.modules["pkg_resources"] = module
    return "pkg_resources stubbed (get_distribution raises DistributionNotFound): their native attention runs"


def write(name: str, tensors: dict[str, torch.Tensor], repo: Path, files: list[str], command: str,
          patches: list[str], spec: dict | None = None, **extra: str) -> None:
    metadata = {"source": f"{repo_name(repo)}@{commit_of(repo)}", "files": ", ".join(files),
                "command": f"python tests/make_golden.py {command}", "patches": "; ".join(patches) or "none",
                "versions": f"torch {torch.__version__}" + "".join(f", {m} {sys.modules[m].__version__}" for m in
                                                                  ("timm", "transformers") if m in sys.modules),
                **extra}
    if spec is not None:
        metadata["spec"] = json.dumps(spec)
    DATA.mkdir(exist_ok=True)
    path = DATA / f"golden_{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB) from {metadata['source']}")


def repo_name(repo: Path) -> str:
    url = subprocess.run(["git", "-C", str(repo), "config", "--get", "remote.origin.url"], capture_output=True,
                         text=True).stdout.strip()
    for known in ("SkyworkAI/MoH", "facebookresearch/DiT", "openai/guided-diffusion", "DaiShiResearch/TransNeXt"):
        if known.replace("/", "+") in url or known in url:
            return known
    return repo.name


# ---- DiT's training loss (diffusion/gaussian_diffusion.py) ---------------------------------------------------------

def diffusion(repo: Path) -> None:
    """DiT's ``training_losses`` (``create_diffusion("")``: 1000 steps, learned range variance, loss type MSE) on a
    fixed model output, for its linear and squaredcos_cap_v2 schedules: x_t, mse, vb, loss and the gradient of
    sum(loss) with respect to the model output (the bound term must not train the noise prediction)."""
    sys.path.insert(0, str(repo))
    from diffusion import create_diffusion

    generator = torch.Generator().manual_seed(0)
    # Data on the 256 levels of 8-bit images, both edges included (the decoder's edge bins); t = 0 three times.
    x0 = torch.randint(0, 256, (8, 2, 4, 4), generator=generator).float() / 127.5 - 1
    x0[0, 0, 0] = -1.0
    x0[1, 0, 0] = 1.0
    t = torch.tensor([0, 0, 0, 1, 2, 10, 500, 999])
    noise = fp16_values(torch.randn(x0.shape, generator=generator))
    eps = fp16_values(noise + 0.3 * torch.randn(x0.shape, generator=generator))
    var = fp16_values(torch.rand(x0.shape, generator=generator) * 2 - 1)
    var[2] = -1.0                                      # t = 0 at the clipped posterior variance itself
    tensors = {"x0": x0, "t": t, "noise": noise.half(), "model_output": torch.cat([eps, var], 1).half()}
    for schedule in ("linear", "squaredcos_cap_v2"):
        gd = create_diffusion("", noise_schedule=schedule)
        output = torch.cat([eps, var], 1).requires_grad_(True)
        terms = gd.training_losses(lambda x, ts, r=output: r, x0, t, noise=noise)
        terms["loss"].sum().backward()
        tensors |= {f"{schedule}.x_t": gd.q_sample(x0, t, noise=noise), f"{schedule}.grad": output.grad,
                    **{f"{schedule}.{key}": terms[key].detach() for key in ("mse", "vb", "loss")}}
    write("diffusion", tensors, repo, ["diffusion/__init__.py", "diffusion/gaussian_diffusion.py",
                                       "diffusion/respace.py", "diffusion/diffusion_utils.py"], "diffusion",
          [], note="model = lambda returning model_output; training_losses(model, x0, t, noise=noise)")


# ---- ADM's Inception Score (evaluations/evaluator.py) --------------------------------------------------------------

def inception_score(repo: Path) -> None:
    """ADM's ``Evaluator.compute_inception_score`` (5,000-sample splits, the last one partial) on fixed logits, at
    N = 3,000, 5,000 and 7,000 (the first N rows). Confident predictions over 4 classes in the first 5,000 rows and
    over 6 others, less confident, in the last 2,000: equal splits of 7,000 would score otherwise."""
    for name in ("tensorflow", "tensorflow.compat", "tensorflow.compat.v1"):
        sys.modules[name] = types.ModuleType(name)
    sys.path.insert(0, str(repo / "evaluations"))
    from evaluator import Evaluator

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7000, 10, generator=generator)
    rows = torch.arange(7000)
    labels = torch.where(rows < 5000, rows % 4, 4 + rows % 6)
    logits[rows, labels] += torch.where(rows < 5000, 6.0, 2.5)
    logits = fp16_values(logits)

    class Session:
        """Their TF graph is softmax(pool features @ W); fed the logits themselves (W = identity), in float32."""

        @staticmethod
        def run(softmax, feed_dict):
            x = next(iter(feed_dict.values())).astype(np.float32)
            e = np.exp(x - x.max(1, keepdims=True))
            return e / e.sum(1, keepdims=True)

    evaluator = Evaluator.__new__(Evaluator)
    evaluator.sess, evaluator.softmax, evaluator.softmax_input, evaluator.softmax_batch_size = Session(), None, 0, 512
    scores = {f"is_{n}": torch.tensor(evaluator.compute_inception_score(logits[:n].numpy()), dtype=torch.float64)
              for n in (3000, 5000, 7000)}
    write("inception_score", {"logits": logits.half(), **scores}, repo, ["evaluations/evaluator.py"],
          "inception-score", ["tensorflow stubbed as an empty module (only the IS function runs)",
                              "Evaluator built without __init__; its TF session replaced by a float32 numpy softmax "
                              "of the fed logits (their graph: softmax of pool features @ W, here W = identity)"])


# ---- MoH-DiT (MoH-DiT/models.py) -----------------------------------------------------------------------------------

def moh_dit(repo: Path) -> None:
    """Their MoH-DiT at tiny size: eval forward and gates, forward_with_cfg (scale 4), and in train mode the
    per-layer load-balance losses (``MoHAttention.LOAD_BALANCING_LOSSES``) and DiT's training loss terms."""
    sys.path.insert(0, str(repo / "MoH-DiT"))
    models = import_file("authors_moh_dit_models", repo / "MoH-DiT" / "models.py")
    from diffusion import create_diffusion

    m = MOH_DIT
    model = models.DiT(input_size=m["input_size"], patch_size=m["patch_size"], in_channels=m["in_channels"],
                       hidden_size=m["hidden_size"], depth=len(m["num_heads"]), num_heads=m["num_heads"],
                       num_classes=m["num_classes"], moh=True, shared_head=m["shared_head"],
                       routed_head=m["routed_head"], head_dim=[m["head_dim"]] * len(m["num_heads"]))
    state = randomise(model.state_dict(), seed=0, keep=("pos_embed",))
    model.load_state_dict(state)
    generator = torch.Generator().manual_seed(1)
    x = fp16_values(torch.randn(3, 4, 8, 8, generator=generator))
    t, y = torch.tensor([3, 500, 999]), torch.tensor([0, 4, 2])
    model.eval()
    with torch.no_grad(), captured_gates() as gates:
        out = model(x, t, y)
    with torch.no_grad():
        guided = model.forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]),
                                        torch.cat([y, torch.full_like(y, m["num_classes"])]), 4.0)[:3]
    model.train()
    model.y_embedder.dropout_prob = 0.0
    models.MoHAttention.LOAD_BALANCING_LOSSES.clear()
    gd = create_diffusion("")
    x0 = fp16_values(torch.randn(3, 4, 8, 8, generator=generator))
    noise = fp16_values(torch.randn(3, 4, 8, 8, generator=generator))
    terms = gd.training_losses(model, x0, t, dict(y=y), noise=noise)
    balance = torch.stack([loss.detach() for loss in models.MoHAttention.LOAD_BALANCING_LOSSES])
    # Their pos_embed is the fixed sin-cos table, kept in fp32 (the loader checks it against the suite's).
    tensors = {**{f"weights.{k}": v if k == "pos_embed" else v.half() for k, v in state.items()}, "x": x.half(),
               "t": t, "y": y, "out": out, "guided": guided, **{f"gates.{i}": g for i, g in enumerate(gates)},
               "train.x0": x0.half(), "train.noise": noise.half(), "train.x_t": gd.q_sample(x0, t, noise=noise),
               "train.balance_losses": balance,
               **{f"train.{key}": terms[key].detach() for key in ("mse", "vb", "loss")}}
    write("moh_dit", tensors, repo, ["MoH-DiT/models.py", "MoH-DiT/diffusion/"], "moh-dit",
          ["train mode with y_embedder.dropout_prob = 0 (their label dropout draws at random)",
           "gates read by spying on torch.einsum('bne,bned->bned', gates, heads)"], spec=m,
          guided_note="forward_with_cfg on the doubled batch (null class 5), scale 4.0, first half kept",
          balance_note="one loss per layer with routed heads, their order; the train.* terms are "
                       "training_losses(model, train.x0, t, dict(y=y), noise=train.noise), whose noised input is "
                       "train.x_t")


# ---- MoH-ViT (MoH-ViT/transnext.py) and TransNeXt (classification/transnext.py) -----------------------------------

def _transnext(module: types.ModuleType, spec: dict, moh: bool):
    from functools import partial

    kwargs = dict(shared_head=spec["shared"], routed_head=spec["routed"]) if moh else {}
    return module.TransNeXt(img_size=spec["img"], window_size=[3, 3, 3, None], patch_size=4,
                            embed_dims=spec["dims"], num_heads=spec["heads"], mlp_ratios=spec["mlp"], qkv_bias=True,
                            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6), depths=spec["depths"],
                            sr_ratios=spec["sr"], num_classes=spec["classes"], **kwargs)


def moh_vit(repo: Path) -> None:
    """Their MoH-TransNeXt at tiny size: eval logits and gates; train-mode logits and per-layer load-balance losses
    (``Attention.LOAD_BALANCING_LOSSES``, whose mean times 0.01 their engine.py adds to the loss)."""
    patch = stub_pkg_resources()
    sys.path.insert(0, str(repo / "MoH-ViT"))
    transnext = import_file("transnext", repo / "MoH-ViT" / "transnext.py")
    attention = sys.modules["attention"]
    model = _transnext(transnext, MOH_VIT, moh=True)
    state = randomise(model.state_dict(), seed=0)
    model.load_state_dict(state)
    images = fp16_values(torch.randn(2, 3, MOH_VIT["img"], MOH_VIT["img"], generator=torch.Generator().manual_seed(1)))
    model.eval()
    with torch.no_grad(), captured_gates() as gates:
        logits = model(images)
    model.train()
    attention.Attention.LOAD_BALANCING_LOSSES.clear()
    with torch.no_grad():
        train_logits = model(images)
    balance = torch.stack([loss.detach() for loss in attention.Attention.LOAD_BALANCING_LOSSES])
    tensors = {**{f"weights.{k}": v.half() for k, v in state.items()}, "images": images.half(), "logits": logits,
               **{f"gates.{i}": g for i, g in enumerate(gates)}, "train.logits": train_logits,
               "train.balance_losses": balance}
    write("moh_vit", tensors, repo, ["MoH-ViT/transnext.py", "MoH-ViT/attention.py", "MoH-ViT/attention_native.py"],
          "moh-vit", [patch, "gates read by spying on torch.einsum('bne,bned->bned', gates, heads)"], spec=MOH_VIT,
          balance_note="one loss per block with routed heads, their order (top-k = routed count included)")


def transnext(repo: Path) -> None:
    """TransNeXt's dense network (the MoH-ViTs' baseline) at tiny size: eval logits."""
    patch = stub_pkg_resources()
    sys.path.insert(0, str(repo / "classification"))
    module = import_file("transnext", repo / "classification" / "transnext.py")
    spec = {key: value for key, value in MOH_VIT.items() if key not in ("shared", "routed")}
    model = _transnext(module, spec, moh=False)
    state = randomise(model.state_dict(), seed=0)
    model.load_state_dict(state)
    images = fp16_values(torch.randn(2, 3, spec["img"], spec["img"], generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        logits = model.eval()(images)
    write("transnext", {**{f"weights.{k}": v.half() for k, v in state.items()}, "images": images.half(),
                        "logits": logits}, repo, ["classification/transnext.py", "classification/attention_native.py"],
          "transnext", [patch], spec=spec)


# ---- MoH-LLaMA3 (MoH-LLaMA3/Inference_code/modeling_llama.py) -----------------------------------------------------

def moh_llama(repo: Path) -> None:
    """Their MoH-LLaMA3 at tiny size (their hard-coded budget: 4 shared + top-2 of 4 routed of 8 heads): logits,
    per-layer {0, 1} head gates and the queries their router scores, in fp32 and in bf16 (weights and activations in
    bf16, as their release runs), and their training loss with the ``l_aux`` their model returns."""
    import transformers
    from transformers import LlamaConfig

    if not transformers.__version__.startswith("4."):
        raise SystemExit(f"transformers {transformers.__version__}: their modelling file needs 4.x (see the module "
                         f"docstring: PYTHONPATH=<transformers 4.44.2>).")
    module = import_file("authors_modeling_llama", repo / "MoH-LLaMA3" / "Inference_code" / "modeling_llama.py")
    config = LlamaConfig(**LLAMA, torch_dtype="float32")
    config._attn_implementation = "sdpa"
    model = module.LlamaForCausalLM(config)
    state = randomise(model.state_dict(), seed=0)
    model.load_state_dict(state)
    idx = torch.randint(3, LLAMA["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    tensors = {**{f"weights.{k}": v.half() for k, v in state.items()}, "idx": idx}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        model = model.to(dtype).eval()
        queries = []  # each layer's q_proj output, the router's input, kept for bf16 (fp32 is the suite's own)
        hooks = [layer.self_attn.q_proj.register_forward_hook(
            lambda mod, args, out, kept=queries: kept.append(out.detach()))
            for layer in model.model.layers] if dtype == torch.bfloat16 else []
        with torch.no_grad(), captured_gates() as gates:
            tensors[f"{name}.logits"] = model(idx).logits.float()
        for hook in hooks:
            hook.remove()
        tensors |= {f"{name}.gates.{i}": g for i, g in enumerate(gates)}
        tensors |= {f"{name}.queries.{i}": q for i, q in enumerate(queries)}
    # Their training loss is cross-entropy + 0.01 * l_aux, and l_aux is the mean of the layers' losses: none of their
    # layers computes one (each returns None), so it is the empty mean, 0.
    model = model.float().train()
    with torch.no_grad():
        output = model(idx, labels=idx)
        tensors["train.l_aux"] = torch.as_tensor(model.model(idx).l_aux, dtype=torch.float32).reshape(())
    tensors["train.loss"] = output.loss
    tensors["train.cross_entropy"] = torch.nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1),
                                                                       idx[:, 1:].flatten())
    write("moh_llama", tensors, repo, ["MoH-LLaMA3/Inference_code/modeling_llama.py"], "moh-llama",
          ["transformers 4.44.2 (their file's API) instead of the project's 5.x",
           "built from LlamaConfig with _attn_implementation='sdpa' (their LlamaSdpaAttention)",
           "gates read by spying on torch.einsum('bne,bned->bned', mask, heads)"], spec=LLAMA)


COMMANDS = {"diffusion": diffusion, "inception-score": inception_score, "moh-dit": moh_dit, "moh-vit": moh_vit,
            "transnext": transnext, "moh-llama": moh_llama}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--repo", type=Path, required=True, help="local clone of the reference repository")
    args = parser.parse_args()
    torch.set_num_threads(1)
    COMMANDS[args.command](args.repo.resolve())
