"""TRL's ``environment_factory`` path: ``TRLEnv.environment_kwargs()``.

The trainer test runs real TRL 1.16 (``GRPOTrainer(environment_factory=...)``) on the tiny
model with Qwen3's chat template as TRL ships it (so TRL parses the tool calls itself), against
an OpenEnv MCP env, and checks every row TRL's loss receives against the harness playing the
same sampled ids: the same ids and the same mask, exactly.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("fastmcp")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.integrations._trl_environment import (
    ACT_TOOL,
    EPISODE_OVER,
    environment_class,
    tool_signature,
)
from agile_llmenvs.integrations.trl import TRLEnv, TRLEnvConfig
from agile_llmenvs.specs import LLMEnvSpec

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")

SUM_SPEC = {
    "env_type": "rollout",
    "entrypoint": "echo_envs:SumToolEnv",
    "max_turns": 2,
    "mcp_tool": "add",  # the harness parses tool calls (hermes: Qwen's format)
}


def _spec(**fields: Any) -> LLMEnvSpec:
    return LLMEnvSpec.model_validate(fields)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# -- the class TRL instantiates ---------------------------------------------------------------


def test_a_listed_tool_becomes_a_method_get_json_schema_reads_back() -> None:
    from transformers.utils import get_json_schema

    tool = {
        "name": "move",
        "description": "Move the piece.",
        "inputSchema": {
            "type": "object",
            "properties": {
                "square": {"type": "string", "description": "Where to."},
                "times": {"type": "integer"},
            },
            "required": ["square"],
        },
    }
    signature, doc = tool_signature(tool)
    assert str(signature) == "(self, *, square: str, times: int | None = None) -> str"
    assert doc == "Move the piece.\n\nArgs:\n    square: Where to.\n    times: The times argument."
    cls = environment_class(lambda: None, [], [tool], max_turns=1, harnesses=[])  # type: ignore[arg-type,return-value]
    assert get_json_schema(cls.move) == {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move the piece.",
            "parameters": {
                "type": "object",
                "properties": {
                    "square": {"type": "string", "description": "Where to."},
                    "times": {
                        "type": "integer",
                        "nullable": True,
                        "description": "The times argument.",
                    },
                },
                "required": ["square"],
            },
            "return": {"type": "string"},
        },
    }
    # TRL offers every public function of the class but reset and get_reward as a tool
    public = [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
    assert public == ["get_reward", "move", "reset"]


def test_tools_that_cannot_be_methods_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="argument 'x' has JSON type 'null'"):
        tool_signature({"name": "f", "inputSchema": {"properties": {"x": {"type": "null"}}}})
    with pytest.raises(ValueError, match="the env's tool 'reset' cannot be a TRL environment"):
        environment_class(lambda: None, [], [{"name": "reset"}], max_turns=1, harnesses=[])  # type: ignore[arg-type,return-value]


def test_a_text_env_offers_act_and_plays_its_turns_then_says_the_episode_is_over(
    tiny_tokenizer: Any,
) -> None:
    # SeededTurnsEnv: 1 + seed % 3 turns, each rewarded by the action's share of digits
    env = TRLEnv(
        _spec(env_type="rollout", entrypoint="echo_envs:SeededTurnsEnv"),
        tiny_tokenizer,
        config=TRLEnvConfig(num_tasks=4),
    )
    with env:
        kwargs = env.environment_kwargs()
        rows = kwargs["train_dataset"]
        assert rows["task"] == [0, 1, 2, 3]
        assert rows["prompt"] == env.prompts
        cls = kwargs["environment_factory"]
        built = env.tool_environments()
        assert cls is built.environment_class  # built once
        assert cls.act.__doc__.startswith(ACT_TOOL["description"])
        lengths = [1 + int(task.seed) % 3 for task in env.tasks]
        task = max(range(4), key=lambda i: lengths[i])
        instance = cls()
        assert instance.reset(**{"prompt": rows["prompt"][task], "task": task}) is None
        answers = [instance.act(action="12ab") for _ in range(lengths[task])]
        assert answers == [f"turn {t}" for t in range(1, lengths[task])] + [EPISODE_OVER]
        assert instance.act(action="99") == EPISODE_OVER  # reaches no env
        assert instance.get_reward() == pytest.approx(0.5 * lengths[task])
        instance.reset(task=task)  # a fresh episode on the same instance
        assert instance.act(action="1") == ("turn 1" if lengths[task] > 1 else EPISODE_OVER)
        assert instance.get_reward() == 1.0
    assert built.harnesses == []  # closed with the TRLEnv


def test_an_mcp_env_offers_its_own_tools_and_scores_the_calls(tiny_tokenizer: Any) -> None:
    env = TRLEnv(_spec(**SUM_SPEC), tiny_tokenizer, config=TRLEnvConfig(num_tasks=2))
    with env:
        cls = env.environment_kwargs()["environment_factory"]
        instance = cls()
        even = next(i for i, t in enumerate(env.tasks) if not t.seed or t.seed % 2 == 0)
        instance.reset(task=even)  # asks for 2 + 3
        assert instance.add(a=2, b=3) == "5"
        assert instance.add(a=4, b=5) == EPISODE_OVER  # the second of max_turns 2
        assert instance.get_reward() == 1.0
        assert instance.add(a=2, b=3) == EPISODE_OVER
        assert instance.get_reward() == 1.0
        assert [s["function"]["name"] for s in env.tool_environments().schemas()] == ["add"]


# -- real TRL ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Qwen3's special tokens and the Qwen3 chat template TRL ships (TRL
    recognises it and parses its ``<tool_call>`` blocks)."""
    import trl
    from template_corpus import get_case, with_template

    tokenizer = with_template(tiny_model_dir, get_case("qwen3"))
    template = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
    tokenizer.chat_template = template.read_text()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    folder = tmp_path_factory.mktemp("qwen3-tiny")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _call_ids(tokenizer: Any, a: int, b: int) -> list[int]:
    text = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def _forcing_bias(calls: list[list[int]]) -> list[list[Any]]:
    """``sequence_bias`` that makes the policy write one of ``calls`` (the tiny model writes
    no tool call of its own): every prefix of each is pushed by 10 per token, so where the
    calls part (the first number) the model's own logits choose between them."""
    bias = {tuple(ids[:k]): 10.0 * k for ids in calls for k in range(1, len(ids) + 1)}
    return [[list(prefix), value] for prefix, value in bias.items()]


