"""A small scripted episode whose ids, mask and turn ids were checked by hand."""

from __future__ import annotations

from typing import Any

from echo_envs import EchoEnv

from agile_llmenvs.llm_envs import RolloutHarness, StopReason

# '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay 7 seed=1<|im_end|>\n'
# '<|im_start|>assistant\n'
PROMPT = [
    1,
    327,
    201,
    36,
    71,
    286,
    84,
    75,
    71,
    72,
    16,
    2,
    201,
    1,
    308,
    201,
    53,
    298,
    223,
    25,
    280,
    71,
    71,
    70,
    31,
    19,
    2,
    201,
    1,
    303,
    201,
]
TURN_0 = [25, 2]  # '7<|im_end|>', sampled; it ends with the end-of-turn token
# '\n<|im_start|>user\n1:7<|im_end|>\n<|im_start|>assistant\n': no second <|im_end|>
FRAME_0 = [201, 1, 308, 201, 19, 28, 25, 2, 201, 1, 303, 201]
TURN_1 = [284, 81, 82]  # 'stop', sampled without an end-of-turn token: the env terminates


def test_scripted_episode(tokenizer: Any) -> None:
    harness = RolloutHarness.local(
        EchoEnv(greeting="Say 7"), tokenizer, max_turns=3, system_prompt="Be brief."
    )
    assert harness.reset(seed=1) == PROMPT
    first = harness.step(TURN_0, [-0.5, -0.25])
    assert first.prompt_ids == FRAME_0
    assert (first.reward, first.done, first.new_sample) == (1.0, False, False)
    last = harness.step(TURN_1, [-1.0, -2.0, -3.0])
    assert (last.prompt_ids, last.reward, last.done) == ([], 2.0, True)

    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.TERMINATED
    assert data.rewards == (1.0, 2.0)
    assert data.token_ids == tuple(PROMPT + TURN_0 + FRAME_0 + TURN_1)
    # targets are token_ids[1:]: the prompt's 30 targets, the 2 sampled, the frame's 12, 3 sampled
    assert data.action_mask == (False,) * 30 + (True,) * 2 + (False,) * 12 + (True,) * 3
    assert data.turn_ids == (-1,) * 30 + (0, 0) + (-1,) * 12 + (1, 1, 1)
    assert data.sampling_logps == (-0.5, -0.25, -1.0, -2.0, -3.0)
    assert data.sample.aligned_logps()[30:32] == [-0.5, -0.25]
    assert data.info["answer"] == "stop"
    assert tokenizer.decode(list(data.token_ids)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay 7 seed=1<|im_end|>\n"
        "<|im_start|>assistant\n7<|im_end|>\n<|im_start|>user\n1:7<|im_end|>\n"
        "<|im_start|>assistant\nstop"
    )
