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

# How a run whose stage was lost or hung is taken up (an evaluation's or a rescore's: run it again)
RESUME_SAID = "`factory run SPEC --resume` continues the run from its newest checkpoint"


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


class CheckpointWriteError(InfraFailure):
    """A checkpoint could not be written (the disk full, a read-only file system): exit 3 naming the folder,
    the free space and that `--resume` continues from the last checkpoint, not an internal error."""


def write_problem(e: BaseException, folder: str) -> str | None:
    """Why a checkpoint's save failed, in words, when it was the disk; None for anything else. torch's zip
    writer says a full disk as "[enforce fail at inline_container.cc] . unexpected pos N vs M"."""
    import shutil

    text = str(e)
    if "No space left" in text or "unexpected pos" in text or "PytorchStreamWriter failed" in text:
        try:
            free = f" ({shutil.disk_usage(folder).free / 2**30:.2f} GiB free there now)"
        except OSError:
            free = ""
        return f"no space left on the device of {folder}{free}"
    if "Read-only file system" in text:
        return f"{folder} is on a read-only file system"
    if "Permission denied" in text:
        return f"no permission to write in {folder}"
    return None


def infra_causes(t: Any) -> list[str]:
    """What failed from infrastructure in one scored trajectory: each tool whose call failed on our side
    (`tool <name>: <kind>`), the rollout's or a reward node's, and each judge node whose request failed
    (`judge <node>: <error>`). A per-turn node's summary is its first turn's: every turn is read."""
    causes = [f"tool {r.tool}: {r.error_kind}" for turn in t.turns for r in turn.results if r.status == "infra_error"]
    for node, summary in t.reward_details.items():
        for d in summary.get("turns", [summary]):
            if "infra" in d:
                causes.append(d["infra"])
            elif d.get("status") == "error" and str(d.get("error", "")).startswith("JudgeError"):
                causes.append(f"judge {node}: {d['error'].removeprefix('JudgeError: ')[:120]}")
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
