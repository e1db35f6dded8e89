"""`factory run`: the single controller. It places the stages on Ray and runs the loop

    batch = data.next_batch(); trajs = rollout.generate(batch); trajs = reward.score(trajs);
    stats = update.step(trajs); rollout.load_weights(update.state_dict())

calling the stage actors as if they were local. Everything that branches (algorithm, backend, dynamic
sampling) lives outside `train_loop`.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from factory.lifecycle import GracefulStop, SessionRecord, children_ignore_sigint, reap_orphans
from factory.schema import Spec

if TYPE_CHECKING:
    from factory.resume import Resume


@dataclass
class Stages:
    data: Any
    rollout: Any
    reward: Any
    update: Any
    handles: list[Any] = field(default_factory=list)
    resolved: dict[str, Any] = field(default_factory=dict)  # what each stage chose on its device (engine, dtypes)


@dataclass
class RunResult:
    run_id: str
    before: dict[str, float]
    after: dict[str, float]
    checkpoint: str | None
    stopped: bool = False  # Ctrl-C ended it early (after a logged, checkpointed step)


def start_ray(spec: Spec) -> None:
    """Join $RAY_ADDRESS / resources.ray_address, else start a small local Ray of our own."""
    address = spec.resources.ray_address or os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, loopback-only cluster: no token needed
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    temp = Path(tempfile.gettempdir()) / f"factory-ray-{os.getuid()}"
    with children_ignore_sigint():  # a terminal's Ctrl-C reaches the driver alone (factory.lifecycle)
        ray.init(num_cpus=os.cpu_count(), object_store_memory=int(spec.resources.object_store_gb * 2**30),
                 include_dashboard=False, _temp_dir=str(temp), log_to_driver=True,
                 runtime_env={"env_vars": _QUIET})


# Stage processes log through Ray to this terminal; keep library chatter (weight-loading bars, advisory
# warnings) out of the run's display.
_QUIET = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
          "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def place_stages(spec: Spec, model_path: str, base_dir: str, display: Any) -> Stages:
    from factory.data import DataStage
    from factory.reward import RewardStage
    from factory.rollout.stage import RolloutStage
    from factory.update.stage import UpdateStage

    workdir = os.getcwd()
    res = spec.resources
    from factory.reward.graph import required_columns

    data = ray.remote(DataStage).options(num_cpus=0).remote(
        spec.data, seed=spec.seed, base_dir=Path(base_dir), eval_size=spec.train.eval_size,
        required_columns=required_columns(spec))
    rollout = ray.remote(RolloutStage).options(num_cpus=res.rollout.num_cpus, num_gpus=res.rollout.num_gpus).remote(
        spec, model_path, base_dir=base_dir, workdir=workdir)
    reward = ray.remote(RewardStage).options(num_cpus=res.reward.num_cpus, num_gpus=res.reward.num_gpus).remote(
        spec, base_dir=base_dir, workdir=workdir)
    update = ray.remote(UpdateStage).options(num_cpus=res.update.num_cpus, num_gpus=res.update.num_gpus).remote(
        spec, model_path, workdir=workdir, base_dir=base_dir)
    tools = f", starts the tool servers {', '.join(spec.tools)}" if spec.tools else ""
    display.status(f"starting the stages: data; rollout (loads the model{tools}); reward; update (DeepSpeed engine; "
                   "the first run on a machine also compiles DeepSpeed's C++ ops, about a minute)")
    ready = await_setup({"data": data.setup.remote(), "rollout": rollout.setup.remote(),
                         "reward": reward.setup.remote(), "update": update.setup.remote()}, display)
    return Stages(data, rollout, reward, update, [data, rollout, reward, update],
                  resolved={"rollout": ready["rollout"]["resolved"], "update": ready["update"]["resolved"]})


def await_setup(refs: dict[str, Any], display: Any) -> dict[str, Any]:
    """Every stage's setup result, saying as each one is ready."""
    t0, names, out = time.perf_counter(), {ref: name for name, ref in refs.items()}, {}
    while names:
        (ref,), _ = ray.wait(list(names), num_returns=1)
        name = names.pop(ref)
        out[name] = ray.get(ref)  # a setup that failed raises here
        display.status(f"{name} ready ({time.perf_counter() - t0:.1f} s)")
    return out


