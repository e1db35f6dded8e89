"""The Plan: a compiled spec, as plain data, and the program `factory run` executes.

The compiler (factory.compiler) builds it; the driver places `plan.stages` and runs the loop along
`plan.edges`; MLflow stores it with every run and `factory diff` compares two of them.

Each stage carries its slice of the spec (`settings`): the spec sections it reads, under their spec
names, and the values the compiler derived for it (the reward order, the resolved algorithm, ...). The
stage's constructor receives that slice and nothing else, so what `factory plan` shows is what runs.

It sits at the bottom of the package with the schema (it imports only `factory.schema` and the
torch-free `factory.presets`), so every stage can read its slice without importing the compiler.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from factory.presets import Algorithm, filled
from factory.schema import (
    DataSpec,
    LocalJudge,
    ModelSpec,
    ReplaySpec,
    RewardNode,
    RolloutSpec,
    ToolSpec,
    TrackingSpec,
    TrainSpec,
)

MASK = "***"  # a value read from the environment (`${oc.env:...}`), as every view of a plan shows it


# ------------------------------------------------------------------------------------ stage slices
class Settings(BaseModel):
    """A stage's slice of the spec. Spec sections keep their spec names (the spec's masked paths mask
    them in every view); the rest are values the compiler resolved.

    A stage that calls other stages finds them in `Placement.peers` under the roles its slice names
    (`peer_roles`): the roles of the plan's call edges out of it, never a stage's name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def peer_roles(self) -> list[str]:
        """The `Placement.peers` keys this stage reads (the compiler checks that a call edge has each)."""
        return []

    def models(self) -> list[str]:
        """The models this stage loads (`model.path` values), which the driver builds before Ray starts."""
        return []


class Compute(Settings):
    """Where a computing stage runs and what its `auto` dtype weighs: decided by the compiler. The dtype
    itself is picked on the stage's own machine, by factory.device.resolve_dtype (the one rule)."""

    device: Literal["cpu", "cuda"]  # cuda when the stage reserves a GPU (Ray makes one visible to it)
    dtype: str  # the setting: a dtype, or auto
    want_bf16: bool  # auto takes bfloat16 where the device computes it natively
    weights: str = "float32"  # the model's stored dtype (model.dtype): auto keeps bf16/fp16 weights where native


class EngineSettings(Settings):
    """What a generation engine starts with (factory.rollout.engine.make_engine)."""

    engine: Literal["auto", "hf", "vllm"]
    batch_size: int  # most sequences in one batch
    kv_cache_gb: float  # vLLM's KV cache


class DataSettings(Settings):
    data: DataSpec
    seed: int
    eval_size: int | None  # evaluate on at most this many eval rows
    required_columns: dict[str, str]  # column -> the reward node that needs it: every row is checked for it
    base_dir: str  # the spec's folder: relative file references fall back to it
    valued_columns: tuple[str, ...] = ()  # of those, the reward functions' parameters: not null either


class RolloutSettings(Settings):
    model: ModelSpec
    chat_template: str | None
    chat_template_kwargs: dict[str, Any]
    rollout: RolloutSpec
    compute: Compute  # rollout.dtype on the device resources.rollout.num_gpus gives; auto follows the update's bf16
    num_gpus: float  # resources.rollout.num_gpus
    seed: int
    threads: int | None
    base_dir: str
    tool_peer: str | None  # the role of its call edge to the tool servers; None: the spec has no tools
    run_tokens: int = 0  # at most this many tokens sampled over the run (steps and evaluations): `engine: auto` weighs it
    # An OpenAI-compatible base URL that generates instead of a local engine (`factory eval --model URL`:
    # it takes no weights, so only an evaluation's plan sets it; the model's tokenizer is still read here).
    endpoint: str | None = None

    def peer_roles(self) -> list[str]:
        return [self.tool_peer] if self.tool_peer else []

    def models(self) -> list[str]:
        return [self.model.path]


