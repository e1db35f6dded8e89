"""The chaos run: a 20-step tiny run (specs/tiny.yaml, with an LLM judge on an endpoint) with faults
injected at random moments, then checked as a user would check it.

    python bench/chaos.py [--steps 20] [--seed 0] [--workdir DIR]

Injected (the moments drawn from --seed; each fault is real, nothing is mocked):
  - the tracking server (`mlflow server`) stopped once step 2 is checkpointed, started again once step 4 is;
  - the calculator MCP server SIGKILLed at three random steps (the tools stage restarts it);
  - the judge endpoint answers HTTP 500 to 15% and 429 (Retry-After: 1) to 15% of its requests, and
    `{"score": NaN}` to 10%; a project reward function returns inf for a third of the completions;
  - a rollout replica (its Ray actor's process) SIGKILLed at a random step: the run fails, and
    `factory run SPEC --resume` completes it from its last checkpoint.
Checked at the end: the run is FINISHED; every step's metrics and trajectory table are in the store exactly
once; the final weights are finite. It prints what it injected and what survived, and as its last line one
JSON object of the counts (docs/reliability.md quotes them).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import cpu_line, pythonpath  # noqa: E402


# ------------------------------------------------------------------------------------- the judge
class Judge:
    """An OpenAI-compatible judge on 127.0.0.1 that fails a share of its requests: 500, or 429 with
    Retry-After: 1; answers `{"score": NaN}` to a share `pnan`, `{"score": 1}` otherwise (read it with
    `json_field: score`)."""

    def __init__(self, rng: random.Random, p500: float, p429: float, pnan: float = 0.0):
        self.counts = {"requests": 0, "500": 0, "429": 0, "nan": 0, "ok": 0}
        lock, counts = threading.Lock(), self.counts

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    counts["requests"] += 1
                    draw = rng.random()
                    kind = ("500" if draw < p500 else "429" if draw < p500 + p429 else
                            "nan" if draw < p500 + p429 + pnan else "ok")
                    counts[kind] += 1
                code = {"500": 500, "429": 429, "nan": 200, "ok": 200}[kind]
                score = '{"score": NaN}' if kind == "nan" else '{"score": 1}'
                body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": score}}]}
                                  if code == 200 else {"error": "chaos"}).encode()
                self.send_response(code)
                if kind == "429":
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# ------------------------------------------------------------------------------- tracking server
class TrackingServer:
    def __init__(self, folder: Path, port: int):
        from factory.tracking.runs import server_command

        self.folder, self.port, self.url = folder, port, f"http://127.0.0.1:{port}"
        self.argv, self.env = server_command(f"sqlite:///{folder}/mlflow.db", "127.0.0.1", port)
        self.argv += ["--artifacts-destination", str(folder / "artifacts")]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        from factory.tracking.runs import wait_until_up

        self.proc = subprocess.Popen(self.argv, cwd=self.folder, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until_up(self.url, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ------------------------------------------------------------------------------------- the run
def descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_matching(pid: int, needle: str) -> list[int]:
    """SIGKILL the driver's descendants whose command line holds `needle`; their pids."""
    import psutil

    killed = []
    for p in descendants(pid):
        try:
            if needle in " ".join(p.cmdline()):
                p.kill()
                killed.append(p.pid)
        except psutil.Error:
            pass
    return killed


