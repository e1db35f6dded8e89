"""Loading: YAML -> OmegaConf -> pydantic, every error at its file, line and dotted path."""
from __future__ import annotations

import pytest
import yaml

from factory.compiler.errors import SpecErrors
from factory.compiler.load import load, load_all, load_spec
from tests.test_compiler_support import base_spec as _base
from tests.test_compiler_support import report


def test_valid_spec_loads_with_defaults(project):
    spec = load_spec(project.spec(_base(project, "rw_valid")))
    assert spec.name == "demo"
    assert spec.train.lr == 1e-6
    assert spec.train.checkpoint_dir == "runs/demo"  # the schema's `runs/${name}` default, resolved


def test_nearest_prefers_the_one_name_holding_every_word():
    from factory.compiler.translate import nearest

    assert nearest("get_time", ["convert_time", "get_current_time"]) == "get_current_time"  # difflib: convert_time
    assert nearest("stpes", ["steps", "seed"]) == "steps" and nearest("lr_rate", ["lr", "warmup_steps"]) == "lr"


def test_nearest_prefers_the_name_with_the_typos_own_letters():
    """Swapped letters are the commonest slip: difflib ranked `gspo` with `grpo` for `gpro` (0.75 each, a tie
    it breaks by reverse alphabetical order) and a dropped or changed letter above a swap (`reward` 0.92,
    `rewards` 0.86), so the name meant lost to a name one letter off."""
    from factory.compiler.translate import nearest
    from factory.presets import PRESETS, did_you_mean

    assert nearest("gpro", ["grpo", "gspo"]) == nearest("rgpo", ["gspo", "grpo"]) == "grpo"
    assert nearest("rewarsd", ["reward", "rewards"]) == "rewards"
    assert nearest("to_pk", ["top_p", "top_k"]) == "top_k"
    assert nearest("eval_temp", ["eval_every", "eval_temperature"]) == "eval_temperature"  # not the fewest edits
    assert did_you_mean("gpro", PRESETS) == " (did you mean 'grpo'?)"  # the algorithm's name: the same ranking


def test_misspelled_key_suggests_the_nearest(project):
    path = project.spec(_base(project, "rw_typo") + "train:\n  lr_rate: 1.0e-5\n  stpes: 3\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:10: train.lr_rate: unknown key 'lr_rate'; did you mean 'lr'?\n"
        "spec.yaml:11: train.stpes: unknown key 'stpes'; did you mean 'steps'?\n"
        "2 errors in spec.yaml")


def test_unknown_key_without_a_near_one_lists_the_valid_keys(project):
    path = project.spec(_base(project, "rw_unknown") + "tracking: {colour: red}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e).splitlines()[0] == (
        "spec.yaml:9: tracking.colour: unknown key 'colour'; expected one of: experiment, uri, tags, record_tools, "
        "log_trajectories")


def test_wrong_types_name_the_expected_type(project):
    path = project.spec(_base(project, "rw_types") + """\
train: {steps: many, lr: fast, bf16_autocast: maybe}
rollout: {engine: vlm, group_size: 0}
algorithm: {clip: [0.2]}
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:9: train.steps: expected an integer, got 'many'\n"
        "spec.yaml:9: train.lr: expected a number, got 'fast'\n"
        "spec.yaml:9: train.bf16_autocast: expected true or false, got 'maybe'\n"
        "spec.yaml:10: rollout.engine: expected 'auto', 'hf' or 'vllm', got 'vlm'\n"
        "spec.yaml:10: rollout.group_size: must be >= 1, got 0\n"
        "spec.yaml:11: algorithm.clip: expected a list of 2 items\n"
        "6 errors in spec.yaml")


def test_true_is_not_a_number_and_inf_is_not_a_learning_rate(project):
    """pydantic's lax mode reads `steps: true` as 1 step and `lr: true` as 1.0, and takes `.inf`: wrong
    values accepted in silence."""
    path = project.spec(_base(project, "rw_bools") + """\
train: {steps: true, lr: .inf, optimizer: {betas: [0.9, false]}, bf16_autocast: true}
rollout: {top_k: false}
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["rewards.correct.fn=factory.rewards.math:numeric_match", "algorithm.clip=[true,0.2]"])
    assert report(e) == (
        "spec.yaml:9: train.steps: expected an integer, got true\n"
        "spec.yaml:9: train.lr: expected a finite number, got inf\n"
        "spec.yaml:9: train.optimizer.betas.1: expected a number, got false\n"
        "spec.yaml:10: rollout.top_k: expected an integer, got false\n"
        "<override 2>: algorithm.clip.0: expected a number, got true\n"
        "5 errors in spec.yaml")


def test_a_plain_value_where_a_section_goes_says_the_mapping_to_write(project):
    """`model: NAME`, `algorithm: grpo`, a sum's nodes as a list: "expected a mapping, got 'grpo'" said no fix.
    The key is the section's one required key, else its first; a value that key does not take gets none."""
    path = project.spec("""\
name: demo
model: factory:tiny-qwen3
data:
  train: data/train.jsonl
rewards:
  correct: {fn: "{mod}:exact"}
  total: {sum: [correct, fmt]}
algorithm: grpo
train: {deepspeed: ds_config.json}
""".replace("{mod}", project.module("rw_plain")))
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:2: model: expected a mapping, got 'factory:tiny-qwen3'; write `model: {path: factory:tiny-qwen3}`\n"
        "spec.yaml:4: data.train: expected a mapping, got 'data/train.jsonl'; write `train: {path: data/train.jsonl}`\n"
        "spec.yaml:7: rewards.total.sum: expected a mapping, got a list; write `sum: {correct: 1.0, fmt: 1.0}`\n"
        "spec.yaml:8: algorithm: expected a mapping, got 'grpo'; write `algorithm: {name: grpo}`\n"
        "spec.yaml:9: train.deepspeed: expected a mapping, got 'ds_config.json'\n"
        "5 errors in spec.yaml")
    lists = _base(project, "rw_lists").replace("rewards:", "rewards: [factory.rewards.math:numeric_match, "
                                                "factory.rewards.format:tool_call_ok]\nold:")
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec(lists + "metrics: [correct]\n"))
    assert report(e).splitlines()[:3] == [
        "spec.yaml:5: rewards: expected a mapping, got a list; write `rewards: {numeric_match: {fn: "
        "factory.rewards.math:numeric_match}, tool_call_ok: {fn: factory.rewards.format:tool_call_ok}}`",
        "spec.yaml:6: old: unknown key 'old'; expected one of: name, seed, model, chat_template, chat_template_kwargs, "
        "data, tools, rewards, reward, metrics, algorithm, rollout, train, tracking, replay, resources, extends",
        "spec.yaml:10: metrics: expected a mapping, got a list; write `metrics: {correct: correct}`"]
    with pytest.raises(SpecErrors) as e:  # `a: b` names no function: nothing evident to write
        load_spec(project.spec(lists.replace("tool_call_ok]", "tool_call_ok, 'a: b']")))
    assert report(e).splitlines()[0] == "spec.yaml:5: rewards: expected a mapping, got a list"


