"""make_rollout_env_factory: one rollout through a built harness for each source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.llm_envs import StopReason, resolve_env
from agile_llmenvs.llm_envs.rubric import RubricEnv, load_rubric
from agile_llmenvs.specs import LLMEnvSpec, load_manifest

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
EOS = 2


def answer(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), EOS]


def test_reasoning_gym_a_correct_answer_scores_one(tokenizer: Any) -> None:
    reasoning_gym = pytest.importorskip("reasoning_gym", reason="needs the `envs` extra")
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="leg_counting",
        factory="agile_llmenvs.adapters.reasoning_gym:make",
        env_config={"size": 5, "seed": 3},
    )
    factory, max_turns = make_rollout_env_factory(spec, tokenizer)
    assert max_turns == 1
    entries = reasoning_gym.create_dataset("leg_counting", size=5, seed=3)
    for row, wrong in ((2, False), (4, True)):
        harness = factory()
        prompt = harness.reset(row_index=row)
        assert entries[row]["question"] in tokenizer.decode(prompt)
        reply = "-1" if wrong else entries[row]["answer"]
        result = harness.step(answer(tokenizer, f"<answer>{reply}</answer>"))
        assert result.done
        assert result.reward == (0.0 if wrong else 1.0)


def test_a_gem_game_over_several_turns(tokenizer: Any) -> None:
    pytest.importorskip("gem", reason="needs the `envs` extra")
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="game:GuessTheNumber-v0-easy",
        factory="agile_llmenvs.adapters.gem:make",
    )
    factory, max_turns = make_rollout_env_factory(spec, tokenizer)
    assert max_turns == 4  # probed from the game, not declared in the manifest
    harness = factory()
    assert "Guess The Number" in tokenizer.decode(harness.reset(seed=0))
    turns = 0
    for guess in range(1, 11):
        turns += 1
        result = harness.step(answer(tokenizer, f"\\boxed{{{guess}}}"))
        if result.done:
            break
        assert f"you guessed {guess}" in tokenizer.decode(result.prompt_ids)
    data = harness.get_episode_data()
    assert data.num_turns == turns
    assert turns > 1
    assert data.stop_reason in (StopReason.TERMINATED, StopReason.TRUNCATED)  # GEM's own end


def test_an_entrypoint_served_by_url_through_resolve_env(tokenizer: Any) -> None:
    servers = [resolve_env("echo_envs:EchoEnv", max_concurrent_envs=4) for _ in range(2)]
    urls = [url for url, _ in servers]
    try:
        spec = LLMEnvSpec(env_type="rollout", env_url=urls, request_timeout_s=10)
        factory, max_turns = make_rollout_env_factory(spec, tokenizer)
        assert max_turns == 5  # probed from the served env's state
        harnesses = [factory() for _ in range(3)]
        for harness in harnesses:
            harness.reset()
            assert harness.step(answer(tokenizer, "stop")).reward == 1.0
            assert harness.get_episode_data().stop_reason is StopReason.TERMINATED
        dialled = [h.client.url for h in harnesses]  # sessions spread round-robin
        expected = [u.replace("http", "ws") + "/ws" for u in (urls[0], urls[1], urls[0])]
        assert dialled == expected
        for harness in harnesses:
            harness.close()
    finally:
        for _, server in servers:
            assert server is not None
            server.close()


def test_an_entrypoint_in_process_with_config_and_a_declared_budget(tokenizer: Any) -> None:
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="echo_envs:EchoEnv",
        env_config={"greeting": "Hello"},
        max_turns=2,
    )
    factory, max_turns = make_rollout_env_factory(
        spec, tokenizer, max_model_len=512, max_output_tokens=64
    )
    assert max_turns == 2
    harness = factory()
    assert harness.config.max_model_len == 448
    assert "Hello seed=7" in tokenizer.decode(harness.reset(seed=7))
    harness.step(answer(tokenizer, "a"))
    assert harness.step(answer(tokenizer, "b")).done
    assert harness.get_episode_data().stop_reason is StopReason.MAX_TURNS


def test_sources_that_cannot_be_built_here(tokenizer: Any) -> None:
    with pytest.raises(EnvBuildError, match="runs as its own Pod, placed by an orchestrator"):
        make_rollout_env_factory(LLMEnvSpec(env_type="rollout", env_image="reg/env:1"), tokenizer)
    dataset = load_manifest(MANIFESTS / "sft_digits.yaml").env
    with pytest.raises(EnvBuildError, match="is a dataset env: build it with make_llm_env"):
        make_rollout_env_factory(dataset, tokenizer)  # type: ignore[arg-type]


def test_rubric_errors_at_build_time_and_run_time(tmp_path: Path) -> None:
    with pytest.raises(
        EnvBuildError,
        match=r"rubric_name: 'nope' is not a reward function of "
        r"digits\.py; it defines \['contains_digit', 'exact_digit'\]",
    ):
        load_rubric(MANIFESTS / "rubrics" / "digits.py", "nope")
    with pytest.raises(EnvBuildError, match="rubric_name to pick one"):
        load_rubric(MANIFESTS / "rubrics" / "digits.py")
    raising = tmp_path / "raising.py"
    raising.write_text("def score(completion, answer, **row):\n    return 1 / 0\n")
    env = RubricEnv([{"question": "q", "answer": "a"}], load_rubric(raising))
    env.reset(row_index=0)
    _, reward, done, _, info = env.step("a")
    assert (reward, done) == (0.0, True)
    assert info["rubric_error"] == "ZeroDivisionError: division by zero"
    with pytest.raises(
        EnvBuildError,
        match=r"the rows have no 'answer' column \(they have "
        r"\['q'\]\); map one with `columns`",
    ):
        RubricEnv([{"q": "x"}], load_rubric(raising))
    with pytest.raises(EnvBuildError, match="prompt_template: the row has no column 'topic'"):
        RubricEnv(
            [{"question": "x", "answer": "y"}],
            load_rubric(raising),
            prompt_template={"user": "About {topic}: {question}"},
        )


def test_a_gymnasium_env_played_in_text(tokenizer: Any) -> None:
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="CartPole-v1",
        factory="agile_llmenvs.adapters.gymnasium:make",
        env_config={"action_names": ["left", "right"]},
        action_error_field="invalid_action",
    )
    factory, max_turns = make_rollout_env_factory(spec, tokenizer)
    assert max_turns == 500  # CartPole's own step limit
    harness = factory()
    prompt = tokenizer.decode(harness.reset(seed=0))
    assert "Actions: 0 (left), 1 (right). Reply with one action number." in prompt
    assert harness.step(answer(tokenizer, "1")).reward == 1.0
    invalid = harness.step(answer(tokenizer, "jump"))
    assert (invalid.reward, invalid.done) == (0.0, False)
    assert invalid.info["action_error"] == "no action in 0..1 found in the reply"
    while not harness.step(answer(tokenizer, "0")).done:
        pass
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.TERMINATED  # pushing left only: the pole falls
    assert data.rewards[1] == 0.0


def test_dataset_rows_and_a_rubric_from_the_shipped_manifest(tokenizer: Any) -> None:
    spec = load_manifest(MANIFESTS / "rollout_digits.yaml").env
    assert isinstance(spec, LLMEnvSpec)
    factory, max_turns = make_rollout_env_factory(spec, tokenizer, seed=0)
    assert max_turns == 1
    harness = factory()
    assert harness.dataset_size() == 10
    for row, reply, reward in ((3, "3", 1.0), (5, "4", 0.0), (7, " 7 ", 1.0)):
        prompt = tokenizer.decode(harness.reset(row_index=row))
        assert f"Say the digit {row}." in prompt
        result = harness.step(answer(tokenizer, reply))
        assert (result.reward, result.done) == (reward, True)
        assert result.info["answer"] == str(row)


def test_the_huggingface_adapter_scores_local_rows(tokenizer: Any, tmp_path: Path) -> None:
    rows = tmp_path / "capitals.csv"
    rows.write_text("country,capital\nFrance,Paris\nPeru,Lima\n")
    rubric = tmp_path / "rubric.py"
    rubric.write_text(
        "def exact(completion, answer, **row):\n"
        "    return 2.0 if completion.strip() == answer else 0.0\n"
    )
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint=str(rows),
        factory="agile_llmenvs.adapters.huggingface:make",
        env_config={
            "rubric_file_path": str(rubric),
            "columns": {"answer": "capital"},
            "prompt_template": {"user": "Capital of {country}?"},
            "max_reward": 2.0,
        },
    )
    factory, _ = make_rollout_env_factory(spec, tokenizer)
    harness = factory()
    assert "Capital of Peru?" in tokenizer.decode(harness.reset(row_index=1))
    assert harness.step(answer(tokenizer, "Lima")).reward == 1.0


def test_rows_that_do_not_parse_fail_at_build_time(tokenizer: Any, tmp_path: Path) -> None:
    from agile_llmenvs.llm_envs.rows import DatasetError

    broken = tmp_path / "rows.jsonl"
    broken.write_text('{"question": "q", "answer": \n')
    spec = LLMEnvSpec(
        env_type="rollout",
        dataset_path=str(broken),
        rubric_file_path=str(MANIFESTS / "rubrics" / "digits.py"),
        rubric_name="exact_digit",
    )
    with pytest.raises(DatasetError, match=r"rows\.jsonl"):
        make_rollout_env_factory(spec, tokenizer)
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text('{"question": "q", "label": "a"}\n')
    spec = spec.model_copy(update={"dataset_path": str(no_answer)})
    with pytest.raises(EnvBuildError, match="the rows have no 'answer' column"):
        make_rollout_env_factory(spec, tokenizer)