def follow(ref: Any, rollouts: list[Any], display: Any, label: str) -> Any:
    """The result of a rollout call; meanwhile the display shows the trajectories done out of total, polled
    from the rollout actors (async actors answer `progress()` while `generate` awaits)."""
    while not ray.wait([ref], timeout=0.5)[0]:
        counts = ray.get([r.progress.remote() for r in rollouts])
        display.progress(label, sum(d for d, _ in counts), sum(t for _, t in counts))
    display.done()
    return ray.get(ref)


def evaluate(s: Stages, spec: Spec, metric_nodes: dict[str, str], display: Any,
             step: int) -> tuple[dict[str, float], list[Any]]:
    """Greedy, one sample per held-out prompt; `eval/<metric>` is the mean of that reward node."""
    from factory.reward.graph import eval_metrics

    batch = ray.get(s.data.eval_batch.remote())
    if batch is None:
        return {}, []
    trajs, rollout_m = follow(s.rollout.generate.remote(batch, group_size=1, greedy=True), [s.rollout], display,
                              f"step {step} evaluation")
    trajs, reward_m = ray.get(s.reward.score.remote(trajs))
    out = eval_metrics(reward_m, metric_nodes)  # the training reward's missing-value rule (on_missing)
    out["eval/num_turns"] = rollout_m["num_turns/mean"]
    out["eval/tool_calls"] = rollout_m["tool_calls/mean"]
    return out, trajs


def collect(s: Stages, spec: Spec, alg: Any, display: Any, step: int) -> tuple[list[Any], dict[str, float]]:
    """One step's scored trajectories. With dynamic sampling (DAPO), groups whose rewards all agree carry
    no signal: they are dropped and more prompts are sampled, up to 3 extra rounds."""
    from factory.algorithms import dynamic_sampling_keep

    want, kept, metrics, seen, generated = spec.train.prompts_per_step, [], {}, 0, 0
    for attempt in range(4 if alg.dynamic_sampling else 1):
        batch = s.data.next_batch.remote(want - len({t.prompt_index for t in kept}) if attempt else want)
        trajs, roll_m = follow(s.rollout.generate.remote(batch, group_size=spec.rollout.group_size, step=step,
                                                         attempt=attempt), [s.rollout], display, f"step {step} rollout")
        trajs, rew_m = ray.get(s.reward.score.remote(trajs))
        for t in trajs:  # keep group ids unique across rounds
            t.prompt_index += 1000 * attempt
        metrics = _merge(metrics, {**roll_m, **rew_m}, seen, len(trajs))
        seen += len(trajs)
        generated += sum(t.num_model_tokens for t in trajs)
        if not alg.dynamic_sampling:
            return trajs, {**metrics, "rollout/generated_tokens": float(generated)}
        import torch

        keep = dynamic_sampling_keep(torch.tensor([t.reward for t in trajs]),
                                     torch.tensor([t.prompt_index for t in trajs]), alg.std_eps)
        kept += [t for t, k in zip(trajs, keep.tolist()) if k]
        if len({t.prompt_index for t in kept}) >= want:
            break
    metrics["rollout/dynamic_sampling_rounds"] = float(attempt + 1)
    metrics["rollout/dynamic_sampling_kept"] = float(len(kept))  # the trained batch; the means are over all rounds
    return kept or trajs, {**metrics, "rollout/generated_tokens": float(generated)}


