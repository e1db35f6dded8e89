"""The live terminal display of a run: a progress bar with ETA, one line per step, and a final summary.

On a terminal the bars redraw in place; in a log file (CI, nohup) each step is one plain line, and a long
phase (the step-0 evaluation, a step's rollout) prints its trajectories done/total every `log_every_s`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from factory.util import fmt_number, shown_path

SPEED_WINDOW_S = 24 * 3600.0  # the progress bars' speed (and ETA) from the updates of the last day


class Display:
    def __init__(self, total_steps: int, console: Console | None = None, *, log_every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, turn_credit: bool = False):
        self.turn_credit = turn_credit  # algorithm.credit: turn (the advantages compare turn returns, not rewards)
        self.context: int | None = None  # the rollout's longest sequence, once its stage says (resolved max_model_len)
        if console is None:
            console = Console(stderr=True, log_path=False)
            # in a log file a line is one line a grep finds ("MLflow run ... 0.7 min"), not wrapped at 80 columns
            console.soft_wrap = not console.is_terminal
        self.console = console
        self.total = total_steps
        # The ETA from the whole session's pace (rich's last 1000 updates), not rich's default last 30 s: a step of
        # 30 s or more left one update in that window, no speed, and the bar read `eta -:--:--` for a real model's run
        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                  console=self.console, transient=True, speed_estimate_period=SPEED_WINDOW_S)
        self._task = None
        self.log_every_s, self._clock = log_every_s, clock
        # The long phase in progress: (label, bar task on a terminal, started, last plain line printed).
        self._phase: tuple[str, object, float, float] | None = None
        self.trained_rows, self.steps_shown = 0.0, 0  # this session's training steps, for the summary
        self._failing_said: set[str] = set()  # reward nodes said to have failed on a whole step

    def __enter__(self) -> Display:
        self._progress.__enter__()
        self._task = self._progress.add_task("training", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def _log(self, text: str, style: str | None = None) -> None:
        """A timed line: rich's log on a terminal; in a log file one line however long (rich's log wraps
        at 80 columns there and pads every line with spaces, so a grep for a step's loss missed it). Never
        read as markup: lines carry paths, tool names and monitors' reasons, and a `[/...]` in one made
        rich raise on a terminal (and print the brackets in a log file)."""
        if self.console.is_terminal:
            self._progress.console.log(text, style=style, markup=False)
        else:
            self.console.print(f"{self.console.get_datetime():[%X]} {text}", style=style, markup=False,
                               highlight=False, soft_wrap=True)

    def status(self, text: str) -> None:
        """A one-off line for slow phases (starting Ray, building the model, evaluating)."""
        self._log(text)

    def warning(self, text: str) -> None:
        """A one-off line the user should read before the run goes on (it does go on)."""
        self._log(text, style="yellow")

    def progress(self, label: str, done: int, total: int) -> None:
        """Trajectories done out of total in a long phase (called every half second or so while it runs):
        a live bar on a terminal; in a log file, a plain line every `log_every_s` seconds."""
        now = self._clock()
        if self._phase is None or self._phase[0] != label:
            self.done()
            task = self._progress.add_task(label, total=total) if self.console.is_terminal else None
            self._phase = (label, task, now, now)
        _, task, started, last = self._phase
        if task is not None:
            self._progress.update(task, completed=done, total=total)
        elif now - last >= self.log_every_s:
            self._log(f"{label}: {done}/{total} trajectories ({now - started:.0f} s)")
            self._phase = (label, task, started, now)

    def done(self) -> None:
        """The long phase is over: its bar goes away (the step line that follows says how it went)."""
        if self._phase is not None and self._phase[1] is not None:
            self._progress.remove_task(self._phase[1])
        self._phase = None

    def step(self, step: int, m: dict[str, float], completed: int | None = None,
             failing: Sequence[str] = (), trajectories: int = 0) -> None:
        """Step `step`'s line. `failing`: the reward nodes that failed on every one of the step's `trajectories`
        (`factory.reward.graph.failing_everywhere`)."""
        acc = f"  eval acc {fmt_number(m.get('eval/accuracy'), '.2f')}" if "eval/accuracy" in m else ""
        if step == 0 and not m:  # no data.eval: the line of dashes below read as an evaluation that was made
            line = "step    0  no held-out evaluation (no data.eval rows)"
        elif step == 0:  # before training: only the evaluation ran
            line = (f"step    0  eval reward {fmt_number(m.get('eval/reward'))}{acc}  tool calls/question "
                    f"{fmt_number(m.get('eval/tool_calls'), '.2f')}")
        else:
            split = ", ".join(f"{k[7:-2].replace('_', ' ')} {m[k]:.1f}s" for k in
                              ("timing/generate_s", "timing/tools_only_s", "timing/reward_s", "timing/update_s",
                               "timing/weight_sync_s") if k in m)
            # What the update did: the rows it trained and its gradient's norm. Not the loss: GRPO's is about 0 at
            # every step by construction (each group's advantages sum to 0 and the first pass's ratio is 1), so
            # "loss -0.0000" read as "nothing learned" on runs that learned (it stays in MLflow: actor/pg_loss).
            line = (f"step {step:>4}  reward {fmt_number(m.get('reward/mean'))}{acc}  turns {fmt_number(m.get('num_turns/mean'), '.2f')}"
                    f"  tool calls {int(m.get('tools/calls', 0))} (model errors {int(m.get('tools/model_errors', 0))}, "
                    f"infra errors {int(m.get('tools/infra_errors', 0))})"
                    f"  rows {int(m.get('actor/trained_rows', 0))}  grad {fmt_number(m.get('actor/grad_norm'), '.3f')}"
                    f"  {m.get('timing/step_s', 0):.1f}s ({split})")
        untrained = step and untrained_why(m, turn_credit=self.turn_credit)
        if step:
            self.trained_rows += m.get("actor/trained_rows", 0.0)
            self.steps_shown += 1
        # markup=False: the line holds brackets and user text that rich must not read as markup
        self._log(line)
        if untrained:
            self._log(f"step {step}: nothing trained: {untrained}", style="yellow")
        for node in (n for n in failing if n not in self._failing_said):
            self._failing_said.add(node)  # once a run: the stage's own line says each step's first error
            self._log(f"step {step}: reward node {node} failed on all {trajectories} of the step's trajectories "
                      f"(rewards/{node}/errors, /parse_failures, /non_finite): its on_missing scored them all alike, "
                      "so it said nothing of the policy; the reward stage's line above names the first error",
                      style="yellow")
        if too_long := int(m.get("rollout/stop_prompt_too_long", 0)):
            limit = f" of {self.context} tokens" if self.context else ""
            self._log(f"step {step}: {too_long} trajectories' prompts fill the rollout's context{limit}: not generated "
                      "from, scored or trained on (shorten those rows; the context is the model's, or less where "
                      "rollout.max_model_len or what rollout.kv_cache_gb holds sets it)", style="yellow")
        self._progress.update(self._task, completed=step if completed is None else completed,
                              description=f"training (reward {fmt_number(m.get('reward/mean', m.get('eval/reward')), '.2f')})")

    def summary(self, result: Any, *, experiment: str, experiment_id: str, uri: str, wall_s: float,
                run_s: float | None = None) -> None:
        """The run's end (`result`: factory.runtime.driver.RunResult): its evaluations at step 0 and at the
        last step evaluated, each under its own step (a stopped run's last evaluation may be step 0's).
        `wall_s`: this command's time; `run_s`: a resumed run's over all its sessions."""
        run_id, before, after, checkpoint = result.run_id, result.before, result.after, result.checkpoint

        def say(text: str) -> None:
            # never markup (as in _log): the experiment's name, the store's URI and the checkpoint's path are the
            # user's, and a `[/2]` in one made rich raise after the run had finished (`[v2]` vanished)
            self.console.print(text, markup=False, highlight=False)

        ended = (f"halted after step {result.last_step}" if result.halted else
                 f"stopped after step {result.last_step}" if result.stopped else "finished")
        self.console.print(f"Factory run {ended}", style="bold")  # not the table's title: rich wraps it to the table
        if before or after:
            table = Table(show_header=True)
            table.add_column("metric")
            table.add_column("step 0", justify="right")
            if result.after_step:
                table.add_column(f"step {result.after_step}", justify="right")
            for k in sorted(set(before) | set(after)):
                table.add_row(k, fmt_number(before.get(k)),
                              *([fmt_number(after.get(k))] if result.after_step else []))
            self.console.print(table)
        else:  # (an empty table with its header alone said nothing)
            self.console.print("no held-out evaluation was made (data.eval is not set, or the run ended before one)")
        if self.steps_shown and not self.trained_rows:
            # (this session's steps: a resumed run started from its checkpoint, not from the base model)
            self.console.print(f"warning: none of the {self.steps_shown} steps trained a row (the step lines say "
                               "why): the weights are those this session started with", style="yellow")
        if not result.after_step and result.last_step and (result.stopped or result.halted):
            self.console.print("no evaluation after step 0: the run stopped before its next (train.eval_every)")
        elif not result.after_step and result.last_step and before:
            # a --resume of a run with every step done (Resume.complete) only sends what its driver could not:
            # it runs no step and so no evaluation; the run's last step made its own
            self.console.print(f"every step was done before this session: the evaluation after step "
                               f"{result.last_step} is an earlier session's (in the MLflow run)")
        took = f"{wall_s / 60:.1f} min" + (f" this session, {run_s / 60:.1f} min in all" if run_s is not None else "")
        say(f"MLflow run {run_id} in experiment '{experiment}' ({uri}), {took}")
        from factory.tracking.mlflow_tracker import uri_option

        if checkpoint and Path(checkpoint, "adapter").is_dir():  # a LoRA run's: `factory export` merges it
            say(f"final adapters (peft folder): {shown_path(Path(checkpoint, 'adapter'))}; merged "
                f"model: factory export {run_id} --out DIR{uri_option(uri)}")
        elif checkpoint:
            say(f"final model (HF folder): {shown_path(Path(checkpoint, 'hf'))}")
        if uri.startswith(("http://", "https://")):
            say(f"see it: {uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}")
        else:
            say(f"see it: factory ui{uri_option(uri)}   (the MLflow UI of this store; `factory runs` lists its runs)")


def untrained_why(m: dict[str, float], *, turn_credit: bool = False) -> str | None:
    """Why a training step's update changed no weight (from its metrics), or None when it trained a row.
    `turn_credit`: the advantages were per turn (`algorithm.credit: turn`): rewards that differ may still give
    returns that agree at each turn position (gamma < 1), or differ only where one trajectory of a group went."""
    if m.get("actor/trained_rows", 0.0) > 0 and not m.get("actor/skipped_non_finite"):
        return None
    if m.get("actor/skipped_non_finite"):
        return ("the update was skipped, its loss or gradient norm not finite (inf or NaN; see the rewards' "
                "non_finite counts and their size): train.max_non_finite_steps such steps in a row stop the run")
    if m.get("actor/dropped") and not m.get("actor/skipped_zero_adv"):
        return ("every trajectory was dropped (see actor/dropped: a reward node with no value under on_missing: "
                "drop_sample, infra errors, or algorithm.overlong.filter)")
    if m.get("actor/skipped_zero_adv"):
        # a reward function that raised on every call agrees with itself: say so, or the run looks merely flat
        failed = sorted(k.split("/")[1] for k, v in m.items() if k.startswith("rewards/") and k.endswith("/errors")
                        and v)
        why = (f"; reward {', '.join(failed)} failed on some trajectories (rewards/<node>/errors; the reward stage's "
               "warning line says why)") if failed else ""
        if dropped := int(m.get("actor/dropped", 0)):  # a tool server's crash: the survivors of a group may agree
            why += (f"; {dropped} trajectories were dropped before (actor/dropped: infra errors, a reward with no "
                    "value under drop_sample, the overlong filter), which can leave a group's others agreeing")
        agreed = ("each group's turn returns agreed at every turn position that two or more of its trajectories "
                  "reached" if turn_credit else "each group's rewards agreed")
        return f"every row's advantage was 0 ({agreed}{why})"
    return None