def _rows(inputs: dict[str, Any]) -> list[tuple[list[int], list[bool], list[list[int]]]]:
    """Each row TRL's loss receives, unpadded: its ids, the next-token mask (sampled ids), and
    the stretches of sampled ids (the policy's turns)."""
    rows = []
    for b in range(inputs["prompt_ids"].shape[0]):
        prompt = inputs["prompt_ids"][b][inputs["prompt_mask"][b].bool()].tolist()
        keep = inputs["completion_mask"][b].bool()
        completion = inputs["completion_ids"][b][keep].tolist()
        sampled = [bool(m) for m in inputs["tool_mask"][b][keep].tolist()]
        turns: list[list[int]] = []
        for k, (token, is_sampled) in enumerate(zip(completion, sampled, strict=True)):
            if is_sampled and (k == 0 or not sampled[k - 1]):
                turns.append([])
            if is_sampled:
                turns[-1].append(token)
        rows.append((prompt + completion, [False] * (len(prompt) - 1) + sampled, turns))
    return rows


def _advantages(played: list[list[list[int]]], right: list[int]) -> list[float]:
    rewards = [float(sum(turn == right for turn in turns)) for turns in played]
    return [r - sum(rewards) / len(rewards) for r in rewards]


def test_grpo_trainer_with_environment_factory_trains_on_the_harness_ids(
    qwen3_model: Path, tmp_path: Path
) -> None:
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_model)
    env = TRLEnv(_spec(**SUM_SPEC), tokenizer, config=TRLEnvConfig(num_tasks=4))
    calls = [_call_ids(tokenizer, 2, 3), _call_ids(tokenizer, 4, 5)]
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=160,
        max_tool_calling_iterations=2,
        learning_rate=1e-2,
        scale_rewards="none",
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        max_steps=2,
        generation_kwargs={"sequence_bias": _forcing_bias(calls)},
    )
    with env:
        trainer = GRPOTrainer(
            model=str(qwen3_model),
            args=args,
            processing_class=tokenizer,
            **env.environment_kwargs(),
        )
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        seen: list[dict[str, Any]] = []
        compute_loss = trainer._compute_loss

        def recording(model: Any, inputs: dict[str, Any]) -> Any:
            seen.append(
                {k: v.detach().cpu().clone() for k, v in inputs.items() if torch.is_tensor(v)}
            )
            return compute_loss(model, inputs)

        trainer._compute_loss = recording
        trainer.train()
        # the harness, rendering the tools TRL rendered, replays each row's sampled turns
        spec = _spec(**SUM_SPEC, chat_template_kwargs={"tools": env.tool_environments().schemas()})
        factory, _ = make_rollout_env_factory(spec, tokenizer)
        harness = factory()
        played = 0
        try:
            for inputs in seen:  # one step: one group of 8 rows, of one task
                rows = _rows(inputs)
                played_calls = [turns[:2] for _, _, turns in rows]
                # the task's call scores 1 a turn: advantage = reward - the group's mean
                assert any(
                    _advantages(played_calls, right) == pytest.approx(inputs["advantages"].tolist())
                    for right in calls
                )
                for ids, mask, turns in rows:
                    assert turns[0] in calls  # two env turns
                    assert turns[1] in calls
                    harness.reset(**env.tasks[0].reset_kwargs())  # the ids are the task's too
                    for turn in turns[:2]:
                        harness.step(turn)
                    assert harness.done
                    samples = harness.get_episode_data().samples
                    # Qwen3's template writes an empty think block into the last assistant
                    # message only, so the harness re-renders at turn 2 and starts a second
                    # sample: each is a prefix of TRL's row, and their sampled ids are TRL's
                    assert len(samples) == 2
                    cut = len(samples[-1].token_ids)
                    sampled = [False] * (cut - 1)
                    for sample in samples:
                        assert list(sample.token_ids) == ids[: len(sample.token_ids)]
                        for k, flag in enumerate(sample.action_mask):
                            sampled[k] = sampled[k] or flag
                    assert mask[: cut - 1] == sampled
                    # then TRL's own: the tool's EPISODE_OVER and a third, cut, completion
                    assert EPISODE_OVER in tokenizer.decode(ids[cut:])
                    played += 1
        finally:
            harness.close()
    assert played == 16
    rewards = {round(float(a), 4) for inputs in seen for a in inputs["advantages"]}
    assert rewards != {0.0}  # the two calls score differently within a group
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
