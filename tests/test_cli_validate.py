"""`agile-llmenvs validate`: every problem a run would meet before training, one line each by
field path, exit 2; eval configs recognised as such; `--no-files` checks the fields only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agile_llmenvs.cli import main

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
DIGITS = MANIFESTS / "data" / "digits.jsonl"
RUBRIC = MANIFESTS / "rubrics" / "digits.py"
LOOKED_UP = "(a relative path is looked up next to the manifest, then in the working directory)"
MODULE_LOOKED_UP = (
    "(a module Python cannot find is looked up next to the manifest, then in the working directory)"
)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``agile-llmenvs ARGS`` as a process in ``cwd``, offline, with the tests' envs importable."""
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "agile_llmenvs", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
        env=env,
    )


def _rollout(**env: object) -> str:
    """A GRPO manifest over the shipped digits rows, with ``env`` fields replaced."""
    fields = {
        "env_type": "rollout",
        "dataset_path": str(DIGITS),
        "rubric_file_path": str(RUBRIC),
        "rubric_name": "exact_digit",
        **env,
    }
    lines = "".join(f"  {key}: {value}\n" for key, value in fields.items() if value is not None)
    return f"env:\n{lines}training: {{algorithm: grpo}}\n"


def test_each_missing_file_import_and_model_is_one_line_by_field(tmp_path: Path) -> None:
    files = {
        "missing_files.yaml": _rollout(
            dataset_path="data/absent.jsonl", rubric_file_path="rubrics/absent.py"
        ),
        "unknown_rubric.yaml": _rollout(rubric_name="exact_digits"),
        "unmapped_column.yaml": _rollout(columns="{question: q}"),
        "model_path.yaml": _rollout() + "model: {path: ./models/absent}\n",
        "hub_id.yaml": _rollout() + "model: {path: Qwen/Qwen2.5-0.5B}\n",
        "not_a_model.yaml": _rollout() + f"model: {{path: {tmp_path}}}\n",
        "entrypoint.yaml": "env: {env_type: rollout, entrypoint: 'absent_pkg.envs:MyEnv'}\n",
        "file_entrypoint.yaml": "env: {env_type: rollout, entrypoint: 'envs/absent.py:MyEnv'}\n",
        "factory.yaml": (
            "env: {env_type: rollout, entrypoint: 'echo-v0', factory: 'echo_envs:maker'}\n"
        ),
        "gym.yaml": "env: {env_type: gym, name: CartPol-v1, env_wrappers: [gymnasium.Nope]}\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = _cli("validate", str(MANIFESTS / "rollout_digits.yaml"), *files, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout.splitlines() == [
        f"ok    {MANIFESTS / 'rollout_digits.yaml'}: run 'digits': rollout env '{DIGITS}' "
        "from dataset, trained with grpo"
    ]
    assert done.stderr.splitlines() == [
        "error missing_files.yaml: run manifest, 2 problem(s)",
        f"  env.dataset_path: 'data/absent.jsonl' does not exist {LOOKED_UP}",
        f"  env.rubric_file_path: 'rubrics/absent.py' does not exist {LOOKED_UP}",
        "error unknown_rubric.yaml: run manifest, 1 problem(s)",
        "  env.rubric_name: 'exact_digits' is not a reward function of digits.py; it defines "
        "['contains_digit', 'exact_digit']",
        "error unmapped_column.yaml: run manifest, 1 problem(s)",
        "  env.columns: maps to the column 'q', which the rows do not have (they have "
        "['question', 'answer']); map each env column to one of theirs",
        "error model_path.yaml: run manifest, 1 problem(s)",
        "  model.path: './models/absent' does not exist; set it to a local model directory "
        "(the folder save_pretrained writes, holding config.json)",
        "error hub_id.yaml: run manifest, 1 problem(s)",
        "  model.path: 'Qwen/Qwen2.5-0.5B' is not a local directory; if it is a Hugging Face hub "
        "id, download it first (nothing is downloaded at run time), e.g. `hf download "
        "Qwen/Qwen2.5-0.5B --local-dir models/Qwen2.5-0.5B`, and set model.path to that "
        "directory",
        "error not_a_model.yaml: run manifest, 1 problem(s)",
        f"  model.path: '{tmp_path}' holds no config.json, so it is not a model directory; set "
        "it to the folder save_pretrained writes",
        "error entrypoint.yaml: run manifest, 1 problem(s)",
        "  env.entrypoint: 'absent_pkg.envs:MyEnv': cannot import module 'absent_pkg.envs' (No "
        "module named 'absent_pkg'); is its package installed and on PYTHONPATH? "
        + MODULE_LOOKED_UP,
        "error file_entrypoint.yaml: run manifest, 1 problem(s)",
        f"  env.entrypoint: 'envs/absent.py' does not exist (looked for "
        f"{tmp_path}/envs/absent.py; a relative path in a manifest is looked up next to the "
        "manifest, then in the working directory)",
        "error factory.yaml: run manifest, 1 problem(s)",
        "  env.factory: 'echo_envs:maker': echo_envs has no attribute 'maker'. Did you mean "
        "'make'?",
        "error gym.yaml: run manifest, 2 problem(s)",
        "  env.name: Environment `CartPol` doesn't exist. Did you mean: `CartPole`? Register it, "
        "or build it from an `entrypoint` (or `factory`)",
        "  env.env_wrappers.0: 'gymnasium.Nope': gymnasium has no attribute 'Nope'.",
    ]