def test_a_plain_value_for_a_reward_node_or_tool_server_says_the_node_to_write(project):
    """`correct: mod:fn` for a reward node, a command line or a URL for a tool server: "expected a mapping with one
    of the keys: fn, llm_judge, ..." named the keys but not which one the value meant."""
    path = project.spec(_base(project, "rw_nodes").replace("rewards:", "rewards:\n  plain: factory.rewards.math:"
                                                           "numeric_match\n  three: 3\n  word: plain\n"
                                                           "  dots: factory.rewards.math.numeric_match\n"
                                                           "  served: web.lookup\n  server: web\nold_rewards:") + """\
tools:
  calc: sh -c 'my_calc --port 1'
  web: https://example.com/mcp
  fn: my_tools:lookup
  shell: sh
  dotted: my.server
metrics: {}
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    keys = "fn, llm_judge, tool, sum, min, max, product, gate, clip, normalize"
    assert [line for line in report(e).splitlines() if "expected a mapping with" in line] == [
        f"spec.yaml:6: rewards.plain: expected a mapping with one of the keys: {keys}, got "
        "'factory.rewards.math:numeric_match'; write `plain: {fn: factory.rewards.math:numeric_match}`",
        f"spec.yaml:7: rewards.three: expected a mapping with one of the keys: {keys}, got 3",
        f"spec.yaml:8: rewards.word: expected a mapping with one of the keys: {keys}, got 'plain'",
        # (an import path as the compiler takes it; a tool of one of the spec's servers)
        f"spec.yaml:9: rewards.dots: expected a mapping with one of the keys: {keys}, got "
        "'factory.rewards.math.numeric_match'; write `dots: {fn: factory.rewards.math:numeric_match}`",
        f"spec.yaml:10: rewards.served: expected a mapping with one of the keys: {keys}, got 'web.lookup'; write "
        "`served: {tool: web.lookup}`",
        f"spec.yaml:11: rewards.server: expected a mapping with one of the keys: {keys}, got 'web'",  # (no tool named)
        "spec.yaml:17: tools.calc: expected a mapping with one of the keys: command, url, function, "
        "got 'sh -c 'my_calc --port 1''; write `calc: {command: sh, args: [-c, my_calc --port 1]}`",
        "spec.yaml:18: tools.web: expected a mapping with one of the keys: command, url, function, got "
        "'https://example.com/mcp'; write `web: {url: https://example.com/mcp}`",
        "spec.yaml:19: tools.fn: expected a mapping with one of the keys: command, url, function, got "
        "'my_tools:lookup'; write `fn: {function: my_tools:lookup}`",
        "spec.yaml:20: tools.shell: expected a mapping with one of the keys: command, url, function, got 'sh'; "
        "write `shell: {command: sh}`",
        "spec.yaml:21: tools.dotted: expected a mapping with one of the keys: command, url, function, got "
        "'my.server'"]


def test_packing_on_and_off_unquoted_are_the_words(project):
    """YAML 1.1 (PyYAML, OmegaConf) reads an unquoted on/off as true/false: `packing: on`, as the docs write
    it, was refused with "expected 'auto', 'on' or 'off', got true", and `train.packing=on` too."""
    path = project.spec(_base(project, "rw_packing") + "train: {packing: on}\n")
    assert load_spec(path).train.packing == "on"
    assert load_spec(path, ["train.packing=off"]).train.packing == "off"
    assert load_spec(path, ["train.packing=yes"]).train.packing == "on"  # YAML 1.1's true too
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["train.packing=of"])
    assert report(e).splitlines()[0] == "<override 1>: train.packing: expected 'auto', 'on' or 'off', got 'of'"


def test_a_null_mapping_says_how_to_drop_a_base_specs_entries(project):
    """`tools: null` to drop the servers a base spec sets: "expected a mapping, got null" said nothing of how."""
    path = project.spec(_base(project, "rw_nulltools") + "tools: null\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == ("spec.yaml:9: tools: expected a mapping, got null; to drop what a base spec (extends) sets "
                         "here, null each of its entries ({NAME: null}); an empty mapping is {}\n1 error in spec.yaml")


def test_an_empty_mapping_override_empties_the_section(project):
    """`tools={}` was merged into the spec's tools, changing nothing, in silence (and `tools=null`'s error
    says an empty mapping is {})."""
    path = project.spec(_base(project, "rw_emptytools") + "tools:\n  calc: {command: python, args: [-m, x]}\n")
    assert set(load_spec(path).tools) == {"calc"}
    assert load_spec(path, ["tools={}"]).tools == {}


def test_numbers_out_of_their_range_name_the_bound(project):
    # each of these was accepted once; concurrency 0 hung every call to the server (a semaphore of 0 slots)
    path = project.spec(_base(project, "rw_bounds") + """\
tools:
  calc: {command: python, concurrency: 0, timeout_s: 0, retries: -1, max_result_chars: -5}
rollout: {temperature: 0, top_p: 5, top_k: -1, batch_size: 0}
train: {lr: -1, warmup_steps: -5, checkpoint_every: -1, eval_every: -1, eval_size: 0, threads: 0,
        optimizer: {weight_decay: -0.1, grad_clip: -1, betas: [0.9, 1.0]}}
tracking: {log_trajectories: -1}
resources: {object_store_gb: 0}
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:10: tools.calc.concurrency: must be >= 1, got 0\n"
        "spec.yaml:10: tools.calc.timeout_s: must be > 0, got 0\n"
        "spec.yaml:10: tools.calc.retries: must be >= 0, got -1\n"
        "spec.yaml:10: tools.calc.max_result_chars: must be >= 1, got -5\n"
        "spec.yaml:11: rollout.temperature: must be > 0, got 0\n"
        "spec.yaml:11: rollout.top_p: must be <= 1, got 5\n"
        "spec.yaml:11: rollout.top_k: must be >= 0, got -1\n"
        "spec.yaml:11: rollout.batch_size: must be >= 1, got 0\n"
        "spec.yaml:12: train.lr: must be > 0, got -1\n"
        "spec.yaml:12: train.warmup_steps: must be >= 0, got -5\n"
        "spec.yaml:12: train.checkpoint_every: must be >= 0, got -1\n"
        "spec.yaml:12: train.eval_every: must be >= 0, got -1\n"
        "spec.yaml:12: train.eval_size: must be >= 1, got 0\n"
        "spec.yaml:12: train.threads: must be >= 1, got 0\n"
        "spec.yaml:13: train.optimizer.weight_decay: must be >= 0, got -0.1\n"
        "spec.yaml:13: train.optimizer.grad_clip: must be >= 0, got -1\n"
        "spec.yaml:13: train.optimizer.betas.1: must be < 1, got 1.0\n"
        "spec.yaml:14: tracking.log_trajectories: must be >= 0, got -1\n"
        "spec.yaml:15: resources.object_store_gb: must be > 0, got 0\n"
        "19 errors in spec.yaml")


