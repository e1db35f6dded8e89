"""LoRA (`model.lora`) as every stage sees it: peft's config from the spec, the model's linear layers (for
`factory check`), and the adapter tensors a weight sync carries.

An adapter of a linear layer `W` [out, in] is `B` [out, r] @ `A` [r, in] scaled by alpha / r, W frozen
(peft's LoRA). The learner trains A and B only; what reaches a rollout engine after each update is the
adapter tensors (`Adapters`), named as peft saves them (`base_model.model.<module>.lora_A.weight`), which
the transformers engine loads into its own peft model and vLLM either serves as a LoRA adapter or merges
into its weights (factory.rollout.engine_vllm says which and why).

Sits at the bottom of the package with the schema: the compiler, the learner and the engines import it.
torch, transformers and peft are imported inside the functions that need them.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from factory.schema import LoraSpec

ALL_LINEAR = "all-linear"
# peft saves an adapter's tensors under these names: base_model.model.<module path>.lora_A.weight
PEFT_PREFIX = "base_model.model."
# the largest rank vLLM serves adapters of (its LoRAConfig.max_lora_rank: 1, 8, 16, ..., 320, 512); above it a
# vLLM rollout merges them (factory.rollout.engine.vllm_lora_mode)
VLLM_MAX_LORA_RANK = 512


def scale(spec: LoraSpec) -> float:
    """alpha / r: how much of B @ A is added to W."""
    return alpha(spec) / spec.r


def alpha(spec: LoraSpec) -> float:
    """The spec's alpha, or 2 r when unset."""
    return float(spec.alpha) if spec.alpha is not None else 2.0 * spec.r


