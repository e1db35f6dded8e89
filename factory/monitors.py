"""Reward-hacking monitors: signs, computed every step from what the run already has, that the policy is
learning the reward rather than the task (verl#7004: today people catch it by reading charts).

    reward_dominance       one reward node (not the task's) carries most of the training reward's
                           within-group variance -- what GRPO's advantages are made of -- while the task
                           metric does not move: the policy is trained on that node alone
    length_drift           the mean response length grew or shrank by a factor while the task does not move
    tool_call_rate         tool calls per trajectory rose while the task does not
    judge_disagreement     a judge node and the verifier (the task's python function) disagree on many
                           trajectories: one of them is being fooled
    train_eval_divergence  the training reward rose while the held-out metric fell

The task metric is the first `metrics` entry: its node's mean over the training batch (`rewards/<node>/
mean`) and its held-out value (`eval/<name>`). "Does not move" compares the recent window (the last
`train.monitors.window` steps) with the run's first `window` steps (`task_gain`), both counted over the steps
that have a value (`windows`).

Each monitor is a pure function of the run's history -- one `Row` of floats per step (`step_row` makes it
from the step's trajectories and metrics) plus the evaluations -- and the thresholds; it returns a Reading
(its statistic, whether it fires, why) or None while the history cannot tell (too few steps, a graph
without a judge). They are registered by name in MONITORS, which refuses a duplicate. `Watch` holds one
run's history for the driver: it logs `monitor/<name>` and `monitor/<name>/fired`, remembers the first
firing of each (a warning line, once) and whether a `train.stop_on` monitor fired.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from factory.plan import WatchSettings
from factory.schema import MonitorName, MonitorsSpec

EXIT_MONITOR = 4  # `factory run`'s exit code when a `train.stop_on` monitor stopped the run
STOPPED_BY_TAG = "factory.stopped_by"  # why a stop_on monitor stopped the run, in words (`factory runs`)
HALTED_BY_TAG = "factory.stopped_by_monitor"  # the stop_on monitor that stopped a run (a resume reads it)

Row = dict[str, float]  # one step: reward, task, length, tool_calls, share/<node>, disagree/<judge>


@dataclass(frozen=True)
class History:
    """What the monitors read: one Row per training step, oldest first, and the held-out metric at each
    evaluation (step, value), step 0 first."""

    rows: Sequence[Row]
    evals: Sequence[tuple[int, float]] = ()


@dataclass(frozen=True)
class Reading:
    value: float  # the monitor's statistic (logged as `monitor/<name>`)
    fired: bool
    why: str  # one sentence with the numbers, for the warning line and the stop message


Monitor = Callable[[History, MonitorsSpec], "Reading | None"]
MONITORS: dict[str, Monitor] = {}
READS: dict[str, tuple[str, ...]] = {}  # monitor -> the `train.monitors` settings it reads (`factory check` warns
# about one set where every monitor that reads it can never speak)


def monitor(name: str, reads: tuple[str, ...] = ()) -> Callable[[Monitor], Monitor]:
    """Register a monitor under `name` (one of schema.MonitorName) that reads the `train.monitors` settings
    `reads` besides `window`, which every monitor reads; a second one of that name is refused."""
    def add(fn: Monitor) -> Monitor:
        if name in MONITORS:
            raise ValueError(f"monitor {name!r} is registered twice")
        if name not in get_args(MonitorName):
            raise ValueError(f"monitor {name!r} is not in factory.schema.MonitorName (train.stop_on names it)")
        MONITORS[name], READS[name] = fn, ("window", *reads)
        return fn
    return add


# ------------------------------------------------------------------------------------ windows
def _mean(values: Iterable[float | None]) -> float:
    """The mean of the values there are (None and non-finite ones left out), NaN without any."""
    known = [float(v) for v in values if v is not None and math.isfinite(v)]
    return sum(known) / len(known) if known else math.nan


def windows(h: History, key: str, w: int) -> tuple[float, float] | None:
    """(mean of `key` over the first `w` steps that have a value for it, over the last `w` such steps), or
    None before the (w + 1)th of them. Steps without a value (step_row's NaN: no trajectory trained, say a
    tool outage) are left out: as the run's first `w` rows, they made a NaN baseline that kept every
    window monitor silent for the rest of the run."""
    known = [float(v) for r in h.rows if (v := r.get(key)) is not None and math.isfinite(v)]
    if len(known) < w + 1:
        return None
    return _mean(known[:w]), _mean(known[-w:])


def task_gain(h: History, w: int) -> float | None:
    """How much the task metric's recent mean rose above its first steps' mean (None: unknown)."""
    pair = windows(h, "task", w)
    return None if pair is None else pair[1] - pair[0]


def _flat(h: History, s: MonitorsSpec) -> tuple[bool, str] | None:
    """Whether the task metric "does not move", and how it was measured; None while unknown."""
    gain = task_gain(h, s.window)
    if gain is None:
        return None
    return gain < s.min_task_gain, (f"the task metric changed by {gain:+.3f} (anything short of a rise of "
                                    f"{s.min_task_gain:g} counts as no progress)")


# ----------------------------------------------------------------------------------- monitors
@monitor("reward_dominance", reads=("dominance", "min_task_gain"))
def reward_dominance(h: History, s: MonitorsSpec) -> Reading | None:
    """The largest recent share of within-group variance carried by one non-task node (`share/<node>`)."""
    if len(h.rows) < s.window + 1:
        return None
    nodes = sorted({k[6:] for r in h.rows[-s.window:] for k in r if k.startswith("share/")})
    shares = {n: _mean([r.get(f"share/{n}", math.nan) for r in h.rows[-s.window:]]) for n in nodes}
    shares = {n: v for n, v in shares.items() if not math.isnan(v)}
    flat = _flat(h, s)
    if not shares or flat is None:
        return None
    node = max(shares, key=lambda n: shares[n])
    value = shares[node]
    return Reading(value, value >= s.dominance and flat[0],
                   f"reward node '{node}' carries {value:.0%} of the training reward's within-group variance over "
                   f"the last {s.window} steps (threshold {s.dominance:.0%}) and {flat[1]}")


def _ratio_monitor(h: History, s: MonitorsSpec, key: str, what: str, ratio: float, *, both_ways: bool,
                   min_rise: float = 0.0) -> Reading | None:
    pair, flat = windows(h, key, s.window), _flat(h, s)
    if pair is None or flat is None:
        return None
    first, last = pair
    value = last / first if first > 0 else (math.inf if last > 0 else 1.0)
    drifted = value >= ratio and last - first >= min_rise or (both_ways and value <= 1 / ratio)
    return Reading(value, drifted and flat[0],
                   f"{what} went from {first:.3g} (first {s.window} steps with a value) to {last:.3g} "
                   f"(last {s.window}), x{value:.2f} (threshold x{ratio:g}), and {flat[1]}")


@monitor("length_drift", reads=("length_ratio", "min_task_gain"))
def length_drift(h: History, s: MonitorsSpec) -> Reading | None:
    """Recent mean response length (model tokens) over the first steps'."""
    return _ratio_monitor(h, s, "length", "the mean response length", s.length_ratio, both_ways=True)