def test_a_file_entrypoint_that_imports_validates(tmp_path: Path) -> None:
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "guess.py").write_text("class GuessEnv:\n    pass\n")
    (tmp_path / "run.yaml").write_text(
        "env: {env_type: rollout, entrypoint: 'envs/guess.py:GuessEnv'}\n"
    )
    done = _cli("validate", "run.yaml", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "ok    run.yaml: rollout env 'envs/guess.py:GuessEnv' from entrypoint\n"


def test_a_model_path_holds_a_model_or_lora_adapters(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    for name, folder in (("full", tiny_model_dir), ("lora", tmp_path / "lora")):
        manifest = tmp_path / f"{name}.yaml"
        manifest.write_text(_rollout() + f"model: {{path: {folder}}}\n")
        assert main(["validate", str(manifest)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().err == ""


def test_a_model_folder_whose_config_or_tokenizer_does_not_load_is_caught(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty, untokenized = tmp_path / "empty", tmp_path / "untokenized"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    untokenized.mkdir()
    (untokenized / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    for folder in (empty, untokenized):
        (tmp_path / f"{folder.name}.yaml").write_text(_rollout() + f"model: {{path: {folder}}}\n")
    assert main(["validate", str(tmp_path / "empty.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error {tmp_path / 'empty.yaml'}: run manifest, 1 problem(s)",
        f"  model.path: '{empty}': config.json has no model_type: not a transformers model "
        "folder; set model.path to the folder save_pretrained writes (its config.json names a "
        'model_type, e.g. "qwen2")',
    ]
    assert main(["validate", str(tmp_path / "untokenized.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error {tmp_path / 'untokenized.yaml'}: run manifest, 1 problem(s)",
        f"  model.path: '{untokenized}' holds no tokenizer (no tokenizer_config.json, "
        "tokenizer.json, tokenizer.model); save it into that folder "
        "(tokenizer.save_pretrained(folder)), or set model.tokenizer_path to a folder that "
        "holds one",
    ]


def test_the_builtin_model_validates_offline_without_being_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import agile_llmenvs.tiny_model

    def no_build() -> None:
        raise AssertionError("validate built the tiny model")

    monkeypatch.setattr(agile_llmenvs.tiny_model, "ensure_tiny_model", no_build)
    assert main(["validate", str(MANIFESTS / "quickstart.yaml")]) == 0, capsys.readouterr().err


MY_ENV = """
from pathlib import Path


class {name}:
    max_turns = 2

    def __init__(self, size: int = 3, max_guesses: int = 2) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {{size}}")
        self.size = size

    def reset(self, *, seed=None, **task):
        return "Guess.", {{}}

    def step(self, action):
        return "Done.", 1.0, True, False, {{}}

    def close(self):
        (Path(__file__).parent / "closed.txt").write_text(str(self.size))
"""


def _project(tmp_path: Path, module: str, entrypoint: str, env_config: str = "{}") -> Path:
    """``project/run.yaml`` naming ``entrypoint``, with ``project/{module}.py`` beside it."""
    project = tmp_path / "project"
    project.mkdir()
    (project / f"{module}.py").write_text(MY_ENV.format(name="MyEnv"))
    (project / "run.yaml").write_text(
        f"env: {{env_type: rollout, entrypoint: '{entrypoint}', env_config: {env_config}}}\n"
        "training: {algorithm: grpo}\n"
    )
    (tmp_path / "elsewhere").mkdir()
    return project


def test_an_entrypoint_file_beside_the_manifest_resolves_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agile_llmenvs.specs import LLMEnvSpec, load_manifest
    from agile_llmenvs.transport.resolve import env_factory

    project = _project(tmp_path, "file_env_a", "file_env_a.py:MyEnv", "{size: 4}")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["validate", str(project / "run.yaml")]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == (
        f"ok    {project / 'run.yaml'}: rollout env '{project / 'file_env_a.py'}:MyEnv' from "
        "entrypoint, trained with grpo\n"
    )
    assert (project / "closed.txt").read_text() == "4"  # one env built, and closed
    spec = load_manifest(project / "run.yaml").env
    assert isinstance(spec, LLMEnvSpec)
    assert spec.entrypoint is not None
    assert env_factory(spec.entrypoint, spec.env_config, factory=spec.factory)().size == 4


def test_a_module_beside_the_manifest_imports_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agile_llmenvs.specs import LLMEnvSpec, load_manifest
    from agile_llmenvs.transport.resolve import env_factory

    project = _project(tmp_path, "module_env_b", "module_env_b:MyEnv", "{size: 5}")
    monkeypatch.chdir(tmp_path / "elsewhere")
    path_before = list(sys.path)
    assert main(["validate", str(project / "run.yaml")]) == 0, capsys.readouterr().err
    assert (project / "closed.txt").read_text() == "5"
    spec = load_manifest(project / "run.yaml").env
    assert isinstance(spec, LLMEnvSpec)
    assert spec.entrypoint == "module_env_b:MyEnv"
    assert env_factory(spec.entrypoint, spec.env_config, factory=spec.factory)().size == 5
    assert sys.path == path_before  # the manifest's folder was on it only while importing


def test_a_wrong_env_config_key_or_a_failing_constructor_is_caught_by_building_one_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = _project(tmp_path, "config_env_c", "config_env_c.py:MyEnv", "{sise: 4}")
    manifest = str(project / "run.yaml")
    assert main(["validate", manifest]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error {manifest}: run manifest, 1 problem(s)",
        "  env.env_config: 'sise' is not a keyword argument of MyEnv (it takes: size, "
        "max_guesses); did you mean 'size'?",
    ]
    (project / "run.yaml").write_text(
        "env: {env_type: rollout, entrypoint: config_env_c.py:MyEnv, env_config: {size: 0}}\n"
    )
    assert main(["validate", manifest]) == 2
    source = (project / "config_env_c.py").read_text().splitlines()
    line = next(n for n, text in enumerate(source, 1) if "raise ValueError" in text)
    assert capsys.readouterr().err.splitlines() == [
        f"error {manifest}: run manifest, 1 problem(s)",
        "  env.entrypoint: cannot build the env: ValueError: size must be at least 1, got 0 "
        f"(at {project / 'config_env_c.py'}:{line} in __init__)",
    ]


def test_no_build_and_no_files_skip_building_the_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = _project(tmp_path, "unbuilt_env_d", "unbuilt_env_d.py:MyEnv", "{sise: 4}")
    manifest = str(project / "run.yaml")
    entrypoint = f"{project / 'unbuilt_env_d.py'}:MyEnv"
    assert main(["validate", "--no-build", manifest]) == 0, capsys.readouterr().err
    assert main(["validate", "--no-files", manifest]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.splitlines() == [
        f"ok    {manifest}: rollout env '{entrypoint}' from entrypoint, trained with grpo "
        "(--no-build: env not built)",
        f"ok    {manifest}: rollout env '{entrypoint}' from entrypoint, trained with grpo "
        "(--no-files: fields only)",
    ]
    assert not (project / "closed.txt").exists()


def test_a_misspelt_field_is_answered_with_the_nearest_at_its_place_top_level_too(
    tmp_path: Path,
) -> None:
    (tmp_path / "typos.yaml").write_text(
        "name: x\n"
        "env: {env_type: rollout, entrypoint: 'a:B', max_turn: 3}\n"
        "model: {pth: x}\n"
        "trainig: {algorithm: grpo}\n"
    )
    done = _cli("validate", "typos.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error typos.yaml: run manifest, 3 problem(s)",
        "  env.max_turn: not a field here: did you mean 'max_turns'?",
        "  model.pth: not a field here: did you mean 'path'?",
        "  trainig: not a field here: did you mean 'training'?",
    ]


def test_an_eval_config_is_validated_as_one(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    (tmp_path / "eval.yaml").write_text(
        "environments:\n"
        "  - {name: leg_countin}\n"
        "  - {name: mine, source: entry_point, entry_point: 'absent_pkg:MyEnv'}\n"
        "  - {name: leg_counting, sizes: 3}\n"
        "model: {backend: huggingface, model: ./models/absent}\n"
    )
    (tmp_path / "model.yaml").write_text(
        "environments: [{name: leg_countin}]\n"
        "model: {backend: huggingface, model: ./models/absent}\n"
    )
    leg_counting = MANIFESTS / "eval" / "leg_counting.yaml"
    done = _cli("validate", str(leg_counting), "eval.yaml", "model.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout.splitlines() == [
        f"ok    {leg_counting}: eval config: 1 environment (leg_counting), model 'tiny' on "
        "huggingface"
    ]
    assert done.stderr.splitlines() == [
        "error eval.yaml: eval config, 1 problem(s)",
        "  environments.2.sizes: not a field here: did you mean 'size'?",
        "error model.yaml: eval config, 2 problem(s)",
        "  environments.0.name: reasoning-gym has no dataset 'leg_countin'; did you mean "
        "'leg_counting'?",
        "  model.model: './models/absent' does not exist; set it to a local model directory "
        "(the folder save_pretrained writes, holding config.json)",
    ]


def test_an_eval_config_entry_point_must_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "eval.yaml"
    config.write_text(
        "environments: [{name: mine, source: entry_point, entry_point: 'absent_pkg:MyEnv'}]\n"
        "model: {backend: huggingface, model: tiny}\n"
    )
    assert main(["validate", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error {config}: eval config, 1 problem(s)",
        "  environments.0.entry_point: 'absent_pkg:MyEnv': cannot import module 'absent_pkg' "
        "(No module named 'absent_pkg'); is its package installed and on PYTHONPATH? "
        + MODULE_LOOKED_UP,
    ]


def test_field_problems_name_the_field_a_user_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {env_type: rollout, objective: sft, entrypoint: 'a:B'}\n")
    assert main(["validate", str(bad)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error {bad}: run manifest, 1 problem(s)",
        "  env.objective: belongs to dataset envs only (env_type: dataset); a rollout env is "
        "scored by its rewards",
    ]


def test_no_files_checks_the_fields_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "run.yaml"
    manifest.write_text(_rollout(dataset_path="absent.jsonl") + "model: {path: ./absent}\n")
    assert main(["validate", "--no-files", str(manifest)]) == 0
    assert capsys.readouterr().out == (
        f"ok    {manifest}: rollout env 'absent.jsonl' from dataset, trained with grpo "
        "(--no-files: fields only)\n"
    )
    assert main(["validate", str(manifest)]) == 2


def test_every_shipped_manifest_and_eval_config_validates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for module in ("gem", "reasoning_gym", "ray"):  # the extras some manifests need
        pytest.importorskip(module)
    paths = [*sorted(MANIFESTS.glob("*.yaml")), MANIFESTS / "eval" / "leg_counting.yaml"]
    assert main(["validate", *map(str, paths)]) == 0, capsys.readouterr().err
    assert len(capsys.readouterr().out.splitlines()) == len(paths)


def test_train_with_a_bad_model_path_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(_rollout() + "model: {path: ./models/absent}\n")
    done = _cli("train", "run.yaml", cwd=tmp_path)
    problem = (
        "model.path: './models/absent' does not exist; set it to a local model directory (the "
        "folder save_pretrained writes, holding config.json)"
    )
    assert (done.returncode, done.stderr) == (2, f"error run.yaml: {problem}\n")
    checked = _cli("validate", "run.yaml", cwd=tmp_path)  # the same words
    assert checked.stderr.splitlines()[1:] == [f"  {problem}"]
