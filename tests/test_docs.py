"""Every command and snippet in the docs runs (tests/docblocks.py says how each kind of block is run)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import docblocks, docfork
from tests.docblocks import REPO, Block, check_links, parse, run_block, workdir

PAGES = sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "CONTRIBUTING.md"])


def _has_slow_blocks(path: Path) -> bool:
    try:
        return any("slow" in b.attrs for b in parse(path).blocks)
    except docblocks.DocError:  # a page the harness refuses fails its own test_page, not the collection
        return False


SLOW_PAGES = [p for p in PAGES if _has_slow_blocks(p)]


def _run_page(path: Path, cwd: Path, slow: bool) -> None:
    page = parse(path)
    servers = []
    try:
        for block in page.blocks:
            if (server := run_block(block, cwd, slow=slow)) is not None:
                servers.append(server)
    finally:
        for server in servers:
            docblocks.stop(server)
    assert not check_links(page)


@pytest.fixture(scope="module")
def fork_server():
    with docblocks.fork_server():
        yield


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_page(path, tmp_path, fork_server):
    _run_page(path, workdir(tmp_path), slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("path", SLOW_PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_page_with_its_slow_blocks(path, tmp_path):
    """The same page with the blocks marked `slow` run too (the quickstart's whole training run...)."""
    _run_page(path, workdir(tmp_path), slow=True)


def test_the_readme_s_own_reward_requires_the_answer_column(project):
    """A reward whose `answer` has a default (`answer=""`) does not make the data stage require the column:
    data without it scored 0 on every sample. The README's example is what users copy."""
    from factory.compiler.load import load_spec
    from factory.reward.graph import required_columns

    block = next(b for b in parse(REPO / "README.md").blocks if b.attrs.get("file") == "rewards/math.py")
    namespace: dict = {}
    exec(block.text, namespace)
    spec = load_spec(project.spec("""\
        name: x
        model: {path: "factory:tiny-qwen3"}
        data: {train: {generator: factory.data:arithmetic}, answer_key: gold}
        rewards: {mine: {fn: "rewards.math:short_and_right"}}
        """))
    assert required_columns(spec, {"mine": namespace["short_and_right"]}) == {"gold": "rewards.mine"}


# ------------------------------------------------------------------------------ the harness itself
def _page(tmp_path: Path, text: str) -> list[Block]:
    path = REPO / "docs" / ".harness-test.md"  # under REPO so that messages name it as a page
    path.write_text(text)
    try:
        return parse(path).blocks
    finally:
        path.unlink()


def test_harness_parses_info_strings(tmp_path):
    (block,) = _page(tmp_path, '# t\n\n```bash run-overrides="train.steps=1 a.b=2" skip="no GPU"\nx\n```\n')
    assert (block.lang, block.attrs, block.text, block.line) == (
        "bash", {"run-overrides": "train.steps=1 a.b=2", "skip": "no GPU"}, "x\n", 3)


def test_harness_closes_a_block_where_github_does(tmp_path):
    """Only a line of nothing but the opening fence's character, at least as many, closes a block
    (CommonMark, which GitHub renders): a shorter fence inside is the block's text."""
    (block,) = _page(tmp_path, "````markdown\n```bash\nx\n```\n````\n")
    assert (block.lang, block.text) == ("markdown", "```bash\nx\n```\n")


def test_a_fence_with_text_after_it_inside_a_block_is_refused(tmp_path):
    # GitHub takes "``` text" as more of the block, which then runs on over the headings below it
    with pytest.raises(docblocks.DocError, match=r"docs/.harness-test.md:3: .*closes no block on GitHub"):
        _page(tmp_path, "```yaml\na: 1\n``` The text after it.\n\n## A heading\n\n```yaml\nb: 2\n```\n")


def test_anchors_skip_headings_in_blocks_as_github_does():
    page = REPO / "docs" / ".harness-test.md"
    page.write_text("````markdown\n```\n# inside\n````\n\n# outside\n")
    try:
        assert docblocks.anchors(page) == {"outside"}
    finally:
        page.unlink()


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_harness_runs_the_blocks_github_shows(path):
    """The harness's blocks are those that GitHub renders (markdown-it-py, rich's markdown parser, is CommonMark)."""
    from markdown_it import MarkdownIt

    fences = [t.map[0] + 1 for t in MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))
              if t.type == "fence"]
    assert [b.line for b in parse(path).blocks] == fences


def test_harness_appends_overrides_to_factory_run_only():
    script = ("factory check s.yaml && factory run s.yaml a=1 | tee log\nfactory run t.yaml  # c; factory run u\n"
              "factory run 'x#y.yaml' a=b#c")
    assert docblocks._with_overrides(script, "train.steps=1") == (
        "factory check s.yaml && factory run s.yaml a=1 train.steps=1 | tee log\n"
        "factory run t.yaml train.steps=1  # c; factory run u\n"  # before the comment, never in it
        "factory run 'x#y.yaml' a=b#c train.steps=1")  # a # in quotes or inside a word starts no comment
    script = docblocks._with_overrides("echo factory run t.yaml  # five steps", "train.steps=1")
    assert subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout == \
        "factory run t.yaml train.steps=1\n"