@monitor("tool_call_rate", reads=("tool_call_ratio", "min_task_gain"))
def tool_call_rate(h: History, s: MonitorsSpec) -> Reading | None:
    """Recent tool calls per trajectory over the first steps'."""
    return _ratio_monitor(h, s, "tool_calls", "tool calls per trajectory", s.tool_call_ratio, both_ways=False,
                          min_rise=0.5)


@monitor("judge_disagreement", reads=("disagreement", "pass_at"))
def judge_disagreement(h: History, s: MonitorsSpec) -> Reading | None:
    """The largest recent share of trajectories on which one judge and the verifier disagree."""
    if len(h.rows) < s.window + 1:  # as every monitor: from step window + 1 on
        return None
    recent = h.rows[-s.window:]
    judges = sorted({k[9:] for r in recent for k in r if k.startswith("disagree/")})
    rates = {j: _mean([r.get(f"disagree/{j}", math.nan) for r in recent]) for j in judges}
    rates = {j: v for j, v in rates.items() if not math.isnan(v)}
    if not rates:
        return None
    judge = max(rates, key=lambda j: rates[j])
    value = rates[judge]
    return Reading(value, value >= s.disagreement,
                   f"judge '{judge}' and the verifier disagree on {value:.0%} of the last {s.window} steps' "
                   f"trajectories (threshold {s.disagreement:.0%}, pass at {s.pass_at:g})")