def test_threads_past_any_machine_are_refused(project):
    """`threads: 99999999999999999999` passed check and overflowed torch.set_num_threads (a C int) in each stage."""
    path = project.spec(_base(project, "rw_threads"))
    assert load_spec(path, ["train.threads=4096"]).train.threads == 4096
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["train.threads=99999999999999999999"])
    assert report(e) == "<override 1>: train.threads: must be <= 4096, got 99999999999999999999\n1 error in spec.yaml"


def test_numbers_out_of_range_in_model_data_judge_and_algorithm(project):
    text = _base(project, "rw_bounds2").replace('"factory:tiny-qwen3"}', '"factory:tiny-qwen3", lora: {alpha: 0}}')
    path = project.spec(text.replace("size: 8}", "size: 0}") + """\
  judge: {llm_judge: prompts/judge.jinja, local: {path: "factory:tiny-qwen3", num_cpus: -1}, timeout_s: 0}
algorithm: {overlong: {buffer: 4, penalty: -1}}
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:2: model.lora.alpha: must be > 0, got 0\n"
        "spec.yaml:4: data.train.size: must be >= 1, got 0\n"
        "spec.yaml:9: rewards.judge.local.num_cpus: must be >= 0, got -1\n"
        "spec.yaml:9: rewards.judge.timeout_s: must be > 0, got 0\n"
        "spec.yaml:10: algorithm.overlong.penalty: must be >= 0, got -1\n"
        "5 errors in spec.yaml")


def test_seed_must_be_in_numpys_range(project):
    # vLLM seeds numpy from it (np.random.seed): -1 or 2**32 failed only when the rollout stage started
    for seed, why in (("-1", "must be >= 0, got -1"), ("4294967296", "must be <= 4294967295, got 4294967296")):
        path = project.spec(_base(project, "rw_seed") + f"seed: {seed}\n")
        with pytest.raises(SpecErrors) as e:
            load_spec(path)
        assert report(e) == f"spec.yaml:9: seed: {why}\n1 error in spec.yaml"
    assert load_spec(project.spec(_base(project, "rw_seed") + "seed: 4294967295\n")).seed == 2**32 - 1


def test_custom_resources_are_what_ray_takes(project):
    # Ray refused these only when it placed the stage, after its start-up
    path = project.spec(_base(project, "rw_custom") + "resources: {rollout: {custom: {CPU: 1, a: -1, b: 0.00001}}}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == "spec.yaml:9: resources.rollout.custom.a: must be >= 0, got -1\n1 error in spec.yaml"
    path = project.spec(_base(project, "rw_custom") + "resources: {rollout: {custom: {CPU: 1, b: 0.00001}}}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == ("spec.yaml:9: resources.rollout.custom: 'CPU' is not a custom resource: set num_cpus "
                         "instead\n1 error in spec.yaml")
    path = project.spec(_base(project, "rw_custom") + "resources: {rollout: {custom: {b: 0.00001}}}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert "b: 1e-05 is finer than Ray counts resources (0.0001)" in report(e)
    assert load_spec(project.spec(_base(project, "rw_custom") + "resources: {rollout: {custom: {b: 0.5}}}\n"))


def test_cpu_gpu_amounts_and_an_object_store_ray_refuses_are_spec_errors(project):
    """Ray refuses a local object store under 75 MiB when `factory run` starts it, and a CPU or GPU amount finer
    than 0.0001 when it places the stage, as it does such a custom one: all passed check, and failed the run."""
    judge = "  judge: {llm_judge: prompts/judge.jinja, local: {path: 'factory:tiny-qwen3', num_gpus: 0.00005}}\n"
    path = project.spec(_base(project, "rw_ray") + judge + "resources: {object_store_gb: 0.05, "
                        "rollout: {num_cpus: 0.00001}, reward: {num_gpus: 0.00009}}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:9: rewards.judge.local.num_gpus: 5e-05 is finer than Ray counts resources (0.0001)\n"
        "spec.yaml:10: resources.object_store_gb: 0.05 GB is below the smallest object store Ray starts (75 MiB): "
        "give at least 0.0733\n"
        "spec.yaml:10: resources.rollout.num_cpus: 1e-05 is finer than Ray counts resources (0.0001)\n"
        "spec.yaml:10: resources.reward.num_gpus: 9e-05 is finer than Ray counts resources (0.0001)\n"
        "4 errors in spec.yaml")
    assert load_spec(project.spec(_base(project, "rw_ray") + judge.replace("0.00005", "0.0001") + "resources: "
                                  "{object_store_gb: 0.0733, rollout: {num_cpus: 0.0001}, reward: {num_gpus: 0}}\n"))


def test_an_error_about_what_an_override_set_is_located_at_the_override(project):
    """Located at the section's line in the file, which did not hold the mistake."""
    path = project.spec(_base(project, "rw_ovr") + "algorithm: {name: grpo}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["algorithm.gamma=0.5"])
    assert report(e).startswith("<override 1>: algorithm.gamma: `gamma` discounts later turns' rewards")
    with pytest.raises(SpecErrors) as e:  # a node only the overrides wrote
        load_spec(path, ["rewards.b.fn=x:y", "rewards.b.gate=correct"])
    assert report(e).startswith("<override 2>: rewards.b.gate: rewards.b has `fn` already, and `gate` would make it "
                                "hold two kinds: to change its kind, replace it whole: 'rewards.b={gate: ...}'")


def test_name_must_make_a_folder_name(project):
    # the default checkpoint_dir is runs/${name}: `/abs` made it runs//abs, `../x` a folder beside runs/
    for name in ("/abs", "../evil", "a/b", ".hidden", "-rf"):
        path = project.spec(_base(project, "rw_name").replace("name: demo", f"name: '{name}'"))
        with pytest.raises(SpecErrors) as e:
            load_spec(path)
        assert report(e) == (
            f"spec.yaml:1: name: '{name}' is not a usable name (it names the checkpoint folder, runs/NAME): one "
            "folder's name: no '/' or '\\', no control character, not starting with '.' or '-'\n1 error in spec.yaml")
    for name in ("v1.2_run-3", "qwen-lr=1e-5", "a+b@2"):  # sweep names stay usable
        assert load_spec(project.spec(_base(project, "rw_name").replace("name: demo", f"name: '{name}'"))).name == name


def test_missing_required_key_points_at_its_parent(project):
    path = project.spec("name: x\nmodel: {dtype: float32}\ndata: {train: {path: a.jsonl}}\nrewards: {}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == "spec.yaml:2: model.path: missing required key\n1 error in spec.yaml"


def test_tool_and_reward_nodes_report_only_the_member_the_user_meant(project):
    path = project.spec(_base(project, "rw_nodes") + """\
  judge: {llm_judge: prompts/judge.jinja}
  typo: {fnn: x:y}
  bare: {weight: 2}
  both: {fn: "x:y", sum: {correct: 1}}
tools:
  calc: {comand: python}
  web: {url: http://127.0.0.1:1/mcp, timeout_s: soon}
  text: just a string
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:9: rewards.judge: give exactly one of `endpoint` (an OpenAI-compatible server) or `local` (a "
        "model Factory runs)\n"
        "spec.yaml:10: rewards.typo.fnn: unknown key 'fnn'; did you mean 'fn'?\n"
        "spec.yaml:11: rewards.bare: expected one of the keys: fn, llm_judge, tool, sum, min, max, product, gate, "
        "clip, normalize\n"
        "spec.yaml:12: rewards.both: expected exactly one of the keys: fn, llm_judge, tool, sum, min, max, "
        "product, gate, clip, normalize; found fn, sum\n"
        "spec.yaml:14: tools.calc.comand: unknown key 'comand'; did you mean 'command'?\n"
        "spec.yaml:15: tools.web.timeout_s: expected a number, got 'soon'\n"
        "spec.yaml:16: tools.text: expected a mapping with one of the keys: command, url, function, "
        "got 'just a string'\n"
        "7 errors in spec.yaml")


def test_model_validator_message_is_kept(project):
    path = project.spec(_base(project, "rw_validator").replace(
        "train: {generator: factory.data:arithmetic, size: 8}", "train: {size: 8}"))
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == "spec.yaml:4: data.train: give exactly one of `path` or `generator`\n1 error in spec.yaml"


def test_yaml_syntax_error_shows_line_and_snippet(project):
    path = project.spec("name: demo\nmodel:\n  path: x: y\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == (
        "spec.yaml:3: yaml syntax error: mapping values are not allowed here\n"
        "  3 |   path: x: y\n"
        "    |          ^\n"
        "1 error in spec.yaml")


def test_duplicate_key_is_a_yaml_error_at_the_second_one(project):
    path = project.spec("name: a\nname: b\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e).splitlines()[0] == "spec.yaml:2: yaml syntax error: found duplicate key name"


def test_a_key_yaml_reads_as_null_or_a_boolean_is_located_at_its_line(project):
    """`~: 0` was OmegaConf's "incompatible key type 'NoneType'" at the spec's first line, no path; `on: x` a tag
    was "expected a string, got true" at `tracking.tags.1.[key]`. Such a key is reported with the spec's other
    mistakes (it stopped the load, and hid them)."""
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec(_base(project, "rw_oddkeys") + "~: 0\ntracking:\n  tags: {on: call, team: x}\n"
                                                               "train: {stpes: 3}\n"))
    assert report(e) == (
        "spec.yaml:9: ~: YAML reads the key `~` as null, not as a name: quote it ('~'), or write the key meant\n"
        "spec.yaml:11: tracking.tags.on: YAML reads the key `on` as true, not as a name: quote it ('on'), or write "
        "the key meant\n"
        "spec.yaml:12: train.stpes: unknown key 'stpes'; did you mean 'steps'?\n"
        "3 errors in spec.yaml")
    path = project.spec(_base(project, "rw_oddkeys2") + "tracking:\n  tags: {yes: 1, team: x}\n")
    with pytest.raises(SpecErrors) as e:  # (an override cannot slip past it)
        load_spec(path, ["tracking.tags.team=y"])
    assert report(e).splitlines()[0].startswith("spec.yaml:10: tracking.tags.yes: YAML reads the key `yes` as true")
    for text in ("name: x\n? \n: 1\nseed: y\n", "name: x\n!!null : 1\nseed: y\n"):  # an empty key: YAML's null too
        with pytest.raises(SpecErrors) as e:
            load_spec(project.spec(text))
        assert "spec.yaml:1: model: missing required key" in report(e)  # (the spec's line, not the empty key's)
        assert [line for line in report(e).splitlines() if "empty key" in line or "seed" in line] == [
            "spec.yaml:2: YAML reads an empty key as null, not as a name: write the key meant",
            "spec.yaml:4: seed: expected an integer, got 'y'" if "?" in text else
            "spec.yaml:3: seed: expected an integer, got 'y'"], report(e)
    # a duplicate key after one: at its own line (the text OmegaConf read kept the spec's lines), with it
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec("name: a\ntracking:\n  tags: {on: call}\n# a comment\n\nx: '${foo'\n\n"
                               "seed: 0\nseed: 1\n"))
    assert report(e).splitlines()[:4] == [
        "spec.yaml:3: tracking.tags.on: YAML reads the key `on` as true, not as a name: quote it ('on'), or write the "
        "key meant",
        "spec.yaml:6: x: no viable alternative at input '${foo'; an interpolation is `${key}` or `${resolver:args}`, "
        "closed by `}`; a literal `${` is written `\\${`",
        "spec.yaml:9: yaml syntax error: found duplicate key seed",
        "  9 | seed: 1"], report(e)


def test_empty_and_non_mapping_specs(project):
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec("", "empty.yaml"))
    assert report(e) == "empty.yaml:1: the spec is empty\n1 error in empty.yaml"
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec("- a\n- b\n", "list.yaml"))
    assert report(e) == "list.yaml:1: the spec must be a mapping of keys to values\n1 error in list.yaml"
    with pytest.raises(SpecErrors) as e:
        load_spec("nowhere.yaml")
    assert report(e) == "nowhere.yaml: cannot read the spec: No such file or directory\n1 error in nowhere.yaml"


def test_a_spec_or_base_that_is_not_utf8_is_a_spec_error(project):
    # read_text raised UnicodeDecodeError, which `factory check` showed as an internal error (exit 1)
    (project.root / "latin.yaml").write_bytes(b"name: demo\n# caf\xe9 au lait\n")
    with pytest.raises(SpecErrors) as e:
        load_spec("latin.yaml")
    assert report(e) == ("latin.yaml: cannot read the spec: not UTF-8 (byte 0xe9 at line 2); a spec is YAML saved "
                         "as UTF-8\n1 error in latin.yaml")
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec("name: x\nextends: latin.yaml\n"))
    assert report(e) == ("spec.yaml:2: extends: cannot read the base spec latin.yaml: not UTF-8 (byte 0xe9 at line "
                         "2); a spec is YAML saved as UTF-8\n1 error in spec.yaml")
    (project.root / "model.bin").write_bytes(bytes([0x80, 0x02, 0x7D]))
    with pytest.raises(SpecErrors) as e:
        load_spec("model.bin")
    assert report(e) == ("model.bin: cannot read the spec: not UTF-8 (byte 0x80 at line 1); a spec is YAML saved "
                         "as UTF-8\n1 error in model.bin")


def test_overrides_set_values_and_unknown_override_keys_are_named(project):
    path = project.spec(_base(project, "rw_override"))
    spec = load_spec(path, ["train.lr=3e-6", "rollout.group_size=4"])
    assert spec.train.lr == 3e-6 and spec.rollout.group_size == 4
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["train.lr=3e-6", "train.lr_rate=1", "rollout.top_k=many", "oops"])
    assert report(e) == (
        "<override 2>: train.lr_rate: unknown key 'lr_rate'; did you mean 'lr'?\n"
        "<override 3>: rollout.top_k: expected an integer, got 'many'\n"
        "<override 4>: expected KEY=VALUE, got 'oops'\n"
        "3 errors in spec.yaml")
    with pytest.raises(SpecErrors) as e:  # `factory check a.yaml b.yaml`
        load_spec(path, ["other.yaml"])
    assert report(e) == ("<override 1>: expected KEY=VALUE, got 'other.yaml' (a spec file? one spec at a time: "
                         "overrides after it are KEY=VALUE)\n1 error in spec.yaml")
    # a misspelt name makes a new entry of that setting alone: it asked for a kind as if one were meant
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["rewards.corect.timeout_s=5"])
    assert report(e) == ("<override 1>: rewards.corect: expected one of the keys: fn, llm_judge, tool, sum, min, max, "
                         "product, gate, clip, normalize; or did you mean 'correct'?\n1 error in spec.yaml")


def test_interpolation_and_env(project, monkeypatch):
    monkeypatch.setenv("FACTORY_TEST_URI", "http://secret-host:5000")
    path = project.spec(_base(project, "rw_env") + """\
tracking:
  uri: ${oc.env:FACTORY_TEST_URI}
  experiment: ${name}-exp
""")
    spec, source = load(path)
    assert spec.tracking.uri == "http://secret-host:5000"
    assert spec.tracking.experiment == "demo-exp"
    assert source.env_paths == {("tracking", "uri")}


def test_an_override_may_interpolate_another_key_of_the_spec(project):
    """`train.checkpoint_dir=/ck/${name}` (the default's own form, `runs/${name}`) was refused, "interpolation key
    'name' not found": the override was resolved on its own, before it was merged. The same line in the spec file
    worked. A key it names that the spec lacks is still refused, and so is a misspelt override key."""
    path = project.spec(_base(project, "rw_interp"))
    spec = load_spec(path, ["train.steps=3", "train.checkpoint_dir=/ck/${name}",
                            "tracking.experiment=${name}-${train.steps}-${data.train.size}"])
    assert spec.train.checkpoint_dir == "/ck/demo" and spec.tracking.experiment == "demo-3-8"
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["train.checkpoint_dir=/ck/${nmae}"])
    assert "interpolation key 'nmae' not found" in report(e), report(e)
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["train.checkpoint_dri=/ck/${name}"])
    assert report(e).startswith("<override 1>: train.checkpoint_dri: unknown key 'checkpoint_dri'; did you mean "
                                "'checkpoint_dir'?"), report(e)


def test_a_value_read_from_the_environment_is_never_printed_in_an_error(project, monkeypatch):
    """Plans show a value read from the environment as ***, but "expected an integer, got 'hunter2...'" printed
    it: a token in a terminal, a CI log, a bug report. Each way a loader's message shows a value is here."""
    monkeypatch.setenv("RW_SECRET", "hunter2/token-Xy")
    path = project.spec(_base(project, "rw_secret").replace("name: demo", "name: ${oc.env:RW_SECRET}") + """\
train: {steps: '${oc.env:RW_SECRET}', stop_on: ['${oc.env:RW_SECRET}']}
algorithm: '${oc.env:RW_SECRET}'
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["rewards.fmt=${oc.env:RW_SECRET}", "model.lora.target_modules=${oc.env:RW_SECRET}"])
    assert report(e) == (
        "spec.yaml:1: name: '***' is not a usable name (it names the checkpoint folder, runs/NAME): one folder's "
        "name: no '/' or '\\', no control character, not starting with '.' or '-'\n"
        "spec.yaml:9: train.steps: expected an integer, got ***\n"
        "spec.yaml:9: train.stop_on.0: expected 'reward_dominance', 'length_drift', 'tool_call_rate', "
        "'judge_disagreement' or 'train_eval_divergence', got ***\n"
        "spec.yaml:10: algorithm: expected a mapping, got ***\n"  # no `{name: ...}` to write
        "<override 1>: rewards.fmt: expected a mapping with one of the keys: fn, llm_judge, tool, sum, min, max, "
        "product, gate, clip, normalize, got ***\n"
        "<override 2>: model.lora.target_modules: expected a list or 'all-linear', got ***; a list is written in "
        "brackets: [***]\n"
        "6 errors in spec.yaml")


def test_a_length_read_from_the_environment_is_said_as_its_own(project, monkeypatch):
    """The mask `***` stood for the value in a length message too: a 501-character experiment read from the
    environment was "expected at most 500 characters, got 3"."""
    monkeypatch.setenv("RW_EXP", "x" * 501)
    path = project.spec(_base(project, "rw_len") + "tracking: {experiment: '${oc.env:RW_EXP}'}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == ("spec.yaml:9: tracking.experiment: expected at most 500 characters, got 501\n"
                         "1 error in spec.yaml")


def test_a_resolved_value_holding_dollar_brace_is_not_interpolated_again(project, monkeypatch):
    """An env var's value `pa${ss`, a literal the spec escaped (`\\${HOME}`): resolved once, as text. Filling the
    default `checkpoint_dir: runs/${name}` read the resolved values as interpolations again, and refused the spec
    with "spec.yaml:1: cannot resolve a default: ..." (a line the user never wrote, and part of the secret)."""
    monkeypatch.setenv("FACTORY_TEST_TOKEN", "pa${ss")
    path = project.spec(_base(project, "rw_dollar").replace("name: demo", "name: 'run-\\${HOME}'") + """\
tracking: {tags: {token: "${oc.env:FACTORY_TEST_TOKEN}", text: 'a\\${x}'}}
""")
    spec, source = load(path)
    assert spec.name == "run-${HOME}" and spec.train.checkpoint_dir == "runs/run-${HOME}"
    assert spec.tracking.tags == {"token": "pa${ss", "text": "a${x}"}


def test_env_derived_through_another_interpolation(project, monkeypatch):
    monkeypatch.setenv("FACTORY_TEST_TOKEN", "t0k3n")
    path = project.spec(_base(project, "rw_env2") + """\
tracking:
  tags: {token: "${oc.env:FACTORY_TEST_TOKEN}", copy: "${tracking.tags.token}", plain: x}
""")
    _, source = load(path)
    assert source.env_paths == {("tracking", "tags", "token"), ("tracking", "tags", "copy")}


def test_env_derived_through_relative_and_resolver_interpolations_under_dotted_keys(project, monkeypatch):
    """A key may hold a '.' (a tag `team.token`), and a value may copy an env-derived one through a relative
    interpolation or a resolver: each is found, as a tuple of keys. Dotted paths never found `team.token`, and
    only absolute `${a.b}` references were followed."""
    monkeypatch.setenv("FACTORY_TEST_TOKEN", "t0k3n")
    path = project.spec(_base(project, "rw_env3") + """\
tracking:
  tags: {"team.token": "${oc.env:FACTORY_TEST_TOKEN}", auth: "Bearer ${.a}", up: "${..experiment}",
         picked: "${oc.select:tracking.tags.a,none}", a: "${ oc.env:FACTORY_TEST_TOKEN}", plain: x}
  experiment: "${oc.env:FACTORY_TEST_TOKEN,x}-exp"
""")
    _, source = load(path)
    assert source.env_paths == {("tracking", "tags", key) for key in ("team.token", "auth", "up", "picked", "a")} | {
        ("tracking", "experiment")}


def test_unresolvable_interpolations_are_all_reported_at_their_lines(project, monkeypatch):
    monkeypatch.delenv("FACTORY_TEST_MISSING", raising=False)
    path = project.spec(_base(project, "rw_badenv") + """\
tracking:
  uri: ${oc.env:FACTORY_TEST_MISSING}
  experiment: ${nowhere.key}
  tags: {a: '${oc.evn:HOME}', b: '${nope:x}'}
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    # (OmegaConf's words alone said no way out)
    assert report(e) == (
        "spec.yaml:10: tracking.uri: environment variable 'FACTORY_TEST_MISSING' not found; set it, or give a "
        "default after a comma: ${oc.env:FACTORY_TEST_MISSING,DEFAULT}\n"
        "spec.yaml:11: tracking.experiment: interpolation key 'nowhere.key' not found\n"
        "spec.yaml:12: tracking.tags.a: unsupported interpolation type oc.evn; did you mean 'oc.env'?\n"
        "spec.yaml:12: tracking.tags.b: unsupported interpolation type nope; `${...}` names another value of the "
        "spec (`${name}`) or a resolver: oc.env, oc.select, oc.decode, oc.create, oc.dict.keys, oc.dict.values\n"
        "4 errors in spec.yaml")


def test_failed_interpolation_is_reported_once(project, monkeypatch):
    monkeypatch.delenv("FACTORY_TEST_NO_FN", raising=False)
    path = project.spec(_base(project, "rw_once") + "  extra: {fn: '${oc.env:FACTORY_TEST_NO_FN}'}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e) == ("spec.yaml:9: rewards.extra.fn: environment variable 'FACTORY_TEST_NO_FN' not found; set "
                         "it, or give a default after a comma: ${oc.env:FACTORY_TEST_NO_FN,DEFAULT}\n"
                         "1 error in spec.yaml")


def test_malformed_interpolation_is_reported_at_its_line(project):
    path = project.spec(_base(project, "rw_grammar") + "tracking: {experiment: '${name'}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    assert report(e).splitlines()[0] == (
        "spec.yaml:9: tracking.experiment: no viable alternative at input '${name'; an interpolation is `${key}` or "
        "`${resolver:args}`, closed by `}`; a literal `${` is written `\\${`")


def test_every_malformed_interpolation_is_reported_with_the_other_mistakes(project):
    """OmegaConf refused the whole spec at its first malformed `${...}`: one error shown of four. Each is found by
    OmegaConf's grammar at its line, an anchor's at each place it is used, and the rest of the spec is checked."""
    path = project.spec(_base(project, "rw_grammars") + """\
train: {lr_rate: 3, checkpoint_dir: &dir "${x", steps: many}
tools:
  calc: {command: python, args: [-m, "${oc.env:A", "${name}"], timeout_s: soon}
tracking: {experiment: '${name', uri: *dir}
""")
    with pytest.raises(SpecErrors) as e:
        load_spec(path)
    fix = "; an interpolation is `${key}` or `${resolver:args}`, closed by `}`; a literal `${` is written `\\${`"
    assert report(e) == (
        "spec.yaml:9: train.lr_rate: unknown key 'lr_rate'; did you mean 'lr'?\n"
        f"spec.yaml:9: train.checkpoint_dir: no viable alternative at input '${{x'{fix}\n"
        "spec.yaml:9: train.steps: expected an integer, got 'many'\n"
        f"spec.yaml:11: tools.calc.args.1: missing BRACE_CLOSE at '<EOF>'{fix}\n"
        "spec.yaml:11: tools.calc.timeout_s: expected a number, got 'soon'\n"
        f"spec.yaml:12: tracking.experiment: no viable alternative at input '${{name'{fix}\n"
        f"spec.yaml:12: tracking.uri: no viable alternative at input '${{x'{fix}\n"
        "7 errors in spec.yaml")


def test_load_all_repairs_so_the_compiler_can_go_on(project):
    path = project.spec(_base(project, "rw_repair") + """\
  broken: {fnn: x}
train: {lr_rate: 1, steps: many}
""")
    loaded = load_all(path)
    assert len(loaded.errors) == 3
    assert loaded.spec is not None
    assert loaded.spec.train.steps == 50  # the bad value was dropped: the default applies
    assert "broken" not in loaded.spec.rewards and loaded.broken["rewards"] == {"broken"}


def test_an_override_that_gives_a_data_source_another_kind_replaces_it(project):
    """As `extends` does: `data.train={path: ...}` over a generator was merged key by key into both, and
    refused ('give exactly one of `path` or `generator`'); the same kind still merges."""
    project.file("data/train.jsonl", '{"question": "1+1", "answer": "2"}\n')
    path = project.spec(_base(project, "rw_swap"))
    spec = load_spec(path, ["data.train={path: data/train.jsonl}"])
    assert spec.data.train.path == "data/train.jsonl" and spec.data.train.generator is None
    spec = load_spec(path, ["data.train={generator: factory.data:arithmetic, args: {digits: [1, 1]}}"])
    assert spec.data.train.size == 8 and spec.data.train.args == {"digits": [1, 1]}  # the same kind: merged
    spec = load_spec(path, ["data.eval={path: data/train.jsonl}", "data.eval={generator: factory.data:arithmetic}"])
    assert spec.data.eval.generator == "factory.data:arithmetic" and spec.data.eval.path is None
    # a reward node too (`extends` swapped it; an override was refused with "found fn, sum")
    spec = load_spec(path, ["rewards.total={fn: factory.rewards.math:numeric_match}"])
    assert spec.rewards["total"].fn == "factory.rewards.math:numeric_match"


def test_a_tool_server_given_another_kind_replaces_it(project):
    """`tools.calc={url: ...}` over a `command` server was merged key by key into both, and refused with
    "found command, url", a key the user never wrote; `extends` the same."""
    path = project.spec(_base(project, "rw_server") + (
        "tools:\n  calc: {command: python, args: [-m, x], timeout_s: 5}\n"))
    spec = load_spec(path, ["tools.calc={url: 'http://127.0.0.1:9/mcp'}"])
    assert spec.tools["calc"].url == "http://127.0.0.1:9/mcp" and spec.tools["calc"].timeout_s == 30.0
    project.spec("extends: spec.yaml\ntools:\n  calc: {url: 'http://127.0.0.1:9/mcp'}\n", "child.yaml")
    assert load_spec(project.root / "child.yaml").tools["calc"].url == "http://127.0.0.1:9/mcp"
    assert load_spec(path, ["tools.calc={timeout_s: 9}"]).tools["calc"].args == ["-m", "x"]  # same kind: merged
    # one key of another kind merged into the server, which held both: "spec.yaml:N: tools.calc: expected exactly
    # one of the keys: command, url, function; found command, url", at the file's line, with no way out
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["tools.calc.url=http://127.0.0.1:9/mcp", "data.train.path=data/train.jsonl"])
    assert report(e) == (
        "<override 1>: tools.calc.url: tools.calc has `command` already, and `url` would make it hold two "
        "kinds: to change its kind, replace it whole: 'tools.calc={url: ...}'\n"
        "<override 2>: data.train.path: data.train has `generator` already, and `path` would make it hold two "
        "kinds: to change its kind, replace it whole: 'data.train={path: ...}'\n"
        "2 errors in spec.yaml")


def test_yaml_error_says_what_yaml_was_reading(project):
    """PyYAML's context (its `context` and `context_mark`) is part of the message: alone, "found unexpected
    end of stream" pointed at the last line of a spec whose quote was opened 30 lines up."""
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec('name: "demo\nseed: 1\nmodel: {path: x}\n'))
    assert report(e) == (
        "spec.yaml:1: yaml syntax error: found unexpected end of stream (while scanning a quoted scalar)\n"
        '  1 | name: "demo\n'
        "    |       ^\n"
        "1 error in spec.yaml")
    for text, first in (("name: a\nmodel: {path: x\ndata: {}\n", "spec.yaml:3: yaml syntax error: expected ',' or "
                         "'}', but got ':' (while parsing a flow mapping that starts at line 2)"),
                        ("name: a\n---\nseed: 1\n", "spec.yaml:2: yaml syntax error: expected a single document "
                         "in the stream, but found another document"),
                        ("name: a\nseed: 1\x00\n", "spec.yaml:2: yaml syntax error: unacceptable character "
                         "#x0000: special characters are not allowed")):
        with pytest.raises(SpecErrors) as e:
            load_spec(project.spec(text))
        assert report(e).splitlines()[0] == first
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec("name: a\n"), ["train.steps=[1"])
    assert ("<override 1>: train.steps: yaml syntax error: did not find expected ',' or ']' (while parsing a "
            "flow sequence); the value after '=' is read as YAML: quote it inside (train.steps=\"'...'\") to give "
            "it as text") in report(e).splitlines()
    # a list over a mapping (OmegaConf: "Cannot merge incompatible container types"); a value YAML made a mapping
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec("name: a\ntrain: {steps: 2}\n"), ["train=[1]", "name={a: 1}"])
    assert [ln for ln in report(e).splitlines() if ln.startswith("<override")] == [
        "<override 1>: train: a mapping in the spec, which an override cannot replace with a list: set what is "
        "inside it (train.KEY=VALUE), or write the change in the spec",
        "<override 2>: name: expected a string, got a mapping; an override's value is read as YAML: quote it "
        "inside, name=\"'...'\""]


def test_a_tab_says_to_use_spaces(project):
    """PyYAML's "found character '\\t' that cannot start any token" alone did not say what to do, and a tab
    before a comment (YAML 1.2 takes it) is refused with the same words."""
    for text, line, column in (("name: a\nmodel:\n\tpath: x\n", 3, 0), ("name: a\nseed: 1\t# one\n", 2, 7)):
        with pytest.raises(SpecErrors) as e:
            load_spec(project.spec(text))
        assert report(e) == (
            f"spec.yaml:{line}: yaml syntax error: found character '\\t' that cannot start any token; YAML indents "
            "with spaces, not tabs (a tab before a comment too): replace the tab with spaces\n"
            f"  {line} | {text.splitlines()[line - 1]}\n"
            f"    | {' ' * column}^\n"
            "1 error in spec.yaml")


def test_an_override_cannot_set_a_list_element_by_index(project):
    """OmegaConf reads the index as a mapping's key: merged over the list it was refused as "a value in the
    spec, which an override cannot replace with a list: set what is inside it"; `name[0]` made `name` a mapping,
    reported at the spec file's line."""
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec("name: a\ntrain: {steps: 2}\ntools:\n  calc: {command: python, args: [-m, x]}\n"),
                  ["tools.calc.args.1=y", "tools.calc.args[1]=y", "name[0]=x"])
    assert [ln for ln in report(e).splitlines() if ln.startswith("<override")] == [
        "<override 1>: tools.calc.args.1: an override cannot set a list's element by index: give the whole list "
        "(tools.calc.args=[...])",
        "<override 2>: tools.calc.args[1]: an override cannot set a list's element by index: give the whole list "
        "(tools.calc.args=[...])",
        "<override 3>: name[0]: an override cannot set a list's element by index, and name is no list here: set it "
        "whole (name=...)"]


def test_a_key_written_one_level_too_deep_says_where_it_goes(project):
    """`data.train.answer_key` listed data.train's keys (path, generator, args, size); the key is data's."""
    path = project.spec(_base(project, "rw_deep"))
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["data.train.answer_key=x", "data.train.pathh=x"])
    assert report(e).splitlines()[:2] == [
        "<override 1>: data.train.answer_key: unknown key 'answer_key' here; 'answer_key' is a key of data: move it "
        "up (data.answer_key)",
        "<override 2>: data.train.pathh: unknown key 'pathh'; did you mean 'path'?"]  # a near name of its own first
    with pytest.raises(SpecErrors) as e:  # not across a named entry: a reward node's `model` is not the spec's
        load_spec(path, ["rewards.correct.model=x"])
    assert report(e).startswith("<override 1>: rewards.correct.model: unknown key 'model'; expected one of: ")


