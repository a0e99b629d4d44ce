"""Rollout harness cost per turn, over the floor of tokenizing the new observation.

Each turn appends 32 sampled ids and a ~200-character observation. The env client is a
fixed-reply stand-in (no env, no wire), so what is timed is the harness itself: decoding the
action, framing, tokenizing the observation, bookkeeping. The floor is
``tokenizer.encode(observation)`` alone, timed in the same run, interleaved. Turns 1, 16 and 64
show whether the cost grows with the transcript (it must not). A stricter floor is shown too:
the Rust tokenizer's encoding of the observation without character offsets
(``encode_batch_fast``, which the harness itself uses), with no Python wrapper. Two
tokenizers: the built-in byte-level BPE one (ChatML) and a real SentencePiece one,
``mistral-common``'s v3 model under a Mistral v0.3 style template (keys prefixed
``sentencepiece_``). Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agile_llmenvs.llm_envs import RolloutHarness
from agile_llmenvs.transport import EnvReply

OBSERVATION = (
    "The board after your move: row 1 is x . o, row 2 is . x ., row 3 is o . . "
    "Your score is 12 and you have 3 moves left. Choose a free cell as (row, col)."
)


class FixedClient:
    """Answers every step with the same observation: the cheapest possible env."""

    def __init__(self) -> None:
        self.reply = EnvReply(observation={"prompt": OBSERVATION}, reward=0.0, done=False)

    def reset(self, *, seed: int | None = None, **task: Any) -> EnvReply:
        return self.reply

    def step(self, text: str) -> EnvReply:
        return self.reply

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


#: A Mistral v0.3 style template: [INST] ... [/INST] turns, answers closed by eos.
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{{- '[INST] ' + m['content'] + '[/INST]' }}{%- elif m['role'] == 'assistant' %}"
    "{{- ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from agile_llmenvs.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        return AutoTokenizer.from_pretrained(build_tiny_model(f"{tmp}/model"))


def sentencepiece_tokenizer() -> Any:
    """``mistral-common``'s v3 SentencePiece model, loaded offline (the dev extra)."""
    import shutil
    from pathlib import Path

    import mistral_common
    from transformers import LlamaTokenizer

    source = Path(mistral_common.__file__).parent / "data"
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(source / "mistral_instruct_tokenizer_240323.model.v3", f"{tmp}/tokenizer.model")
        tokenizer = LlamaTokenizer.from_pretrained(tmp, legacy=False)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


def measure(tokenizer: Any, episodes: int, turns: int, prefix: str = "") -> dict[str, Any]:
    """Median harness cost per turn at turns 1, 16 and 64, over the encode floor."""
    completion = tokenizer.encode(
        "I choose the cell (2, 3) because it blocks the diagonal and keeps my row open for later.",
        add_special_tokens=False,
    )
    completion = [*(completion * 4)[:31], tokenizer.eos_token_id]
    assert len(completion) == 32
    per_turn: dict[int, list[float]] = {t: [] for t in range(1, turns + 1)}
    floor: list[float] = []
    rust_floor: list[float] = []
    rust = tokenizer.backend_tokenizer
    for _ in range(episodes):
        harness = RolloutHarness(FixedClient(), tokenizer, max_turns=turns + 1)
        harness.reset()
        for turn in range(1, turns + 1):
            start = time.perf_counter()
            tokenizer.encode(OBSERVATION, add_special_tokens=False)
            floor.append(time.perf_counter() - start)
            start = time.perf_counter()
            rust.encode_batch_fast([OBSERVATION], add_special_tokens=False)
            rust_floor.append(time.perf_counter() - start)
            start = time.perf_counter()
            harness.step(completion)
            per_turn[turn].append(time.perf_counter() - start)
    floor_us = statistics.median(floor) * 1e6
    rust_us = statistics.median(rust_floor) * 1e6
    result: dict[str, Any] = {
        f"{prefix}encode_floor_us": round(floor_us, 1),
        f"{prefix}rust_floor_us": round(rust_us, 1),
    }
    for turn in (1, 16, 64):
        if turn <= turns:
            cost = statistics.median(per_turn[turn]) * 1e6
            result[f"{prefix}turn_{turn}_us"] = round(cost, 1)
            result[f"{prefix}turn_{turn}_over_floor"] = round(cost / floor_us, 2)
            result[f"{prefix}turn_{turn}_over_rust_floor"] = round(cost / rust_us, 2)
    if turns >= 64:
        ratio = result[f"{prefix}turn_64_us"] / result[f"{prefix}turn_1_us"]
        result[f"{prefix}turn_64_over_turn_1"] = round(ratio, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--turns", type=int, default=64)
    args = parser.parse_args()
    result: dict[str, Any] = {"figure": "harness_turn"}
    result |= measure(tiny_tokenizer(), args.episodes, args.turns)
    result |= measure(sentencepiece_tokenizer(), args.episodes, args.turns, "sentencepiece_")
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