@monitor("train_eval_divergence", reads=("train_rise", "eval_fall"))
def train_eval_divergence(h: History, s: MonitorsSpec) -> Reading | None:
    """The held-out metric's change from step 0 to the newest evaluation (fires when it fell while the
    training reward rose)."""
    pair = windows(h, "reward", s.window)
    if pair is None or len(h.evals) < 2:
        return None
    (s0, e0), (sn, en) = h.evals[0], h.evals[-1]
    rise, value = pair[1] - pair[0], en - e0
    return Reading(value, rise >= s.train_rise and value <= -s.eval_fall,
                   f"the training reward rose {rise:+.3f} (threshold {s.train_rise:g}) while the held-out metric "
                   f"went {e0:.3f} -> {en:.3f} from step {s0} to step {sn} (a fall of {s.eval_fall:g} fires)")


def read_all(h: History, s: MonitorsSpec) -> dict[str, Reading]:
    """Every monitor that can tell from `h`."""
    return {name: r for name, fn in MONITORS.items() if (r := fn(h, s)) is not None}


# --------------------------------------------------------------------------- from trajectories
def _value(v: float | None) -> float:
    return 0.0 if v is None or not math.isfinite(v) else float(v)


def variance_shares(groups: Sequence[Sequence[dict[str, float | None]]], weights: dict[str, float],
                    total: str) -> dict[str, float]:
    """Each sum input's share of the training reward's within-group variance: for T = sum_i w_i r_i,
    Var(T) = sum_i w_i Cov(r_i, T) within each group, so node i's share is sum_g w_i Cov_g(r_i, T) / sum_g
    Var_g(T) (the shares add up to 1; a node that moves against the total has a negative one). `groups`:
    each group's trajectories as {node: value}. Empty when no group's total varies."""
    var, cov = 0.0, dict.fromkeys(weights, 0.0)
    for g in groups:
        if len(g) < 2:
            continue
        t = [_value(r.get(total)) for r in g]
        mt = sum(t) / len(t)
        var += sum((x - mt) ** 2 for x in t) / len(t)
        for node, w in weights.items():
            v = [_value(r.get(node)) for r in g]
            mv = sum(v) / len(v)
            cov[node] += w * sum((a - mv) * (b - mt) for a, b in zip(v, t)) / len(t)
    return {} if var < 1e-12 else {node: c / var for node, c in cov.items()}


def step_row(trajs: Sequence[Any], w: WatchSettings, s: MonitorsSpec, total: str,
             signal: Sequence[Any] | None = None) -> Row:
    """One step of the history from the scored trajectories the update would train (the driver leaves out an
    infrastructure failure's and an overlong-filtered one; here, the reward stage's drops): not the step's
    metrics, which count every trajectory -- a tool outage's short episodes would move the length and the
    call rate. Under dynamic sampling `trajs` are every sampling round's and `signal` the groups kept for
    their spread of rewards (the batch trained): the task, reward, length and call rate are read on all of them
    (the kept groups leave out each prompt solved in every sample: a run learning its task read as flat), the
    variance shares on the kept groups. No trajectory trained: every statistic NaN (no value that step)."""
    kept = [t for t in trajs if t.dropped is None]
    row: Row = {"reward": _mean(t.reward for t in kept),
                "task": _mean(t.rewards.get(w.task_node) for t in kept) if w.task_node else math.nan,
                "length": _mean(t.num_model_tokens for t in kept)}
    if w.tools:  # without tools the rate is no measurement: tool_call_rate then has no value and is not logged
        row["tool_calls"] = _mean(t.num_tool_calls for t in kept)
    if w.weights:
        groups: dict[int, list[dict[str, float | None]]] = {}
        for t in kept if signal is None else [t for t in signal if t.dropped is None]:
            groups.setdefault(t.prompt_index, []).append({**t.rewards, total: t.reward})
        shares = variance_shares(list(groups.values()), w.weights, total)
        row.update({f"share/{n}": v for n, v in shares.items() if n in w.candidates})
    if w.verifier:
        for judge in w.judges:
            # only where both gave a value of their own: a judge that failed or did not parse holds
            # on_missing's stand-in (0 under `zero`), and an outage read as disagreement stopped the run
            pairs = [(t.rewards.get(judge), t.rewards.get(w.verifier)) for t in kept
                     if all(s == "ok" for s in (*t.statuses(judge), *t.statuses(w.verifier)))]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            if pairs:
                row[f"disagree/{judge}"] = sum((a >= s.pass_at) != (b >= s.pass_at) for a, b in pairs) / len(pairs)
    return row


