"""`factory run`: the single controller. It places the stages on Ray and runs the loop

    batch = data.next_batch(); trajs = rollout.generate(batch); trajs = reward.score(trajs);
    stats = update.step(trajs); rollout.load_weights(update.state_dict())

calling the stage actors as if they were local. Everything that branches (algorithm, backend, dynamic
sampling) lives outside `train_loop`.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from factory.lifecycle import GracefulStop, SessionRecord, children_ignore_sigint, reap_orphans
from factory.schema import Spec


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

    want, kept, metrics = spec.train.prompts_per_step, [], {}
    for attempt in range(4 if alg.dynamic_sampling else 1):
        batch = s.data.next_batch.remote(want - len({t.prompt_index for t in kept}) if attempt else want)
        trajs, roll_m = follow(s.rollout.generate.remote(batch, group_size=spec.rollout.group_size, step=step,
                                                         attempt=attempt), [s.rollout], display, f"step {step} rollout")
        trajs, rew_m = ray.get(s.reward.score.remote(trajs))
        for t in trajs:  # keep group ids unique across rounds
            t.prompt_index += 1000 * attempt
        metrics = _merge(metrics, {**roll_m, **rew_m})
        if not alg.dynamic_sampling:
            return trajs, metrics
        import torch

        keep = dynamic_sampling_keep(torch.tensor([t.reward for t in trajs]),
                                     torch.tensor([t.prompt_index for t in trajs]), alg.std_eps)
        kept += [t for t, k in zip(trajs, keep.tolist()) if k]
        if len({t.prompt_index for t in kept}) >= want:
            break
    metrics["rollout/dynamic_sampling_rounds"] = float(attempt + 1)
    return kept or trajs, metrics


def _merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Sum timings and counts over rounds; later means win."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v if (k.startswith("timing/") or k.endswith(("calls", "errors", "timeouts"))) else v
    return out


def train_loop(s: Stages, spec: Spec, plan: Any, tracker: Any, display: Any, metric_nodes: dict[str, str],
               record: SessionRecord) -> RunResult:
    from factory.algorithms import resolve

    alg = resolve(spec.algorithm)
    ckpt_dir = spec.train.checkpoint_dir
    traces = spec.tracking.log_trajectories
    before, eval_trajs = evaluate(s, spec, metric_nodes, display, 0)
    tracker.log_metrics(before, step=0)
    tracker.log_trajectories(eval_trajs, 0, split="eval", traces=traces)
    display.step(0, before, completed=0)
    after, checkpoint = before, None
    stop = GracefulStop(on_first=lambda: display.status("Ctrl-C: stopping after this step (it is logged and "
                                                        "checkpointed); Ctrl-C again stops at once"))
    with stop:
        for step in range(1, spec.train.steps + 1):
            t0 = time.perf_counter()
            trajs, m = collect(s, spec, alg, display, step)                    # data -> rollout -> tools -> reward
            m.update(ray.get(s.update.step.remote(trajs)))                     # advantages + DeepSpeed update
            t_sync = time.perf_counter()
            ray.get(s.rollout.load_weights.remote(s.update.state_dict.remote()))  # weight sync: update -> rollout
            m["timing/weight_sync_s"] = time.perf_counter() - t_sync
            m["timing/step_s"] = time.perf_counter() - t0
            m["timing/overhead_s"] = m["timing/step_s"] - sum(
                m.get(k, 0.0) for k in ("timing/generate_s", "timing/tools_s", "timing/reward_s", "timing/update_s"))
            m["perf/tokens_per_s"] = sum(len(t.response_ids) for t in trajs) / m["timing/step_s"]
            if step == spec.train.steps or (spec.train.eval_every and step % spec.train.eval_every == 0):
                after, eval_trajs = evaluate(s, spec, metric_nodes, display, step)
                m.update(after)
                tracker.log_trajectories(eval_trajs, step, split="eval", traces=traces)
            tracker.log_metrics(m, step=step)
            tracker.log_trajectories(trajs, step, traces=traces)  # the table keeps all: `factory rescore` reads it
            display.step(step, m)
            stopping = stop.requested  # read once: a Ctrl-C from here on stops after the next step
            if stopping or step == spec.train.steps or (spec.train.checkpoint_every and step % spec.train.checkpoint_every == 0):
                checkpoint = ray.get(s.update.save_checkpoint.remote(ckpt_dir, step))
                tracker.log_checkpoint(step, checkpoint)
            record.update()  # what this run has started, for the next run to end should this one be killed
            if stopping:
                break
    return RunResult(tracker.run_id, before, after, checkpoint, stopped=stop.requested)


def run(plan: Any, spec: Spec) -> RunResult:
    """Run a compiled plan end to end; returns the MLflow run id and before/after eval metrics."""
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
            plan = tracker.start_run(plan, spec, ray.get(stages.rollout.tool_listing.remote()),
                                     {"resolved": stages.resolved})
            display.status(f"MLflow run {tracker.run_id}; evaluating at step 0")
            result = train_loop(stages, spec, plan, tracker, display, metric_nodes, record)
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