def test_an_override_that_removes_nothing_says_so(project):
    """`NAME=null` removes an entry of a mapping of names; a misspelt NAME removed nothing, in silence."""
    path = project.spec(_base(project, "rw_null"))
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["rewards.total.sum.fmtt=null", "tools.calc=null", "rewards.total.sum.fmt=null"])
    assert report(e) == (
        "<override 1>: rewards.total.sum.fmtt: nothing to remove: rewards.total.sum has no 'fmtt'; did you mean "
        "'fmt'?\n"
        "<override 2>: tools.calc: nothing to remove: tools has no 'calc'; it has: nothing\n"
        "2 errors in spec.yaml")


def test_an_override_is_blamed_for_what_it_wrote(project):
    """`train.steps.x=3` made the file's `steps` a mapping: the override is at fault, not the file's line; a
    key with an empty part (`.train.steps`) was reported at the file's first line as an unknown key ''."""
    path = project.spec(_base(project, "rw_blame") + "train: {steps: 2}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["train.steps.x=3", ".train.lr=1", "train..lr=1"])
    assert report(e) == (
        "<override 1>: train.steps: expected an integer, got a mapping\n"
        "<override 2>: expected KEY=VALUE with a dotted key such as train.lr, got '.train.lr=1': a part between "
        "dots is empty\n"
        "<override 3>: expected KEY=VALUE with a dotted key such as train.lr, got 'train..lr=1': a part between "
        "dots is empty\n"
        "3 errors in spec.yaml")
    # a key holding a '.', escaped (the tag `team.x`), was blamed on the file's tracking section
    path = project.spec(_base(project, "rw_blame") + "tracking: {tags: {team: a}}\n")
    with pytest.raises(SpecErrors) as e:
        load_spec(path, ["tracking.tags.team\\.x=1"])
    assert report(e) == ("<override 1>: tracking.tags.team.x: expected a string, got 1; an override's value is read "
                         "as YAML: quote it inside, tracking.tags.team\\.x=\"'...'\"\n1 error in spec.yaml")


def test_a_union_of_plain_types_is_one_error_at_its_key(project):
    """`target_modules: list[str] | Literal['all-linear']`: pydantic's member tags leaked into the path
    (`model.lora.target_modules.list[str]`, `...literal['all-linear']`), one error per member."""
    path = project.spec(_base(project, "rw_union"))
    for value, said in (("all_linear", "model.lora.target_modules: expected a list or 'all-linear', got 'all_linear'; "
                                       "did you mean 'all-linear'?"),
                        ("[q_proj, 3]", "model.lora.target_modules.1: expected a string, got 3"),
                        # one name, or names with commas, meant as a list: the brackets it needs
                        ("q_proj", "model.lora.target_modules: expected a list or 'all-linear', got 'q_proj'; a list "
                                   "is written in brackets: [q_proj]"),
                        ("'q_proj, v_proj'", "model.lora.target_modules: expected a list or 'all-linear', got "
                                             "'q_proj, v_proj'; a list is written in brackets: [q_proj, v_proj]")):
        with pytest.raises(SpecErrors) as e:
            load_spec(path, [f"model.lora.target_modules={value}"])
        assert report(e) == f"<override 1>: {said}\n1 error in spec.yaml"


def test_a_null_entry_that_no_base_sets_says_what_null_does(project):
    """`null` removes an entry a base spec sets; one no base sets was "expected a number, got null" (a sum's
    weight) or "expected a mapping with one of the keys: ..., got null" (a node), with no word of a typo."""
    project.spec(_base(project, "rw_nullfile"))
    child = project.spec("extends: spec.yaml\nrewards:\n  total: {sum: {fmtt: null}}\n  nothere: null\n", "child.yaml")
    with pytest.raises(SpecErrors) as e:
        load_spec(child)
    assert report(e) == (
        "child.yaml:3: rewards.total.sum.fmtt: null removes an entry that a base spec (extends) sets, and no base "
        "sets rewards.total.sum.fmtt; did you mean 'fmt'?\n"
        "child.yaml:4: rewards.nothere: null removes an entry that a base spec (extends) sets, and no base sets "
        "rewards.nothere\n"
        "2 errors in child.yaml")


def test_an_alias_inside_what_it_names_is_located_and_other_aliases_load(project):
    """`tools: &t {x: *t}` made OmegaConf recurse without end: an internal error, exit 1."""
    base = _base(project, "rw_alias")
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec(base + "train: &t\n  steps: 2\n  x: *t\n"))
    assert report(e) == ("spec.yaml:11: train.x: this alias (*name) names a mapping or list that holds it, so "
                         "the value would contain itself; copy the values instead\n1 error in spec.yaml")
    assert load_spec(project.spec(base + "train: {steps: &n 2, prompts_per_step: *n}\n")).train.prompts_per_step == 2