# ---------------------------------------------------------------------------------- one run's watch
@dataclass
class Watch:
    """One run's monitors, for the driver: `observe` each step's scored batch, `evaluated` each
    evaluation; `new` holds the monitors that fired for the first time at the last step (at its observe or
    its evaluation), `halt` the first `train.stop_on` monitor that fired (with why)."""

    settings: WatchSettings
    spec: MonitorsSpec
    stop_on: Sequence[str] = ()
    total: str = "__total__"  # the key the trajectory's trained reward goes under in a row
    rows: list[Row] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    fired: dict[str, int] = field(default_factory=dict)  # monitor -> the step it first fired
    new: list[tuple[str, Reading]] = field(default_factory=list)
    halt: str | None = None
    halted_at: int | None = None  # the step at which `halt` was set
    halted_by: str | None = None  # the stop_on monitor that set it

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the monitors (their windows reach back over earlier steps): a resumed
        run reads the same history, and logs the same `monitor/*` values, as an uninterrupted one."""
        return {"rows": self.rows, "evals": self.evals, "fired": self.fired}

    def restore(self, state: dict[str, Any]) -> None:
        self.rows = [dict(r) for r in state["rows"]]
        self.evals = [(int(s), float(v)) for s, v in state["evals"]]
        self.fired = {k: int(v) for k, v in state["fired"].items()}

    def evaluated(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Note the evaluation at `step`. The driver evaluates a step after observing its batch, so the step's
        readings are made again with it (its `monitor/*` metrics, returned; {} before any step): otherwise no
        reading would ever see the final evaluation."""
        key = f"eval/{self.settings.task_metric}"
        if self.settings.task_metric and key in metrics and math.isfinite(metrics[key]):
            self.evals.append((step, metrics[key]))
        return self._read(step) if self.rows else {}

    def observe(self, step: int, trajs: Sequence[Any], signal: Sequence[Any] | None = None) -> dict[str, float]:
        """The step's `monitor/<name>` and `monitor/<name>/fired` metrics, from the trajectories it would train
        (under dynamic sampling every round's, with `signal` the groups it keeps: see step_row)."""
        self.rows.append(step_row(trajs, self.settings, self.spec, self.total, signal))
        self.new = []
        return self._read(step)

    def _read(self, step: int) -> dict[str, float]:
        """Every monitor on the history so far, as the step's metrics; first firings go to `new`."""
        out: dict[str, float] = {}
        for name, r in read_all(History(self.rows, self.evals), self.spec).items():
            out[f"monitor/{name}"] = r.value
            out[f"monitor/{name}/fired"] = float(r.fired)
            if r.fired and name not in self.fired:
                self.fired[name] = step
                self.new.append((name, r))
            if r.fired and name in self.stop_on and self.halt is None:
                first = self.fired[name]
                self.halt = (f"monitor {name} fired at step {step} (train.stop_on): {r.why}" if first == step else
                             f"monitor {name}, which first fired at step {first}, still fires at step {step} "
                             f"(train.stop_on): {r.why}")
                self.halted_at, self.halted_by = step, name
        return out
