"""The house: floors imported only downwards, and the registries every task and model is tested through."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import moh_lightning
from moh_lightning.configs import shipped_configs
from moh_lightning.layers import MoHAttention, pop_load_balance_loss
from moh_lightning.tasks import TASKS, MoHTask

PACKAGE = Path(moh_lightning.__file__).parent

# layers <- models (and the diffusion maths, the data modules) <- tasks <- tools and callbacks <- cli (and the sweep,
# which drives the CLI, with its report).
FLOORS = {"configs": 0, "errors": 0, "outputs": 0, "value_checks": 0, "serialization": 0, "weights": 0,
          "lightning_compat": 0, "cli_errors": 0, "hf_configs": 0, "hub": 0, "cli_args": 1, "layers": 0, "models": 1,
          "diffusion": 1, "data": 1, "metrics": 1, "tasks": 2, "callbacks": 3, "tools": 3, "checkpoint_io": 3,
          "runs": 4, "settings": 4, "trainer_cli": 4, "cli_init_from": 4, "sweep": 4, "cli": 4}


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 and parts[0] == "moh_lightning" else None


def _imports(path: Path) -> set[str]:
    """Every ``moh_lightning`` module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("moh_lightning")}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out.append((".".join(["moh_lightning", *[p for p in parts if p != "__init__"]]), path))
    return out


def _module_graph() -> dict[str, set[str]]:
    """Module -> the suite's modules it imports: ``from package import module`` is an import of that module (the
    package's ``__init__`` runs before any of its modules, so it is no edge of its own)."""
    modules = dict(_modules())
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                edges |= submodules
                if len(submodules) < len(node.names):
                    edges.add(node.module)
            elif isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names} & modules.keys()
        graph[name] = edges - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while not group or group[-1] != node:
                        group.append(stack.pop())
                        on_stack.discard(group[-1])
                    if len(group) > 1:
                        circles.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def test_every_module_lives_on_a_floor():
    homeless = [name for name, _ in _modules() if name != "moh_lightning" and _floor(name) is None]
    assert homeless == []


def test_nothing_imports_up_the_house():
    upward = []
    for name, path in _modules():
        floor = _floor(name)
        if name == "moh_lightning":  # the package re-exports the MoH block and registers the named models with timm
            floor = FLOORS["models"]
        for imported in _imports(path):
            if (_floor(imported) or 0) > floor:
                upward.append(f"{name} imports {imported}")
    assert upward == []


def test_no_modules_import_each_other_in_a_circle():
    assert _circles(_module_graph()) == []


# Every sub-package of models/ is a family; its modules (``registry``, ``decoding``) are what families share.
FAMILIES = tuple(sorted(path.parent.name for path in (PACKAGE / "models").glob("*/__init__.py")))


def test_model_families_stand_apart():
    """A model family imports no other family; what they share stands beside them as a module of ``models``."""
    assert {"vit", "transnext", "dit", "llama", "hf_causal"} <= set(FAMILIES)
    crossing = []
    for name, edges in _module_graph().items():
        family = name.split(".")[2] if name.startswith("moh_lightning.models.") else None
        if family in FAMILIES:
            crossing += [f"{name} imports {other}" for other in edges
                         if other.startswith("moh_lightning.models.") and other.split(".")[2] in FAMILIES
                         and other.split(".")[2] != family]
    assert crossing == []


def test_nothing_beside_the_models_imports_one():
    """data/, diffusion/ and metrics/ share the models' floor, so the floor test cannot see them import a model: what
    they share with one lives below (``hf_configs`` for the tokenizers)."""
    beside = {name for name, floor in FLOORS.items() if floor == FLOORS["models"] and name != "models"}
    found = [f"{name} imports {imported}" for name, path in _modules() if name.partition(".")[2].split(".")[0] in beside
             for imported in _imports(path) if imported.startswith("moh_lightning.models")]
    assert found == []


