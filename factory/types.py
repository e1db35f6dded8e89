"""The records that flow between stages.

They are plain dataclasses so that Ray can pickle them and tests can build them by hand. A stage's
inputs and outputs are these types, never dicts with string keys checked at run time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ToolStatus = Literal["ok", "model_error", "infra_error"]
# Why a trajectory stopped: the model answered without a call, it used all its turns, or its tokens.
StopReason = Literal["no_call", "max_turns", "budget", "timeout", "prompt_too_long"]


@dataclass
class ToolCall:
    """One call parsed from the model's output."""

    name: str
    arguments: dict[str, Any] | None  # None when the call's JSON could not be parsed
    raw: str  # the text between the call markers, as the model wrote it
    parse_error: str | None = None
    # Where in the run the call was made: the key a replay serves the recorded answer by. The rollout's calls:
    # "<split>/<step>/<attempt>/<prompt>/<sample>/<turn>/<k>"; a tool reward node's: "reward/<split>/<step>/
    # <attempt>/<prompt>/<sample>/<node>[/<turn>]" (factory.tools.recording.reward_origin); "" when the place is
    # not known (a trajectory read back from a table saved before trajectories kept theirs).
    origin: str = ""


@dataclass
class ToolResult:
    """What came back from one call.

    model_error: the model's fault (unknown tool, bad arguments, the tool's own isError); shown to the
    model and trained on. infra_error: ours (timeout, crash, transport); counted, and the spec decides
    whether the trajectory is kept in the loss.
    """

    tool: str
    text: str  # what the model sees as the tool response
    status: ToolStatus = "ok"
    error_kind: str | None = None  # timeout | crash | transport | circuit_open | unknown_tool | bad_arguments | tool_error | parse_error
    latency_s: float = 0.0


@dataclass
class Turn:
    """One assistant turn and the tool calls it made."""

    text: str  # the decoded model tokens of this turn (for logs only; ids are the truth)
    num_tokens: int
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    # Wall-clock times (time.time(), seconds) so a turn can be placed on a trace's timeline: asked the
    # engine, got its tokens, got the tool results back (= generated_at when no tool ran). 0 = unknown.
    started_at: float = 0.0
    generated_at: float = 0.0
    ended_at: float = 0.0


@dataclass
class Trajectory:
    """One sampled multi-turn episode for one prompt.

    response_ids holds everything after the prompt: model tokens and the tool/template tokens appended
    between turns; loss_mask has the same length and is 1 exactly on the tokens the model produced;
    sampler_logprobs too: the rollout engine's log-prob of each model token (0 on mask-0 tokens).
    """

    prompt_index: int  # which prompt of the batch (the group id)
    sample_index: int  # which of the group's samples
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    turns: list[Turn]
    stop_reason: StopReason
    row: dict[str, Any]  # the data row: ground truth and any extra columns reward functions read
    messages: list[dict[str, Any]] = field(default_factory=list)  # the prompt as chat messages
    completion: str = ""  # decoded response, model and tool tokens, for rewards and logs
    rewards: dict[str, float | None] = field(default_factory=dict)  # value of every reward node
    reward: float = 0.0  # the value of the training node
    # Nodes with one value per model turn (`per: turn`, and the combinators that read one): node -> a value
    # per turn, None where it has none (a gate did not evaluate it there; a drop). Their `rewards` entry is
    # the mean over the turns that have a value.
    turn_rewards: dict[str, list[float | None]] = field(default_factory=dict)
    # The training node's value at each model turn (missing = 0.0, as `reward`), when it is per turn; empty
    # when it is trajectory-level. What `algorithm.credit: turn` assigns to each turn.
    turn_reward: list[float] = field(default_factory=list)
    # Per reward node, when there is something to say: {"status": ok | missing | error | parse_failure |
    # non_finite (inf or NaN: no value) |
    # skipped, "reply": a judge's raw reply, "error": what failed}.
    reward_details: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: str | None = None  # why the reward stage took it out of the loss and the means (drop_sample)
    infra_error: bool = False  # some tool call failed for infrastructure reasons
    truncated: bool = False  # stopped by a token limit in a turn, or by the budget between turns (no room to reply)
    sampler_logprobs: list[float] = field(default_factory=list)  # [len(response_ids)]; empty = not recorded
    # Where in the run the episode was made, "<split>/<step>/<attempt>/<prompt>/<sample>" (the rollout sets it; ""
    # when not known): its reward nodes' tool calls are named by it, so that a rescore's replay finds the answers
    # recorded for this very trajectory. Kept as it was made: dynamic sampling renumbers `prompt_index` after
    # scoring (each round's from 0, then shifted to keep groups apart), which this does not follow.
    origin: str = ""

    @property
    def num_tool_calls(self) -> int:
        return sum(len(t.calls) for t in self.turns)

    def node_details(self, node: str) -> list[dict[str, Any]]:
        """Reward node `node`'s details here: one per turn for a per-turn node whose details say turn by turn,
        else one (`{}` when nothing was recorded)."""
        detail = self.reward_details.get(node, {})
        return detail["turns"] if "turns" in detail else [detail]

    def statuses(self, node: str) -> list[str]:
        """What happened to reward node `node` here: one status per `node_details` entry (`ok` when nothing was
        recorded)."""
        return [d.get("status", "ok") for d in self.node_details(node)]

    @property
    def num_model_tokens(self) -> int:
        """Tokens the model generated (what throughput and length metrics count): its turns' tokens, which the
        loss mask holds too, except in a timed-out trajectory, whose mask is all 0 (never trained)."""
        return sum(t.num_tokens for t in self.turns)