class Replayed(BaseModel):
    """A recorded run's tool calls, which answer this run's (`replay.run`; factory.tools.recording.Replay)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str  # the recorded run, as `replay.run` names it
    rows: list[dict[str, Any]]  # its tool_calls tables, in order
    # what its servers offered (its tools.json): with on_miss fail, the tools offered here without a server
    # started; None: the run saved none
    listing: dict[str, list[dict[str, Any]]] | None
    on_miss: str  # replay.on_miss
    # how far the run got (factory.runtime.replay): a miss past it is this run going on, not going elsewhere
    trained: int  # the steps it trained
    evaluated: list[int]  # the steps it evaluated at


class ToolsSettings(Settings):
    tools: dict[str, ToolSpec]
    base_dir: str
    record: bool = True  # tracking.record_tools: keep every call for the run's tool_calls tables
    # the recording to answer from, read from the store when the run starts (factory.runtime.replay): not
    # compiled, so not part of the plan that is shown, hashed and logged
    replay: Replayed | None = Field(default=None, exclude=True)


class RewardSettings(Settings):
    rewards: dict[str, RewardNode]
    order: tuple[str, ...]  # reward nodes, inputs before the nodes that read them
    train_node: str  # the node whose value trains the policy
    base_dir: str
    whole_batch: bool  # a node normalises over the batch: one `score` call must hold a whole step
    takes_turns: tuple[str, ...]  # function nodes whose function declares `turns` (the compiler read its signature)
    # function nodes whose function names the row columns it takes (no `**row`) -> those columns
    row_keywords: dict[str, tuple[str, ...]] = {}
    tool_peer: str | None  # the role of its call edge to the tool servers (tool nodes); None: none
    judge_peers: dict[str, str]  # judge node with a local model -> the role of its call edge to that model

    def peer_roles(self) -> list[str]:
        return ([self.tool_peer] if self.tool_peer else []) + list(self.judge_peers.values())


class JudgeSettings(Settings):
    judge: LocalJudge  # rewards.<node>.local
    seed: int
    compute: Compute  # the judge's dtype on the device its num_gpus gives (auto: bf16 where native)
    engine: EngineSettings  # its engine; a batch holds the node's `concurrency` prompts

    def models(self) -> list[str]:
        return [self.judge.path]


class UpdateSettings(Settings):
    model: ModelSpec
    chat_template: str | None  # saved hf/ folders carry it
    rollout: RolloutSpec  # the sampling temperature, the token budget, drop_infra_errors
    train: TrainSpec
    algorithm: Algorithm  # the preset filled in and overridden by the spec
    seed: int
    base_dir: str
    # the device resources.update.num_gpus gives; dtype: the autocast's (auto under train.bf16_autocast with
    # float32 weights: bf16 where native; float32: none)
    compute: Compute

    def models(self) -> list[str]:
        return [self.model.path]
    # the rollout's Compute: each weight sync is cast to the dtype its engine holds (resolve_dtype), guessed from
    # it at setup until the driver says what the rollout resolved on its own device (driver.agree_sync_dtypes)
    rollout_compute: Compute | None = None


class ClusterSettings(Settings):
    ray_address: str | None  # the cluster to join (resources.ray_address, else $RAY_ADDRESS); None: a local Ray
    object_store_gb: float


class WatchSettings(Settings):
    """What the reward-hacking monitors (factory.monitors) read of the reward graph, resolved by the compiler."""

    task_metric: str | None  # the first `metrics` entry (its `eval/` value is the held-out metric)
    task_node: str | None  # its reward node (its training-batch mean is the task metric)
    weights: dict[str, float]  # the training node's `sum` inputs and their weights; {} when it is not a sum
    # the sum inputs that may dominate (reward_dominance): those that do not read the task node (a
    # `correct: {max: [exact, judged]}` carries the task itself)
    candidates: tuple[str, ...] = ()
    judges: tuple[str, ...]  # judge nodes
    verifier: str | None  # the task node when it is a python function (what judges are checked against)
    # the spec has `tools`: without, tool calls per trajectory is 0 at every step, and tool_call_rate logged
    # 1.0 ("no change") of a rate there is none of
    tools: bool


class DriverSettings(Settings):
    """What the single controller itself reads: the loop, the eval metrics, tracking and the cluster."""

    name: str
    train: TrainSpec  # the loop reads steps, prompts_per_step and the eval/checkpoint cadence
    metrics: dict[str, str]  # eval metric name -> reward node
    dynamic_sampling: bool  # the resolved algorithm's: the driver refills the batch
    std_eps: float
    turn_gamma: float | None  # credit: turn -> its gamma (dynamic sampling then judges groups turn by turn); None: trajectory credit
    overlong_filter: bool  # with drop_infra_errors: which trajectories the update drops, which dynamic sampling
    drop_infra_errors: bool  # does not count as a group's signal (factory.update.batch.trains)
    tracking: TrackingSpec
    resources: ClusterSettings
    replay: ReplaySpec  # the run whose recorded tool calls answer this one's (replay.run; None: none)
    watch: WatchSettings  # what the monitors read (train.monitors, train.stop_on: their thresholds and stops)


S = TypeVar("S", bound=Settings)


# ------------------------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class Stage:
    """One stage: the class the driver places (by import path), how many replicas, what each reserves,
    and the slice its constructor receives."""

    name: str
    does: str
    cls: str  # `module:Class`, constructed as Class(settings) in each replica's Ray actor
    settings: Settings
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    replicas: int = 1
    resources: dict[str, float] = field(default_factory=dict)  # one replica's Ray bundle: CPU, GPU, custom
    strategy: str = "PACK"  # how the replicas' placement group spreads over nodes
    env: dict[str, str] = field(default_factory=dict)  # environment its replicas' processes start with


EdgeKind = Literal["data", "eval", "call", "weight_sync"]
# What a stream edge hands on as one part: one trajectory as soon as it ends, or one prompt's whole group
# (all its samples) as soon as its last sample ends.
StreamPart = Literal["trajectory", "group"]


@dataclass(frozen=True)
class Edge:
    """`src` hands `carries` to `dst`, whose method `method` receives it.

    data: one training step flows along these, from the source stage to the trainer. eval: the same
    flow from the held-out batch (it never reaches the trainer). call: `src` calls `dst.method` itself,
    as often as it needs (tool calls), through the handle it receives at setup as `Placement.peers[role]`
    (its slice names the role). weight_sync: the edge that closes the loop. `fetch` is the `src` method
    the driver calls to get what the edge carries; empty when it is the answer of the previous edge's
    method. `stream` (a data edge out of a method whose stage declares a streamed form of it, see
    factory.contract.Call): `dst` receives the answer part by part -- each trajectory as soon as it ends
    ("trajectory"), or each prompt's group as soon as its last sample ends ("group", when `dst` reads a
    trajectory's group) -- so its work overlaps the source's; None when `dst` needs the whole batch in one
    call. The compiler decides it from what `dst` reads."""

    src: str
    dst: str
    carries: str
    kind: EdgeKind = "data"
    method: str = ""
    fetch: str = ""
    stream: StreamPart | None = None
    role: str = ""


@dataclass(frozen=True)
class Plan:
    """A compiled spec. `plan_json` serialises all of it except `spec_yaml` (the same as `spec`) and
    `warnings` (diagnostics that depend on the machine, such as the HF cache).

    `spec` and every serialised view show values that came from the environment as "***"; the stage
    slices and `driver` hold the real values, because they are what runs."""

    spec: dict[str, Any]  # the resolved spec, keys sorted, env-derived values masked as "***"
    spec_yaml: str  # the same as YAML (what MLflow stores as spec.yaml)
    spec_path: str  # the spec file as given
    base_dir: str  # the spec file's folder (absolute): relative file references fall back to it
    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    driver: DriverSettings
    hashes: dict[str, Any]  # spec, templates, rewards, data, code, tools, run
    version: str  # factory's version
    tools: dict[str, list[str]] = field(default_factory=dict)  # server -> offered tools (when connected)
    warnings: tuple[str, ...] = field(default=(), compare=False)  # shown by `factory check`, not hashed
    # where the spec's values were read from the env, key by key (a key may hold a '.': a tag `team.token`)
    masked: tuple[tuple[str | int, ...], ...] = field(default=(), compare=False, repr=False)

    def stage(self, name: str) -> Stage:
        """The stage named `name`: for tests and notebooks, which know the plan they built."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"the plan has no stage {name!r}")

    def from_env(self, *keys: str | int) -> bool:
        """Whether the spec's value at `keys` (`"train", "checkpoint_dir"`), or a section holding it, came from the
        environment: every view shows it as "***", and nothing derived from it (a tag, a param) may show it either."""
        return any(keys[:len(m)] == m for m in self.masked)

    def sliced(self, kind: type[S]) -> S:
        """The one stage slice of type `kind`: the reward graph's (RewardSettings), the trainer's
        (UpdateSettings). Code outside the compiler finds a stage by what it is, never by its name."""
        (found,) = [s.settings for s in self.stages if isinstance(s.settings, kind)]
        return found

    def flow(self, kind: Literal["data", "eval"]) -> list[Edge]:
        """The edges one batch travels, in order: the `kind` edge out of the source, then the data edges
        from stage to stage until the trainer (the stage no data edge leaves)."""
        (edge,) = [e for e in self.edges if e.kind == kind and e.fetch]
        path = [edge]
        while nxt := [e for e in self.edges if e.kind == "data" and e.src == path[-1].dst]:
            path.append(nxt[0])
        return path

    @property
    def reward_order(self) -> tuple[str, ...]:
        return self.sliced(RewardSettings).order

    @property
    def reward_node(self) -> str:
        return self.sliced(RewardSettings).train_node

    @property
    def algorithm(self) -> Algorithm:
        return self.sliced(UpdateSettings).algorithm

    @property
    def filled_spec(self) -> dict[str, Any]:
        """`spec` with its `algorithm` section as the run uses it: the preset's choices in place of the nulls it
        left to them (factory.presets.filled). What a run and its rescore record as params, and `factory explain`
        shows: the spec's nulls made a run and its rescore of one spec differ in MLflow's compare view. A value the
        spec read from the environment stays "***" (the preset's fill wrote it out: `dual_clip_c: 3.0`)."""
        shown = self.spec["algorithm"]
        algorithm = copy.deepcopy(filled(shown, self.algorithm))  # (written into below: the spec's left as it is)
        for keys in self.masked:
            if keys[:1] != ("algorithm",) or len(keys) < 2:
                continue
            value, into = shown, algorithm
            try:
                for key in keys[1:]:
                    value = value[key]
                for key in keys[1:-1]:
                    into = into[key]
            except (KeyError, IndexError, TypeError):
                continue
            if value is not None:  # (an unset `${oc.env:X,null}` read nothing: the preset's fill stands)
                into[keys[-1]] = value
        return {**self.spec, "algorithm": algorithm}

    @property
    def metrics(self) -> dict[str, str]:
        return self.driver.metrics