# tools/ holds commands, which sit on the callbacks' floor: an import of one by a library module is a tangle the floors
# cannot see (what a callback and a command share lives below them, as metrics/ does for the FID).
def test_no_library_module_imports_a_command():
    found = {f"{name} imports {imported}" for name, path in _modules() if not name.startswith("moh_lightning.tools")
             for imported in _imports(path) if imported.startswith("moh_lightning.tools")}
    assert found == set()


def test_every_task_has_a_shipped_config():
    classes = {name: cls for name, cls in TASKS.items()}
    assert all(issubclass(cls, MoHTask) for cls in classes.values())
    configs = " ".join((PACKAGE.parent / "cli_configs" / "recipes" / p.name).read_text()
                       for p in (PACKAGE.parent / "cli_configs" / "recipes").glob("*.yaml"))
    assert all(f"moh_lightning.tasks.{cls.__name__}" in configs for cls in classes.values())
    assert len(shipped_configs()) >= len(TASKS)


# Named models are the shipped experiment configs; those small enough for this CPU train a step here.
SMALL = ["vit_tiny_mnist_75.yaml", "vit_tiny_mnist_50.yaml", "vit_tiny_mnist_100.yaml", "dit_mnist_90.yaml",
         "dit_mnist_75.yaml", "dit_mnist_100.yaml", "llm_stdlib_75.yaml", "llm_stdlib_50.yaml", "llm_stdlib_100.yaml",
         "moh_transnext_mnist_75.yaml"]


def _task(name: str) -> MoHTask:
    from moh_lightning.trainer_cli import MoHLightningCLI
    cli = MoHLightningCLI(args=["--config", name, "--trainer.logger", "false"], run=False)
    task = cli.model
    if task.model is None:
        task.configure_model()
    return task


def _forward(task: MoHTask) -> torch.Tensor:
    """The network's output on a small random input of the shape its config declares."""
    net = task.model
    if task.head_load_group_name == "source":
        return net(torch.randint(0, net.config.vocab_size, (2, 32)))
    if hasattr(net, "config"):  # DiT
        size = net.config.input_size
        return net(torch.randn(2, net.config.in_chans, size, size), torch.tensor([3, 900]), torch.tensor([1, 2]))
    return net(torch.randn(2, net.patch_embed.proj.in_channels, *net.patch_embed.img_size))


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.slow
def test_named_model_forward_and_backward_are_finite(name):
    torch.manual_seed(0)
    task = _task(name).train()
    out = _forward(task)
    loss = out.float().pow(2).mean()
    balance = pop_load_balance_loss(task.model)
    if balance is not None:
        loss = loss + balance
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in task.model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in task.model.parameters() if p.grad is not None)
    routed = [m for m in task.modules() if isinstance(m, MoHAttention) and m.is_moh]
    assert ("100" in name) == (not routed)


def test_every_package_and_shipped_config_is_in_the_wheel():
    """pyproject lists the packages (the shipped configs install as a mapped package that find cannot discover): a new
    subpackage or config folder missing from it would install without it and fail only for pip users."""
    import tomllib
    from setuptools import find_packages

    root = PACKAGE.parent
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = find_packages(str(root), include=["moh_lightning*"])
    assert set(setup["packages"]) == {*found, "moh_lightning.cli_configs"}
    patterns = setup["package-data"]["moh_lightning.cli_configs"]
    shipped = {p.relative_to(root / "cli_configs") for p in (root / "cli_configs").rglob("*") if p.is_file()
               and "__pycache__" not in p.parts}
    assert shipped == {p for p in shipped if any(p.match(pattern) and len(p.parts) == len(Path(pattern).parts)
                                                 for pattern in patterns)}


def test_no_test_module_imports_another():
    """Shared test helpers live in conftest.py or a helpers module: importing a test module runs its collection-time
    code twice and ties one file's tests to another's internals."""
    tests = Path(__file__).resolve().parent
    for path in [*tests.rglob("test_*.py"), *(tests.parent / "benchmarks" / "tests").rglob("test_*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.rsplit(".", 1)[-1].startswith("test_") for name in names), (
                f"{path.relative_to(tests.parent)} imports a test module ({names}); share through a helpers module")