def peft_config(spec: LoraSpec) -> Any:
    """peft's LoraConfig for a spec's `model.lora`."""
    from peft import LoraConfig

    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    return LoraConfig(r=spec.r, lora_alpha=alpha(spec), lora_dropout=spec.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


def model_config(folder: str | Path) -> dict[str, Any] | None:
    """A model folder's config.json as a dict (None when it is not on disk)."""
    f = Path(folder) / "config.json"
    return json.loads(f.read_text()) if f.is_file() else None


def linear_layers(folder: str | Path) -> list[str] | None:
    """Module paths of the model's linear layers other than the output head (what `all-linear` targets),
    from its config alone: the model is built on the meta device (no weights read, no memory). None when
    the folder has no config."""
    layers = _layouts(folder)
    return None if layers is None else list(layers)


def ships_causal_lm(config: dict[str, Any]) -> bool:
    """Whether the installed transformers builds this config's model from its own classes: no remote code
    (`auto_map`) and a model_type its AutoModelForCausalLM has a class for. Told without importing
    transformers (which imports torch: seconds); False where it cannot be told that way."""
    types = _causal_lm_model_types()
    return "auto_map" not in config and types is not None and config.get("model_type") in types


@functools.cache
def _causal_lm_model_types() -> frozenset[str] | None:
    """The model_types in the installed transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, a literal in its
    models/auto/modeling_auto.py, read from that source; None where transformers is not installed or keeps
    the mapping elsewhere."""
    found = importlib.util.find_spec("transformers")  # finds the package without running its __init__
    if found is None or not found.submodule_search_locations:
        return None
    source = Path(found.submodule_search_locations[0]) / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args
                and [getattr(t, "id", None) for t in node.targets] == ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"]):
            try:
                return frozenset(model_type for model_type, _ in ast.literal_eval(node.value.args[0]))
            except (ValueError, TypeError, SyntaxError):
                return None
    return None


def _layouts(folder: str | Path) -> dict[str, bool] | None:
    """`linear_layers`, each with whether its weight is stored [in, out]: transformers' Conv1D (GPT-2 and its
    family), which peft adapts as a linear layer (`fan_in_fan_out`) and `all-linear` includes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    if model_config(folder) is None:
        return None
    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    return {name: isinstance(m, Conv1D) for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}


def target_problem(targets: list[str] | str, layers: list[str]) -> str | None:
    """What is wrong with `model.lora.target_modules` for a model whose linear layers are `layers` (module
    paths), as peft matches them: a name matches a module whose path is that name or ends in `.name`."""
    if isinstance(targets, str):
        return None if targets == ALL_LINEAR else f"{targets!r}: give a list of module names or {ALL_LINEAR!r}"
    if not targets:
        return f"no module named: give at least one (the model's linear layers: {', '.join(short_names(layers))})"
    missing = [t for t in targets if not any(p == t or p.endswith("." + t) for p in layers)]
    if not missing:
        return None
    from factory.presets import did_you_mean

    names = short_names(layers)
    hints = []
    for t in missing:
        if t.rsplit(".", 1)[-1] == "lm_head":  # a linear layer, but not one of those adapted
            hints.append(f"{t!r} (the output head, which Factory does not adapt: vLLM's LoRA layers do not take it)")
            continue
        # (not a name the list holds already: `[q_proj, qkv_proj]` -> q_proj was no help)
        hints.append(f"{t!r}{did_you_mean(t.rsplit('.', 1)[-1], [n for n in names if n not in targets])}")
    return (f"{', '.join(hints)} {'matches' if len(missing) == 1 else 'match'} no linear layer of the model; "
            f"its linear layers: {', '.join(names)}")


def targeted(targets: list[str] | str, layers: list[str]) -> frozenset[str]:
    """The module paths of `layers` that `model.lora.target_modules` adapts, as peft matches them: all of
    them for `all-linear`, else those whose path is a name or ends in `.name` (so `all-linear` and a list
    of every linear layer's name adapt the same modules)."""
    if isinstance(targets, str):
        return frozenset(layers) if targets == ALL_LINEAR else frozenset()
    return frozenset(p for p in layers if any(p == t or p.endswith("." + t) for t in targets))


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # in a peft adapter folder, beside adapter_config.json


def adapter_misfit(folder: Path, spec: LoraSpec | None, base: str | Path) -> str | None:
    """Why the peft adapter folder `folder` (a LoRA checkpoint's `adapter/`, `export --adapter`'s output) can
    not be added beside the base model folder `base` by a rollout built for `spec` (a spec's `model.lora`), as
    a run's weight syncs add its adapters; None when it can: the same rank, alpha and adapted modules, and,
    where the adapters' own base model is a folder here, that folder."""
    if spec is None:
        return "the spec sets no model.lora"
    config = json.loads((folder / "adapter_config.json").read_text())
    if not (folder / ADAPTER_WEIGHTS).is_file():
        return f"no {ADAPTER_WEIGHTS} in {folder}"
    layouts = _layouts(base)
    # a run's own: peft sets fan_in_fan_out where the adapted layers are Conv1D (their weights stored [in, out])
    conv1d = any(layouts[m] for m in targeted(spec.target_modules, list(layouts))) if layouts else None
    options = _options_set(config, conv1d)
    if config.get("peft_type") != "LORA" or options:
        return f"peft options a run's rollout never sets ({', '.join(options) or config.get('peft_type')})"
    own_alpha = float(config.get("lora_alpha") or 0)
    if (config.get("r"), own_alpha) != (spec.r, alpha(spec)):
        return (f"rank {config.get('r')} and alpha {own_alpha:g}, where the spec's model.lora has {spec.r} and "
                f"{alpha(spec):g}")
    own = config.get("base_model_name_or_path")
    if own and Path(own).is_dir() and Path(own).resolve() != Path(base).resolve():
        return f"their base model {own} is not the spec's model ({base})"
    layers = None if layouts is None else list(layouts)
    if layers is not None:
        from safetensors import safe_open

        with safe_open(str(folder / ADAPTER_WEIGHTS), "pt") as f:
            modules = {k.removeprefix(PEFT_PREFIX).rpartition(".lora_")[0] for k in f.keys()}
        if modules != set(targeted(spec.target_modules, layers)):
            return "they adapt other modules than the spec's model.lora.target_modules"
    return None


# peft's adapter_config.json fields that `adapter_misfit` checks itself (rank, alpha, the adapted modules, the base
# model), that act in training only (dropout; init_lora_weights: below), or that say nothing of the adapters
_CHECKED_OR_INERT = frozenset({"r", "lora_alpha", "target_modules", "base_model_name_or_path", "lora_dropout",
                               "task_type", "peft_type", "auto_mapping", "peft_version", "revision", "inference_mode",
                               "megatron_core", "qalora_group_size"})  # (the last two: read only with another option)


def _options_set(config: dict[str, Any], conv1d: bool | None) -> list[str]:
    """The fields of a peft adapter config set otherwise than a run's learner sets them (peft's defaults, and
    fan_in_fan_out when `conv1d`; None: not known), in the config's order: a bias, DoRA, a rank per layer, ...,
    which a rollout would add otherwise than peft does (a merge of W + scale B @ A would drop them)."""
    from peft import LoraConfig

    defaults = LoraConfig().to_dict()
    if conv1d is not None:
        defaults["fan_in_fan_out"] = conv1d

    def differs(key: str, value: Any) -> bool:
        if key in _CHECKED_OR_INERT or (key == "fan_in_fan_out" and conv1d is None):
            return False
        if key == "init_lora_weights":  # how A and B started; pissa, loftq, olora, ... also changed W itself
            return value not in (True, False, "gaussian")
        return value != defaults[key] if key in defaults else bool(value)  # (newer than this peft: set unless empty)

    return [k for k, v in config.items() if differs(k, v)]


def read_adapters(folder: Path, scale_by: float, dtype: torch.dtype | None = None) -> Adapters:
    """A peft adapter folder as a weight sync carries it: the tensors (cast to `dtype`, the engine's, as the
    learner casts before it sends), the scale they are added with (`scale_by`), and the folder's config."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    return Adapters({k: v.to(dtype) if dtype is not None else v for k, v in tensors.items()}, scale_by,
                    config=json.loads((folder / "adapter_config.json").read_text()))


def short_names(layers: list[str]) -> list[str]:
    """The distinct last parts of module paths, in first-seen order (q_proj, k_proj, ...)."""
    return list(dict.fromkeys(p.rsplit(".", 1)[-1] for p in layers))


@dataclass
class Adapters:
    """What a LoRA weight sync carries: the adapter tensors under peft's names, and the scale they are
    added with. `tensors` may be in the engine's dtype (the learner casts before sending)."""

    tensors: dict[str, torch.Tensor]
    scale: float
    version: int = 0  # the learner's step: an engine that caches adapters by id reloads a newer one
    config: dict[str, Any] = field(default_factory=dict)  # peft's adapter_config.json, for engines that read one

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """module path (the base model's name, `model.layers.0.self_attn.q_proj`) -> (A [r, in], B [out, r])."""
        out: dict[str, tuple[Any, Any]] = {}
        for name, t in self.tensors.items():
            module, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):  # a bias, DoRA's magnitude, a saved module: not B @ A
                raise ValueError(f"{name}: a tensor other than a LoRA A or B weight (peft options a run never sets); "
                                 "these adapters are not W + scale B @ A")
            a, b = out.get(module, (None, None))
            out[module] = (t, b) if kind == "A.weight" else (a, t)
        return out  # type: ignore[return-value]


def merged(base: dict[str, torch.Tensor], adapters: Adapters, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`{module}.weight` = W + scale * B @ A for every adapted module, computed in float32 from `base`
    (the module weights as loaded, before any adapter) and cast to `dtype` (default: W's). Adapters whose
    config says `fan_in_fan_out` (peft's, for transformers' Conv1D layers: W stored [in, out]) add the
    transpose, as peft merges them."""
    out = {}
    stored_in_out = bool(adapters.config.get("fan_in_fan_out"))
    for module, (a, b) in adapters.pairs().items():
        w = base[f"{module}.weight"]
        delta = (b.float() @ a.float()) * adapters.scale  # [out, in]
        out[f"{module}.weight"] = (w.float() + (delta.T if stored_in_out else delta)).to(dtype or w.dtype)
    return out