def _merge(a: dict[str, float], b: dict[str, float], na: int, nb: int) -> dict[str, float]:
    """One step's metrics from two sampling rounds of `na` and `nb` trajectories, so that they describe
    the step's whole batch: a mean (`.../mean`), rate (`_per_s`) or percentile (`_p50`, `_p95`) is
    weighted by what it is over -- trajectories, the kept ones for `reward/` means, generate time, tool
    calls -- and a round without a value (NaN) weighs nothing; everything else (times, counts) adds up."""
    def weight(k: str, m: dict[str, float], n: int) -> float:
        if math.isnan(m[k]):
            return 0.0
        if k.endswith("_per_s"):  # perf/generate_tokens_per_s: tokens over generate time
            return m.get("timing/generate_s", 0.0)
        if k.endswith(("_p50", "_p95")):  # tools/<tool>/latency_s_p50: over that tool's calls
            return m.get(k.rsplit("/", 1)[0] + "/calls", 0.0)
        return n - m.get("reward/dropped", 0.0) if k.startswith(("reward/", "rewards/")) else n

    out = dict(a)
    for k, v in b.items():
        if k not in a:
            out[k] = v
        elif k.endswith(("/mean", "_per_s", "_p50", "_p95")):
            wa, wb = weight(k, a, na), weight(k, b, nb)
            out[k] = v if not wa else a[k] if not wb else (a[k] * wa + v * wb) / (wa + wb)
        else:
            out[k] = a[k] + v
    return out


def restore(s: Stages, resume: Resume) -> int:
    """Put the stages where the resumed run's checkpoint left them (factory.resume); returns its step."""
    if resume.checkpoint is not None:
        ray.get(s.update.load_checkpoint.remote(str(resume.checkpoint_dir), resume.checkpoint))
        ray.get([s.data.restore.remote(resume.data),
                 s.rollout.load_weights.remote(s.update.state_dict.remote())])
    return resume.step


# The parts a step's wall time (`timing/step_s`) is split into, none overlapping another: generate (a
# generation in flight), tools_only (tool calls in flight and no generation), reward, update, weight_sync;
# `timing/overhead_s` is the rest (moving batches between actors, the data stage, rollout bookkeeping).
STEP_PARTS = ("generate", "tools_only", "reward", "update", "weight_sync")


def train_loop(s: Stages, spec: Spec, plan: Any, tracker: Any, display: Any, metric_nodes: dict[str, str],
               record: SessionRecord, resume: Resume | None = None) -> RunResult:
    from factory.algorithms import resolve

    alg = resolve(spec.algorithm)
    # a resumed run keeps its folder (absolute, from its tags), whichever directory it is resumed from
    ckpt_dir = str(resume.checkpoint_dir) if resume else spec.train.checkpoint_dir
    traces = spec.tracking.log_trajectories
    done = restore(s, resume) if resume else 0
    if done:
        before = resume.before  # its step-0 evaluation, as the run logged it
    else:
        before, eval_trajs = evaluate(s, spec, metric_nodes, display, 0)
        tracker.log_metrics(before, step=0)
        tracker.log_trajectories(eval_trajs, 0, split="eval", traces=traces)
        display.step(0, before, completed=0)
    after, checkpoint = before, None
    stop = GracefulStop(on_first=lambda: display.status("Ctrl-C: stopping after this step (it is logged and "
                                                        "checkpointed); Ctrl-C again stops at once"))
    with stop:
        for step in range(done + 1, spec.train.steps + 1):
            t0 = time.perf_counter()
            trajs, m = collect(s, spec, alg, display, step)                    # data -> rollout -> tools -> reward
            m.update(ray.get(s.update.step.remote(trajs)))                     # advantages + DeepSpeed update
            t_sync = time.perf_counter()
            ray.get(s.rollout.load_weights.remote(s.update.state_dict.remote()))  # weight sync: update -> rollout
            m["timing/weight_sync_s"] = time.perf_counter() - t_sync
            m["timing/step_s"] = time.perf_counter() - t0
            m["timing/overhead_s"] = m["timing/step_s"] - sum(m.get(f"timing/{k}_s", 0.0) for k in STEP_PARTS)
            # tokens the model generated in the step (every sampling round), not tool results or template text
            m["perf/tokens_per_s"] = m["rollout/generated_tokens"] / m["timing/step_s"]
            if step == spec.train.steps or (spec.train.eval_every and step % spec.train.eval_every == 0):
                after, eval_trajs = evaluate(s, spec, metric_nodes, display, step)
                m.update(after)
                tracker.log_trajectories(eval_trajs, step, split="eval", traces=traces)
            tracker.log_metrics(m, step=step)  # before the checkpoint: a checkpointed step is a logged one
            tracker.log_trajectories(trajs, step, traces=traces)  # the table keeps all: `factory rescore` reads it
            display.step(step, m)
            stopping = stop.requested  # read once: a Ctrl-C from here on stops after the next step
            if stopping or step == spec.train.steps or (spec.train.checkpoint_every and step % spec.train.checkpoint_every == 0):
                state = {"run_id": tracker.run_id, "data": ray.get(s.data.state.remote())}  # what --resume reads
                checkpoint = ray.get(s.update.save_checkpoint.remote(ckpt_dir, step, state))
                tracker.log_checkpoint(step, checkpoint)
            record.update()  # what this run has started, for the next run to end should this one be killed
            if stopping:
                break
    return RunResult(tracker.run_id, before, after, checkpoint, stopped=stop.requested)