def trains(t: Trajectory, overlong_filter: bool, drop_infra_errors: bool) -> bool:
    """Whether the update trains `t`: not when an infrastructure tool failure hit it (with `drop_infra_errors`: its
    episode says nothing about the policy), nor, under DAPO's overlong filter, when the token budget cut it, nor
    when the reward stage dropped it (a `drop_sample` node had no value). What dynamic sampling counts as a
    group's signal and what the monitors read are these too."""
    return not ((drop_infra_errors and t.infra_error) or (overlong_filter and t.truncated) or t.dropped)

@dataclass(frozen=True)
class Placement:
    """What the driver tells one replica of a stage at setup: where it runs and whom it calls."""

    workdir: str | None = None  # the driver's working directory: user modules (rewards/) import from it
    rank: int = 0  # this replica's index in its stage's group
    world_size: int = 1  # replicas in the group
    master_addr: str = "127.0.0.1"  # rank 0's address and port, for groups that form a torch.distributed world
    master_port: int = 0
    # role -> handle, for each call edge out of this stage (its slice names the roles it reads)
    peers: dict[str, Any] = field(default_factory=dict)


class Weights(dict):
    """What a full weight sync carries: parameter name -> CPU tensor, a plain dict to whoever holds it.

    Pickled (into Ray's object store, on the way from the update stage to the rollout replicas) as numpy
    arrays, which pickle protocol 5 hands over out of band: the sender copies each tensor once into the
    store and every receiver maps it there without a copy. A torch tensor pickles through a bytes copy on
    each side instead: SmolLM2's 0.54 GB of float32 weights took 0.93 s to put and 0.81 s to get on a 2-core
    Zen 3, against 0.07 and 0.06 s as arrays. dtypes numpy lacks (bfloat16, float8) travel as integers of
    their size; tensors that share storage (tied embeddings) travel once and arrive sharing it.

    A received tensor is a read-only view of the store: engines copy it into their own parameters and must
    never write to it."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        arrays: dict[tuple[Any, ...], Any] = {}  # one array per storage view: pickle then sends it once
        entries = []
        for name, tensor in self.items():
            t = tensor.detach()
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if key not in arrays:
                arrays[key] = _as_array(t)
            entries.append((name, arrays[key], str(t.dtype).removeprefix("torch.")))
        return _weights_from_arrays, (entries,)


_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_array(t: Any) -> Any:
    """A CPU tensor as a numpy array sharing its memory; dtypes numpy lacks as integers of their size."""
    import torch

    try:
        return t.numpy()
    except TypeError:  # bfloat16, float8: no numpy dtype
        return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()])).numpy()


def _weights_from_arrays(entries: list[tuple[str, Any, str]]) -> Weights:
    import warnings

    import torch

    tensors: dict[int, Any] = {}  # id(array) -> tensor: tied tensors stay one tensor
    with warnings.catch_warnings():
        # the arrays are read-only views of Ray's store (see Weights); torch warns that it cannot mark them so
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for _, array, dtype in entries:
            if id(array) not in tensors:
                t = torch.from_numpy(array)
                want = getattr(torch, dtype)
                tensors[id(array)] = t if t.dtype == want else t.view(want)
    return Weights((name, tensors[id(array)]) for name, array, _ in entries)