def test_values_nested_past_any_spec_are_an_error_at_their_line(project):
    """A generator's args 40 mappings deep made OmegaConf recurse past Python's limit, and `[[[...` 5000 deep
    PyYAML: "internal error: RecursionError", exit 1, with pages of OmegaConf's `full_key: ...` lines."""
    base = _base(project, "rw_deep")
    deep = base.replace("size: 8}", "size: 8,\n    args: {x: " + "{a: " * 40 + "1" + "}" * 40 + "}}")
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec(deep))
    assert report(e) == (f"spec.yaml:5: data.train.args.x{'.a' * 28}: values nested more than 32 mappings or lists "
                         "deep: no spec needs that many; flatten them\n1 error in spec.yaml")
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec(base + "seed: " + "[" * 5000 + "]" * 5000 + "\n"))
    assert report(e) == ("spec.yaml: values nested far more than 32 mappings or lists deep: no spec needs that many; "
                         "flatten them\n1 error in spec.yaml")
    assert load_spec(project.spec(base.replace("size: 8}", "size: 8, args: {x: " + "[" * 25 + "]" * 25 + "}}")))


def test_overrides_and_dict_specs_nested_past_any_spec_are_a_spec_error(project):
    """The YAML file's depth limit did not hold for an override or a spec given as a dict: nested past Python's
    limit (a value `[[[...` or a key `a.a.a...` thousands deep, a dict built by code), they raised RecursionError
    out of OmegaConf or PyYAML; a few hundred deep, an override too."""
    text = _base(project, "rw_deep_o").replace("size: 8}", "size: 8, args: {}}")
    for override, path in [("data.train.args.x=" + "{a: " * 200 + "1" + "}" * 200, "data.train.args.x" + ".a" * 28),
                           ("seed=" + "[" * 5000 + "]" * 5000, None),
                           ("data.train.args." + ".".join(["a"] * 1200) + "=1", "data.train.args" + ".a" * 29)]:
        with pytest.raises(SpecErrors) as e:
            load_spec(text, [override])
        assert report(e) == ((f"<override 1>: {path}: values nested more than 32 mappings or lists deep: no spec "
                              "needs that many; flatten them" if path else
                              "<override 1>: seed: values nested far more than 32 mappings or lists deep: no spec "
                              "needs that many; flatten them") + "\n1 error in <spec>")
    # 32 deep in all, as in a file: taken
    assert load_spec(text, ["data.train.args.x=" + "{a: " * 28 + "1" + "}" * 28]).data.train.args["x"]
    deep: dict = {"a": 1}
    for _ in range(5000):
        deep = {"a": deep}
    spec = yaml.safe_load(text)
    spec["data"]["train"]["args"] = {"x": deep}
    with pytest.raises(SpecErrors) as e:
        load_spec(spec)
    assert report(e) == ("<dict>: values nested far more than 32 mappings or lists deep: no spec needs that many; "
                         "flatten them\n1 error in <dict>")


def test_aliases_of_aliases_that_expand_past_any_spec_are_an_error_not_a_hang(project):
    """Six levels of nine aliases each (a "billion laughs") read for minutes, growing memory, before."""
    lol, prev = "lol:\n  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n", "a"
    for n in "bcdef":
        lol, prev = lol + f"  {n}: &{n} [{', '.join(['*' + prev] * 9)}]\n", n
    with pytest.raises(SpecErrors) as e:
        load_spec(project.spec(_base(project, "rw_lol") + lol))
    assert "the spec's aliases expand to more than 200,000 values; copy the values instead" in report(e)
