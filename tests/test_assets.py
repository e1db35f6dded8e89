"""Built-in model assets: caching, locking and the two real recipes."""
import threading
import time
from pathlib import Path

import pytest

from factory import assets
from factory.assets import KNOWN_ASSETS, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def counting_builder(monkeypatch):
    """Replace the tiny-qwen3 recipe by a slow fake that counts its builds."""
    builds = []

    def build(out: Path) -> None:
        builds.append(out)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")

    monkeypatch.setitem(assets._BUILDERS, "tiny-qwen3", build)
    return builds


def test_plain_paths_pass_through(cache):
    assert resolve_model("/models/my-model") == "/models/my-model"
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_unknown_asset_names_the_known_ones(cache):
    with pytest.raises(ValueError, match="unknown built-in model 'factory:nope'; known: factory:smollm2-135m-instruct, factory:tiny-qwen3"):
        resolve_model("factory:nope")
    assert set(KNOWN_ASSETS) == set(assets._BUILDERS)


def test_builds_once_into_the_cache(cache, counting_builder):
    first = resolve_model("factory:tiny-qwen3")
    assert resolve_model("factory:tiny-qwen3") == first and len(counting_builder) == 1
    assert Path(first) == cache / "models" / "tiny-qwen3-v2" and (Path(first) / "config.json").is_file()
    assert Path(first).stat().st_mode & 0o777 == 0o755


def test_concurrent_callers_build_once(cache, counting_builder):
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(resolve_model("factory:tiny-qwen3"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(counting_builder) == 1 and len(set(paths)) == 1


def test_a_failed_build_leaves_nothing_behind(cache, monkeypatch):
    def broken(out: Path) -> None:
        (out / "half.bin").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setitem(assets._BUILDERS, "tiny-qwen3", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model("factory:tiny-qwen3")
    assert [p.name for p in (cache / "models").iterdir()] == ["tiny-qwen3-v2.lock"]


def test_missing_package_says_how_to_install():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg"):
        assets.package_dir("no_such_pkg")


@pytest.mark.slow
def test_tiny_qwen3_recipe(cache):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("factory:tiny-qwen3")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert 9.7e6 < sum(p.numel() for p in model.parameters()) < 9.9e6
    assert (tok.eos_token, len(tok)) == ("<|im_end|>", 151669) and "<tool_call>" in tok.chat_template
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)  # the recipe is seeded: a rebuild gives the same weights
    rebuilt = AutoModelForCausalLM.from_config(model.config)
    assert all(torch.equal(before[k], v) for k, v in rebuilt.state_dict().items())


def test_smollm2_recipe():
    """The GGUF conversion: a working instruct model with the ChatML tokens. In the default suite because
    the README's main job trains this model. It checks the asset in $FACTORY_CACHE, the one that job uses:
    bin/setup builds it with this recipe (~20 s; a failed build fails set-up), and a cache without it
    builds it here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.rollout.chat import ChatFormat

    torch.set_num_threads(2)
    path = resolve_model("factory:smollm2-135m-instruct")
    assert "quantization_config" not in (Path(path) / "config.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    template = (Path(__file__).parent.parent / "prompts" / "chatml_tools.jinja").read_text()
    chat = ChatFormat(tok, template)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert chat.prompt_ids(messages, None) == list(tok.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, return_dict=False))
    ids = torch.tensor([chat.prompt_ids(messages, None)])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_a_build_killed_midway_is_cleared_by_the_next(cache, counting_builder):
    """A build ended by SIGTERM (bin/setup stops its model build so when a later step fails) never reaches its
    `finally`: its temporary folder stayed in the cache for good (SmolLM2: up to 538 MB). The next build, once
    it holds the lock that the dead one held, removes it."""
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", """
import time
from pathlib import Path
from factory import assets
def slow(out: Path) -> None:
    (out / "model.safetensors").write_bytes(b"x" * 1000)  # a half-written model
    time.sleep(60)
assets._BUILDERS["tiny-qwen3"] = slow
assets.resolve_model("factory:tiny-qwen3")
"""], env={**os.environ, "FACTORY_CACHE": str(cache)})
    try:
        deadline = time.monotonic() + 60
        while not list((cache / "models").glob(".tiny-qwen3-*/model.safetensors")):
            assert time.monotonic() < deadline and child.poll() is None, "the stand-in build never started"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=30)
    assert resolve_model("factory:tiny-qwen3") == str(cache / "models" / "tiny-qwen3-v2")
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-qwen3-v2", "tiny-qwen3-v2.lock"]


def test_a_build_clears_only_its_own_leftovers(cache, counting_builder, monkeypatch):
    """tiny-qwen3-calc is built from tiny-qwen3, inside its own build: tiny-qwen3's clearing must leave the calc
    build's temporary folder (whose name starts as tiny-qwen3's do) alone."""
    def calc(out: Path) -> None:
        resolve_model("factory:tiny-qwen3")
        (out / "config.json").write_text("{}")  # (its folder still there)

    monkeypatch.setitem(assets._BUILDERS, "tiny-qwen3-calc", calc)
    assert Path(resolve_model("factory:tiny-qwen3-calc"), "config.json").is_file()