def run(plan: Any, spec: Spec, resume: Resume | None = None) -> RunResult:
    """Run a compiled plan end to end (or continue the run `resume` names, see factory.resume); returns the
    MLflow run id and before/after eval metrics."""
    from factory.assets import is_built, resolve_model
    from factory.display import Display
    from factory.tracking import Tracker, tracking_uri

    t_start = time.perf_counter()
    display = Display(spec.train.steps)
    uri = tracking_uri(spec.tracking.uri)
    tracker = Tracker(uri, spec.tracking.experiment)
    metric_nodes = metric_nodes_of(spec)
    with display:
        ended = reap_orphans()
        if ended:
            display.status(f"ended what a killed run left behind: {', '.join(ended)}")
        if not is_built(spec.model.path):
            display.status(f"building the model {spec.model.path} into the cache (first use only)")
        model_path = resolve_model(spec.model.path)
        display.status("starting Ray")
        start_ray(spec)
        record = SessionRecord()
        record.update()
        status, stages = "FAILED", None
        try:
            stages = place_stages(spec, model_path, str(plan.base_dir), display)
            record.update()
            listing = ray.get(stages.rollout.tool_listing.remote())
            plan = (tracker.resume(resume, plan, spec, listing) if resume else
                    tracker.start_run(plan, spec, listing, {"resolved": stages.resolved}))
            display.status(f"MLflow run {tracker.run_id} resumed at step {resume.step + 1}" if resume else
                           f"MLflow run {tracker.run_id}; evaluating at step 0")
            result = train_loop(stages, spec, plan, tracker, display, metric_nodes, record, resume)
            status = "KILLED" if result.stopped else "FINISHED"  # KILLED: MLflow's word for stopped by its user
        except KeyboardInterrupt:
            status = "KILLED"  # MLflow's word for a run stopped by its user
            raise
        finally:
            tracker.end(status)
            if stages is not None:  # stop tool servers cleanly before the actors go
                ray.wait([stages.rollout.close.remote(), stages.reward.close.remote()], num_returns=2, timeout=30)
            ray.shutdown()
            record.close()
    display.summary(run_id=result.run_id, experiment=spec.tracking.experiment, experiment_id=tracker.experiment_id,
                    uri=uri, before=result.before, after=result.after, wall_s=time.perf_counter() - t_start,
                    checkpoint=(str(Path(result.checkpoint) / "hf") if result.checkpoint else None))
    return result


def metric_nodes_of(spec: Spec) -> dict[str, str]:
    """Eval metrics: the spec's `metrics`, else `accuracy` = the first python-function node."""
    if spec.metrics:
        return dict(spec.metrics)
    from factory.schema import FnNode

    first = next((n for n, v in spec.rewards.items() if isinstance(v, FnNode)), None)
    return {"accuracy": first} if first else {}
