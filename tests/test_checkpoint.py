"""Checkpoints are committed atomically and pruned to `train.keep_checkpoints`; `factory export` copies one
out as a Hugging Face folder that transformers loads, with the run's chat template, from any ZeRO stage."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import factory.update.checkpoint as ckpt
from factory.commands import cli
from tests.test_update import (  # noqa: F401  (fixtures)
    batch,
    learners,
    make_spec,
    model_path,
)


def _fake(directory: Path, step: int) -> None:
    """A staged checkpoint with one file, committed the way the learner commits."""
    name = ckpt.tag(step)
    (ckpt.clear_staging(directory, name) / "weights").write_text(str(step))


def test_commit_prune_and_latest(tmp_path):
    for step in (1, 2, 3):
        _fake(tmp_path, step)
        ckpt.commit(tmp_path, ckpt.tag(step), keep=2)
    assert ckpt.complete(tmp_path) == ["step_2", "step_3"] and ckpt.read_latest(tmp_path) == "step_3"
    # an interrupted save leaves a staging folder and changes nothing a reader sees...
    _fake(tmp_path, 4)
    assert ckpt.read_latest(tmp_path) == "step_3" and ckpt.complete(tmp_path) == ["step_2", "step_3"]
    # ...and the next commit sweeps it away
    _fake(tmp_path, 5)
    ckpt.commit(tmp_path, "step_5", keep=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_3", "step_5"]
    # saving a step again (a resumed run reaching it) replaces it whole
    _fake(tmp_path, 5)
    (tmp_path / ckpt.staging(tmp_path, "step_5") / "weights").write_text("again")
    ckpt.commit(tmp_path, "step_5", keep=None)
    assert (tmp_path / "step_5" / "weights").read_text() == "again" and ckpt.read_latest(tmp_path) == "step_5"


def test_a_save_starts_by_removing_what_failed_saves_of_other_steps_left(tmp_path):
    """A save that failed on a full disk left `.incomplete-step_2/` (GBs); after the user made room and resumed,
    the save of step 3 removed only its own step's staging folder, kept the old one, and could fill the disk
    again (only a commit swept leftovers)."""
    _fake(tmp_path, 1)
    ckpt.commit(tmp_path, "step_1")
    (ckpt.clear_staging(tmp_path, "step_2") / "mp_rank_00_model_states.pt").write_bytes(b"half")  # the failed save
    (tmp_path / ckpt.staging(tmp_path, "step_2.old")).mkdir()  # a step folder moved aside by an interrupted commit
    staged = ckpt.clear_staging(tmp_path, "step_3")
    assert sorted(os.listdir(tmp_path)) == [".incomplete-step_3", "latest", "step_1"] and not os.listdir(staged)
    assert ckpt.read_latest(tmp_path) == "step_1" and (tmp_path / "step_1" / "weights").read_text() == "1"


def test_keep_never_deletes_what_latest_names(tmp_path):
    for step in (7, 8):
        _fake(tmp_path, step)
        ckpt.commit(tmp_path, ckpt.tag(step))
    ckpt.write_latest(tmp_path, "step_7")  # e.g. a fresh run that only got to its step 7
    assert ckpt.prune(tmp_path, keep=1) == []  # step_8 is the newest, step_7 the one `latest` names: both stay
    assert ckpt.complete(tmp_path) == ["step_7", "step_8"]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_crash_while_saving_leaves_the_previous_checkpoint_usable(small_path, model_path, learners, tmp_path,  # noqa: F811
                                                                     monkeypatch, stage):
    chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    spec = make_spec(small_path, model={"tokenizer": model_path},
                     train={"lr": 1e-2, "optimizer": {"name": "adamw"}, "keep_checkpoints": 2,
                            "deepspeed": {"zero_stage": stage}})
    learner = learners(spec)
    learner.chat_template = chat_template
    trajs = batch(seed=3)
    learner.step(trajs)
    learner.save_checkpoint(str(tmp_path), 1, {"data": {"epoch": 0, "cursor": 4}, "run_id": "abc"})
    at_1 = learner.state_dict()
    learner.step(trajs)

    def crash(*args, **kwargs):
        raise OSError("disk full")  # the save dies after DeepSpeed wrote its files, before the HF folder

    monkeypatch.setattr(type(learner.engine.module), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        learner.save_checkpoint(str(tmp_path), 2)
    monkeypatch.undo()
    assert ckpt.read_latest(tmp_path) == "step_1" and ckpt.complete(tmp_path) == ["step_1"]
    assert (tmp_path / ".incomplete-step_2").is_dir()

    resumed = learners(spec)
    assert resumed.load_checkpoint(str(tmp_path)) == 1
    for k, v in resumed.state_dict().items():
        torch.testing.assert_close(v, at_1[k], atol=0, rtol=0)
    assert ckpt.read_run_state(tmp_path / "step_1") == {"step": 1, "data": {"epoch": 0, "cursor": 4},
                                                        "run_id": "abc"}

    resumed.chat_template = chat_template
    for step in (2, 3, 4):
        resumed.step(trajs)
        resumed.save_checkpoint(str(tmp_path), step)
    assert ckpt.complete(tmp_path) == ["step_3", "step_4"] and ckpt.read_latest(tmp_path) == "step_4"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # the interrupted save was swept away
    final = resumed.state_dict()

    # factory export: a Hugging Face folder equal to the policy, with the run's chat template
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path.parent / f"exported-{stage}"
    assert cli.main(["export", str(tmp_path), "--out", str(out)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    for folder in (tmp_path / "step_4" / "hf", out):  # readable by a server run as another user (transformers: 0600)
        assert {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}["model.safetensors"] == 0o666 & ~umask
    model = AutoModelForCausalLM.from_pretrained(out)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, final[k], atol=0, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    assert cli.main(["export", str(tmp_path), "--step", "3", "--out", str(out)]) == 2  # never overwrites
    assert cli.main(["export", str(tmp_path), "--step", "1", "--out", str(tmp_path.parent / "x")]) == 2  # pruned


def test_export_errors_are_clear(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "holds no complete checkpoint (no `latest` marker): its run saved no checkpoint there" in capsys.readouterr().err
    assert cli.main(["export", "0123456789abcdef", "--out", str(tmp_path / "o"),
                     "--uri", f"sqlite:///{tmp_path}/mlflow.db"]) == 2
    assert ("'0123456789abcdef' is not a checkpoint folder, and no tracking store at "  # none there: none made
            f"sqlite:///{tmp_path}/mlflow.db (no file {tmp_path}/mlflow.db here)") in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()


def test_every_file_is_on_disk_before_the_commit_names_it(tmp_path, monkeypatch):
    """A power cut after the rename must not leave a committed name over files the disk never received:
    each file and folder of the checkpoint is fsynced before the rename, and the manifest lists them."""
    _fake(tmp_path, 1)
    staged = tmp_path / ckpt.staging(tmp_path, "step_1")
    (staged / "hf").mkdir()
    (staged / "hf" / "model.safetensors").write_bytes(b"w" * 100)
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: renamed.append((str(a), len(synced))) or real_replace(a, b))
    ckpt.commit(tmp_path, "step_1")
    before_rename = set(synced[: renamed[0][1]])
    assert renamed[0][0] == str(staged)
    on_disk = {str(staged / rel) for rel in ("weights", "hf/model.safetensors", ckpt.MANIFEST, "hf", "")}
    assert {p.rstrip("/") for p in on_disk} <= before_rename, before_rename
    manifest = json.loads((tmp_path / "step_1" / ckpt.MANIFEST).read_text())
    assert manifest["hf/model.safetensors"]["size"] == 100 and ckpt.verify(tmp_path / "step_1") is None
    with open(tmp_path / "step_1" / "hf" / "model.safetensors", "r+b") as f:
        f.truncate(50)
    assert ckpt.verify(tmp_path / "step_1").endswith("holds 50 bytes, 100 were saved")


def _hf_checkpoint(directory: Path, step: int) -> Path:
    """A committed checkpoint holding a (fake) Hugging Face folder, with its manifest."""
    staged = ckpt.clear_staging(directory, ckpt.tag(step)) / "hf"
    staged.mkdir()
    (staged / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (staged / "tokenizer_config.json").write_text("{}")
    (staged / "model.safetensors").write_bytes(b"w" * 4096)
    return ckpt.commit(directory, ckpt.tag(step))


def test_export_refuses_a_checkpoint_not_as_saved_however_it_is_named(tmp_path, capsys):
    """A weights file cut short after the save (a disk filled, an interrupted copy) is refused whether RUN is
    the run's checkpoint folder or one step's folder (this one was copied out as it was)."""
    step = _hf_checkpoint(tmp_path / "ckpt", 3)
    with open(step / "hf" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    said = f"{step} is not as it was saved: {step}/hf/model.safetensors holds 100 bytes, 4096 were saved"
    for run in (tmp_path / "ckpt", step):
        assert cli.main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_export_into_the_empty_working_directory(tmp_path, monkeypatch):
    """`--out .` is an empty folder too: its staging folder was named from Path('.').name, which is empty
    ("internal error: ValueError"); and the folder is filled, not removed and made again under the shell."""
    _hf_checkpoint(tmp_path / "ckpt", 3)
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path / "model")
    here = os.stat(".").st_ino
    assert cli.main(["export", str(tmp_path / "ckpt"), "--out", "."]) == 0
    assert sorted(p.name for p in Path.cwd().iterdir()) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert os.stat(".").st_ino == here and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model"]


def test_export_refuses_a_checkpoint_that_lost_its_manifest_where_the_others_have_theirs(tmp_path, capsys):
    """A checkpoint without manifest.json was taken as one saved before manifests existed even where its run's
    other checkpoints have theirs, so weights cut short were exported as a model (exit 0); `--resume` refuses it.
    Whether RUN is the run's folder or the step's folder, the run's folder is asked."""
    _hf_checkpoint(tmp_path / "ckpt", 1)
    step = _hf_checkpoint(tmp_path / "ckpt", 3)
    (step / ckpt.MANIFEST).unlink()
    with open(step / "hf" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    said = f"{step} is not as it was saved: {step / ckpt.MANIFEST} is missing, where the run's other checkpoints"
    for run in (tmp_path / "ckpt", step):
        assert cli.main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
    (tmp_path / "ckpt" / "step_1" / ckpt.MANIFEST).unlink()  # a run saved before manifests: none has one
    assert cli.main(["export", str(step), "--out", str(tmp_path / "out")]) == 0


def test_an_export_that_cannot_be_written_says_why_and_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """A copy that failed part way (a full disk, a step pruned by its run while it was copied, an --out under a
    file) was an internal error and left the partial staging folder `.NAME.exporting` (GBs) beside --out."""
    import errno
    import shutil

    step = _hf_checkpoint(tmp_path / "ckpt", 3)
    (tmp_path / "exports").mkdir()
    out = tmp_path / "exports" / "model"
    real_copy2, real_copytree = shutil.copy2, shutil.copytree

    def full_disk(src, dst, **kw):
        real_copy2(src, dst, **kw)
        if str(src).endswith(".safetensors"):  # the weights partly written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(shutil, "copytree", lambda src, dst, **kw: real_copytree(src, dst, copy_function=full_disk))
    assert cli.main(["export", str(tmp_path / "ckpt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {out}: " in err and "No space left on device" in err, err
    assert list((tmp_path / "exports").iterdir()) == []

    def pruned(src, dst, **kw):
        real_copytree(src, dst, **kw)
        shutil.rmtree(step)  # the run committed step 4 and pruned step 3 (train.keep_checkpoints: 1)
        raise shutil.Error([(str(src / "model.safetensors"), str(dst / "model.safetensors"), "[Errno 2] gone")])

    monkeypatch.setattr(shutil, "copytree", pruned)
    assert cli.main(["export", str(tmp_path / "ckpt"), "--out", str(out)]) == 2
    assert (f"{step}: the checkpoint was removed while it was copied (pruned by its run?): export again"
            in capsys.readouterr().err)
    assert list((tmp_path / "exports").iterdir()) == []

    monkeypatch.setattr(shutil, "copytree", real_copytree)
    step = _hf_checkpoint(tmp_path / "ckpt", 3)
    (tmp_path / "a-file").write_text("x")
    assert cli.main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a-file" / "model")]) == 2
    assert f"cannot write {tmp_path / 'a-file' / 'model'}: Not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("base_files", [{"config.json": json.dumps({"model_type": "qwen3"})}, {}],
                         ids=["config-without-weights", "empty-folder"])
def test_a_lora_export_whose_base_model_cannot_be_loaded_says_so(tmp_path, capsys, base_files):
    """The merge loads the base model the adapters name; its failure (a cache folder cut short: an OSError) was
    said as "cannot write OUT", of a folder that is writable, and an empty base folder's ValueError ("Unrecognized
    model") was an internal error."""
    base = tmp_path / "base"
    base.mkdir()
    for name, text in base_files.items():
        (base / name).write_text(text)
    staged = ckpt.clear_staging(tmp_path / "ckpt", ckpt.tag(1)) / "adapter"
    staged.mkdir()
    (staged / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": 2,
        "lora_alpha": 4, "target_modules": ["q_proj"]}))
    (staged / "tokenizer_config.json").write_text("{}")
    (staged / "adapter_model.safetensors").write_bytes(b"w" * 64)
    step = ckpt.commit(tmp_path / "ckpt", ckpt.tag(1))
    (tmp_path / "exports").mkdir()
    out = tmp_path / "exports" / "model"
    assert cli.main(["export", str(tmp_path / "ckpt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"factory: {step / 'adapter'}: its base model {base} cannot be loaded: " in err, err
    assert "cannot write" not in err, err
    assert list((tmp_path / "exports").iterdir()) == []


def test_a_lora_export_whose_adapters_do_not_load_into_their_base_says_so(tmp_path, capsys):
    """Adapters whose weights file is not safetensors (saved so: the manifest agrees), or that were trained on a
    model of other shapes than the base they name, were an internal error (exit 1: SafetensorError, peft's
    RuntimeError "size mismatch"): the adapter folder, the cause and what to do, exit 2, no staging folder left."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from factory.assets import resolve_model
    from tests.test_lora import _adapter_folder

    base = resolve_model("factory:tiny-qwen3")
    config = AutoConfig.from_pretrained(base)
    config.hidden_size, config.head_dim = 32, 16  # a model of the same kind, other shapes
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "narrow")

    def checkpoint(name, damage):
        staged = ckpt.clear_staging(tmp_path / name, ckpt.tag(1)) / "adapter"
        _adapter_folder(staged, base)
        damage(staged)
        return ckpt.commit(tmp_path / name, ckpt.tag(1)) / "adapter"

    def other_base(adapter):
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config,
                                                                 "base_model_name_or_path": str(tmp_path / "narrow")}))

    (tmp_path / "exports").mkdir()
    for name, damage, cause, base_named in [
            ("corrupt", lambda a: (a / "adapter_model.safetensors").write_bytes(b"w" * 64), "header too large", base),
            ("shapes", other_base, "size mismatch for base_model.model.model.layers.0.self_attn.q_proj.lora_A",
             tmp_path / "narrow")]:
        adapter = checkpoint(name, damage)
        assert cli.main(["export", str(tmp_path / name), "--out", str(tmp_path / "exports" / "model")]) == 2, name
        err = capsys.readouterr().err
        assert f"factory: {adapter}: its adapters cannot be merged into the base model {base_named}: " in err, err
        assert cause in err and "export another step (--step N), or --adapter" in err, err
        assert "internal error" not in err and list((tmp_path / "exports").iterdir()) == [], name


def test_export_of_train_checkpoint_dir_takes_its_newest_runs_checkpoint(tmp_path, capsys):
    """`factory export --help` offers train.checkpoint_dir as RUN, but that folder holds the runs' own folders and
    `newest`, no `latest`: export said untruly "its run saved no checkpoint there". And the `vllm serve` line it
    printed did not quote --out, so pasted it gave vllm two arguments."""
    import shlex

    checkpoint_dir = tmp_path / "runs" / "tiny"
    first, second = (checkpoint_dir / f"tiny-2026120{i}-101010-0123abcd" for i in (1, 2))
    _hf_checkpoint(first, 2)
    step = _hf_checkpoint(second, 3)
    ckpt.point_newest(second)
    out = tmp_path / "my model"
    assert cli.main(["export", str(checkpoint_dir), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"exported {step / 'hf'} -> {out}" in said, said
    (line,) = [ln for ln in said.splitlines() if "vllm serve" in ln]
    assert shlex.split(line.split("vLLM:", 1)[1]) == ["vllm", "serve", str(out)], line
    (checkpoint_dir / ckpt.NEWEST).unlink()  # (a folder of runs saved before `newest` was)
    assert cli.main(["export", str(checkpoint_dir), "--out", str(tmp_path / "o")]) == 2
    assert (f"{checkpoint_dir} holds the checkpoint folders of runs, not one run's checkpoints: give one of "
            f"{first.name}, {second.name}") in capsys.readouterr().err


def test_export_of_a_full_checkpoint_imports_no_torch(tmp_path):
    """It is a copy (export.py's docstring), yet factory.update.checkpoint imported torch at its top (for the RNG
    state alone): seconds and GBs of memory for a copy."""
    import subprocess
    import sys

    _hf_checkpoint(tmp_path / "ckpt", 3)
    code = ("import sys; from factory.commands.cli import main; "
            f"rc = main(['export', {str(tmp_path / 'ckpt')!r}, '--out', {str(tmp_path / 'out')!r}]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"