def test_console_output_matching():
    m = docblocks._matches
    assert m(["a", "...", "d"], ["a", "b", "c", "d"])
    assert m(["a", "...", "d"], ["a", "d"])
    assert m(["run ... in 1.3 s"], ["run 4f3a in 1.3 s"])
    assert not m(["a", "d"], ["a", "b", "d"])
    assert not m(["x ... y"], ["x z"])


def test_harness_fails_loudly(tmp_path):
    cwd = workdir(tmp_path)
    blocks = _page(tmp_path, "```console\n$ echo hi\nbye\n```\n\n```bash\nfalse\n```\n\n```toml\na = 1\n```\n\n"
                             "```yaml\ntrain: {lr: 1}\n```\n\n```bash skip=\"\"\ntrue\n```\n\n"
                             "```console slow=\"a long run\"\n$ echo 'unclosed\n```\n")
    messages = []
    for block in blocks:
        with pytest.raises(AssertionError) as e:
            run_block(block, cwd, timeout=60)
        messages.append(str(e.value).splitlines()[0])
    assert messages == [
        "docs/.harness-test.md:1: `$ echo hi` printed something else than the page shows:",
        "docs/.harness-test.md:6: the commands failed",
        ("docs/.harness-test.md:10: the harness does not run a `toml` block: give it file=PATH, skip=\"why\", "
         "or write it as console/bash/yaml/python"),
        ("docs/.harness-test.md:14: a yaml block needs base=SPEC (checked as SPEC with these sections), "
         "file=PATH, skip=\"why\", or to be a whole spec"),
        "docs/.harness-test.md:18: skip needs a reason: skip=\"why this block cannot run here\"",
        "docs/.harness-test.md:22: shell syntax error",
    ]


def test_yaml_fragment_is_checked_against_its_base(tmp_path):
    cwd = workdir(tmp_path)
    ok, bad = _page(tmp_path, "```yaml base=specs/tiny.yaml\ntrain: {steps: 3}\n```\n\n"
                              "```yaml base=specs/tiny.yaml\ntrain: {stepz: 3}\n```\n")
    run_block(ok, cwd)
    with pytest.raises(AssertionError, match="unknown key 'stepz'; did you mean 'steps'"):
        run_block(bad, cwd)


def test_links_and_anchors_are_checked(tmp_path):
    page = REPO / "docs" / ".harness-test.md"
    page.write_text("# A title: here\n\n[ok](#a-title-here) [file](reference/spec.md#algorithmkl) "
                    "[gone](nowhere.md) [bad anchor](reference/spec.md#nope) [web](https://example.org)\n")
    try:
        assert check_links(parse(page)) == [
            "docs/.harness-test.md:3: broken link nowhere.md",
            "docs/.harness-test.md:3: no heading makes the anchor #nope in reference/spec.md",
        ]
    finally:
        page.unlink()


def test_a_spec_that_a_later_block_checks_is_checked_there_only(tmp_path):
    spec, other, _ = _page(tmp_path, "```yaml file=s.yaml\nname: s\n```\n\n```yaml file=t.yaml\nname: t\n```\n\n"
                                     "```console\n$ factory check s.yaml --connect\n```\n")
    assert "checked-later" in spec.attrs and "checked-later" not in other.attrs


def test_every_test_a_page_cites_exists():
    """docs/reliability.md (and other pages) prove each guarantee by naming a test: a renamed or removed test
    left the claim standing with nothing behind it."""
    import re

    cited = [(page.relative_to(REPO).as_posix(), m[1], m[2]) for page in PAGES
             for m in re.finditer(r"(tests/[\w/]+\.py)::(\w+)", page.read_text())]
    missing = [c for c in cited if not (REPO / c[1]).is_file()
               or not re.search(rf"^(async )?def {c[2]}\b", (REPO / c[1]).read_text(), re.M)]
    assert len(cited) > 20 and not missing, missing  # (56 citations when this was written)


def test_the_fork_server_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """A test session killed hard never reaches fork_server's `finally`: the server outlived it (with any
    command it had forked) until found by hand. It now looks for its parent every PARENT_CHECK_S."""
    sock = tmp_path / "socket"
    starter = subprocess.Popen(  # stands for the test session: starts the server as fork_server does, then waits
        [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen([sys.executable, sys.argv[1], "
         "sys.argv[2]], start_new_session=True); print(p.pid, flush=True); time.sleep(600)", docfork.__file__,
         str(sock)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    server = int(starter.stdout.readline())
    deadline = time.monotonic() + 60
    while not sock.exists():  # serving: past its imports
        assert time.monotonic() < deadline, "the fork server did not start"
        time.sleep(0.05)

    def alive() -> bool:
        try:
            return Path(f"/proc/{server}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    try:
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 10 * docfork.PARENT_CHECK_S
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(), "the fork server outlived the process that started it"
    finally:
        if alive():
            os.kill(server, signal.SIGKILL)