def wild_rewards(work: Path, judge_url: str) -> list[str]:
    """Overrides adding to specs/tiny.yaml (in `work`) two rewards from outside that misbehave: a project
    reward function that returns inf for a third of the completions, and the judge at `judge_url` (read
    through `json_field: score`, so its NaN arrives as a number). Both weigh 0.1 in the trained total."""
    (work / "prompts" / "chaos_judge.jinja").write_text("Is this answer to '{{ prompt }}' right? {{ completion }}\n")
    (work / "rewards").mkdir(exist_ok=True)
    (work / "rewards" / "__init__.py").write_text("")
    (work / "rewards" / "chaos.py").write_text(
        "import math\n\n\ndef sometimes_inf(prompt, completion, **row):\n"
        "    return math.inf if len(completion) % 3 == 0 else 0.0\n")
    engine = "vllm" if __import__("importlib").util.find_spec("vllm") else "hf"
    return [f"rollout.engine={engine}", "rewards.wild={fn: 'rewards.chaos:sometimes_inf'}",
            f"rewards.judged={{llm_judge: prompts/chaos_judge.jinja, endpoint: '{judge_url}', json_field: score, "
            "retries: 3, timeout_s: 10, concurrency: 4}", "rewards.total.sum.judged=0.1", "rewards.total.sum.wild=0.1"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpointed(work: Path) -> int:
    """The newest step whose checkpoint is committed (checkpoint_every: 1), 0 before any."""
    steps = [int(p.name.removeprefix("step_")) for p in work.glob("runs/tiny/*/step_*") if p.name[5:].isdigit()]
    return max(steps, default=0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the run's folder here (default: a temporary one)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="factory-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in ("specs", "prompts"):
        shutil.copytree(ROOT / name, work / name, dirs_exist_ok=True)
    print(cpu_line(), flush=True)

    judge = Judge(rng, p500=0.15, p429=0.15, pnan=0.1)
    tracking = TrackingServer(work, free_port())
    tracking.start()
    overrides = [f"train.steps={args.steps}", "train.checkpoint_every=1", *wild_rewards(work, judge.url)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking.url, "PYTHONPATH": pythonpath(ROOT)}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # a local Ray of the run's own, default auth
        env.pop(key, None)

    tool_kills = sorted(rng.sample(range(2, args.steps), 3))
    replica_kill = rng.choice([s for s in range(6, args.steps - 3) if s not in tool_kills])
    injected: list[str] = []
    exits: list[int] = []
    stderr = ""
    t0 = time.monotonic()
    for attempt in range(5):  # the first run, then --resume as long as it fails
        argv = [sys.executable, "-m", "factory.commands.cli", "run", "specs/tiny.yaml", *overrides]
        argv += ["--resume"] if attempt else []
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
        reader.start()
        while proc.poll() is None:
            step = checkpointed(work)
            if step >= 2 and "tracking server stopped" not in " ".join(injected):
                tracking.stop()
                injected.append(f"step {step}: tracking server stopped")
            if step >= 4 and tracking.proc is not None and tracking.proc.poll() is not None:
                tracking.start()
                injected.append(f"step {step}: tracking server started again")
            if tool_kills and step >= tool_kills[0]:
                pids = kill_matching(proc.pid, "factory.examples.calculator")
                injected.append(f"step {step}: calculator MCP server SIGKILLed (pids {pids})")
                tool_kills.pop(0)
            if replica_kill and step >= replica_kill:
                pids = kill_matching(proc.pid, "RolloutStage")
                if pids:
                    injected.append(f"step {step}: rollout replica SIGKILLed (pids {pids})")
                    replica_kill = 0
            time.sleep(0.2)
        reader.join(10)
        exits.append(proc.returncode)
        stderr += "".join(err)
        print(f"run attempt {attempt}: exit code {proc.returncode}; last lines:\n  "
              + "\n  ".join("".join(err).strip().splitlines()[-3:]), flush=True)
        if proc.returncode == 0:
            break
        if tracking.proc is None or tracking.proc.poll() is not None:
            tracking.start()
    wall = time.monotonic() - t0

    # -------------------------------------------------------------------------------- check it
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    client = MlflowClient(tracking.url)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "timing/step_s")]
    tables = [f.path for f in client.list_artifacts(run.info.run_id, "trajectories")]
    want = list(range(1, args.steps + 1))
    folder = Path(run.data.tags["factory.checkpoint_dir"])
    weights = load_file(folder / f"step_{args.steps}" / "hf" / "model.safetensors")
    import torch

    finite = all(bool(torch.isfinite(v).all()) for v in weights.values())
    metric = lambda key: sum(m.value for m in client.get_metric_history(run.info.run_id, key))  # noqa: E731
    tool_restarts = sum(metric(k) for k in run.data.metrics
                        if k.startswith("tool_servers/") and k.endswith("/restarts"))
    survived = {
        "status": run.info.status,
        "exit_codes": exits,
        "resumes": int(run.data.tags.get("factory.resumes", "0")),
        "steps_logged_once": sorted(steps) == want,
        "tables_logged_once": tables == [f"trajectories/step_{n:05d}.parquet" for n in want],
        "weights_finite": finite,
        "tool_calls_infra_errors": metric("tools/infra_errors"),
        "tool_server_restarts": tool_restarts,
        "judge_errors_after_retries": metric("rewards/judged/errors"),
        "non_finite_rewards_taken_as_missing": metric("rewards/judged/non_finite") + metric("rewards/wild/non_finite"),
        "updates_skipped_non_finite": metric("actor/skipped_non_finite"),
        "tracking_stalls_noted": stderr.count("does not answer"),
    }
    print("\ninjected:")
    for line in injected:
        print(f"  {line}")
    print(f"  judge: {judge.counts['requests']} requests, {judge.counts['500']} answered 500, "
          f"{judge.counts['429']} answered 429 (Retry-After: 1), {judge.counts['nan']} answered a NaN score")
    print("survived:")
    for k, v in survived.items():
        print(f"  {k}: {v}")
    print(f"wall time {wall / 60:.1f} min")
    tracking.stop()
    judge.server.shutdown()
    ok = (survived["status"] == "FINISHED" and survived["steps_logged_once"] and survived["tables_logged_once"]
          and finite)
    counts = {"ok": ok, "steps": args.steps, "seed": args.seed, "injected": len(injected), "judge": judge.counts,
              **survived, "wall_min": round(wall / 60, 1)}
    print(json.dumps(counts, sort_keys=True))
    return counts


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
