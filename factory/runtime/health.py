"""Whether a step's batch is worth training on: a step in which too many trajectories failed from
infrastructure -- a tool server down (its calls timed out, crashed, could not connect, or met an open
circuit) or a judge that answered nothing (its requests failed after their retries) -- would train on
nothing but zeros. `train.max_infra_error_rate` bounds that share; past it the run stops with
EXIT_INFRA and the cause, before the step's update.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

EXIT_INFRA = 3  # `factory run`'s exit code when a step had too many infrastructure failures, or a stage hung


class InfraFailure(RuntimeError):
    """A step whose share of trajectories failed from infrastructure is above `train.max_infra_error_rate`."""


class RayStartError(InfraFailure):
    """Ray could not be started or joined (a node that timed out during start-up on an overloaded machine,
    an address nothing answers on): exit 3 with Ray's reason, not an internal error."""


class StageStartError(InfraFailure):
    """A stage's setup raised (a tool server that would not start, a model its engine could not load): the
    run cannot begin. `factory run` exits 3 with the stage and the cause in one message, no traceback."""


class PlacementError(InfraFailure):
    """A stage's reservation that the Ray cluster cannot hold, or found no room for in time: exit 3 naming the
    stage, what it asked for and what the cluster has, not an internal error."""


class StageLostError(InfraFailure):
    """A stage's process, its node or the whole Ray cluster went away mid-run (a node killed, the head
    stopped, a replica out of memory): exit 3, saying that `--resume` continues the run, not an internal
    error with a remote traceback."""


def infra_causes(t: Any) -> list[str]:
    """What failed from infrastructure in one scored trajectory: each tool whose call failed on our side
    (`tool <name>: <kind>`) and each judge node whose request failed (`judge <node>: <error>`)."""
    causes = [f"tool {r.tool}: {r.error_kind}" for turn in t.turns for r in turn.results if r.status == "infra_error"]
    causes += [f"judge {node}: {d['error'].removeprefix('JudgeError: ')[:120]}"
               for node, d in t.reward_details.items()
               if d.get("status") == "error" and str(d.get("error", "")).startswith("JudgeError")]
    return causes


def check_infra(trajs: list[Any], limit: float, step: int) -> float:
    """The share of `trajs` that failed from infrastructure; raises InfraFailure, naming the causes (most
    frequent first, with how many trajectories each hit), when it is above `limit`."""
    failed = [c for t in trajs if (c := infra_causes(t))]
    share = len(failed) / max(len(trajs), 1)
    if share > limit:
        counts = Counter(cause for causes in failed for cause in dict.fromkeys(causes))
        listed = "; ".join(f"{cause} ({n})" for cause, n in counts.most_common(5))
        raise InfraFailure(f"step {step}: {len(failed)} of {len(trajs)} trajectories failed from infrastructure "
                           f"({share:.0%}, above train.max_infra_error_rate {limit:g}): {listed}. Training on them "
                           "would learn nothing: fix the cause and resume (factory run SPEC --resume)")
    return share
