"""DatasetEnv and make_llm_env: exact SFT / preference batches, truncation, shards, resume."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch

from agile_llmenvs.envs import make_env, make_llm_env
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.llm_envs import DatasetEnv, PreferenceBatch, SFTBatch, TaskAssigner
from agile_llmenvs.llm_envs.rows import DatasetError, load_rows
from agile_llmenvs.specs import LLMEnvSpec, load_manifest

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
SFT_ROWS = [
    {"prompt": "Hi", "response": "Hello there, friend."},
    {"prompt": "Tell me a much longer story about three cats", "response": "No."},
    {"prompt": "2+2?", "response": "4"},
]
PREF_ROWS = [
    {"prompt": "Pick one", "chosen": "The first answer is better", "rejected": "No"},
    {"prompt": "A rather longer question", "chosen": "Yes, certainly", "rejected": "Perhaps not."},
]
EMPTY = datasets.Dataset.from_list([])


# -- independent expectations ------------------------------------------------------------------


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def response_ids(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def padded(
    tokenizer: Any, pairs: Sequence[tuple[list[int], list[int]]], width: int
) -> dict[str, list[list[int]]]:
    """Expected ids, mask and labels of (prompt, completion) pairs right-padded to ``width``."""
    pad = tokenizer.pad_token_id
    out: dict[str, list[list[int]]] = {"ids": [], "mask": [], "labels": []}
    for prompt, completion in pairs:
        fill = width - len(prompt) - len(completion)
        out["ids"].append(prompt + completion + [pad] * fill)
        out["mask"].append([1] * (len(prompt) + len(completion)) + [0] * fill)
        out["labels"].append([-100] * len(prompt) + completion + [-100] * fill)
    return out


def sft_env(tokenizer: Any, rows: list[dict[str, Any]], **kwargs: Any) -> DatasetEnv:
    test = kwargs.pop("test", EMPTY)
    return DatasetEnv(datasets.Dataset.from_list(rows), test, tokenizer, objective="sft", **kwargs)


def numbered_rows(count: int) -> list[dict[str, str]]:
    return [{"prompt": f"Row {i}?", "response": f"answer {i}"} for i in range(count)]


def row_indices(tokenizer: Any, batch: SFTBatch, rows: list[dict[str, str]]) -> list[int]:
    """Which of ``rows`` each line of ``batch`` holds, matched on its exact ids."""
    lookup = {
        tuple(prompt_ids(tokenizer, r["prompt"]) + response_ids(tokenizer, r["response"])): i
        for i, r in enumerate(rows)
    }
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return [
        lookup[tuple(ids[:n])] for ids, n in zip(batch.input_ids.tolist(), lengths, strict=True)
    ]


def same_batch(a: SFTBatch | PreferenceBatch, b: SFTBatch | PreferenceBatch) -> bool:
    def equal(x: Any, y: Any) -> bool:
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else bool(x == y)

    return type(a) is type(b) and all(
        equal(getattr(a, name), getattr(b, name)) for name in a.__dataclass_fields__
    )


# -- exact batches -----------------------------------------------------------------------------


def test_sft_batch_is_exact(tokenizer: Any) -> None:
    env = sft_env(tokenizer, SFT_ROWS, data_batch_size_per_gpu=3, seed=7)
    batch = env.next_batch()
    assert isinstance(batch, SFTBatch)
    order = TaskAssigner(3, seed=7).shard()
    pairs = [
        (
            prompt_ids(tokenizer, SFT_ROWS[i]["prompt"]),
            response_ids(tokenizer, SFT_ROWS[i]["response"]),
        )
        for i in order
    ]
    width = max(len(p) + len(c) for p, c in pairs)
    expected = padded(tokenizer, pairs, width)
    assert batch.input_ids.dtype == torch.long
    assert batch.input_ids.tolist() == expected["ids"]
    assert batch.attention_mask.tolist() == expected["mask"]
    assert batch.labels.tolist() == expected["labels"]
    assert batch.prompt_lengths.tolist() == [len(p) for p, _ in pairs]
    assert same_batch(batch.to("cpu"), batch)


def test_message_list_prompts_render_through_the_chat_template(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    env = sft_env(tokenizer, [{"prompt": messages, "response": "4"}], data_batch_size_per_gpu=1)
    batch = env.next_batch()
    expected = prompt_ids(tokenizer, messages) + response_ids(tokenizer, "4")
    assert batch.input_ids.tolist() == [expected]
    assert batch.prompt_lengths.tolist() == [len(prompt_ids(tokenizer, messages))]


def test_preference_batch_is_exact_and_pads_both_sides_to_one_width(tokenizer: Any) -> None:
    rows = datasets.Dataset.from_list(PREF_ROWS)
    env = DatasetEnv(rows, EMPTY, tokenizer, objective="preference", data_batch_size_per_gpu=2)
    batch = env.next_batch()
    assert isinstance(batch, PreferenceBatch)
    order = TaskAssigner(2, seed=42).shard()
    prompts = [prompt_ids(tokenizer, PREF_ROWS[i]["prompt"]) for i in order]
    chosen = [response_ids(tokenizer, PREF_ROWS[i]["chosen"]) for i in order]
    rejected = [response_ids(tokenizer, PREF_ROWS[i]["rejected"]) for i in order]
    width = max(len(p) + len(c) for p, c in zip(prompts * 2, chosen + rejected, strict=True))
    want_chosen = padded(tokenizer, list(zip(prompts, chosen, strict=True)), width)
    want_rejected = padded(tokenizer, list(zip(prompts, rejected, strict=True)), width)
    assert batch.chosen_input_ids.tolist() == want_chosen["ids"]
    assert batch.chosen_attention_mask.tolist() == want_chosen["mask"]
    assert batch.chosen_labels.tolist() == want_chosen["labels"]
    assert batch.rejected_input_ids.tolist() == want_rejected["ids"]
    assert batch.rejected_attention_mask.tolist() == want_rejected["mask"]
    assert batch.rejected_labels.tolist() == want_rejected["labels"]
    assert batch.prompt_lengths.tolist() == [len(p) for p in prompts]


# -- truncation and filtering ------------------------------------------------------------------


def test_truncation_keeps_the_prompt_and_cuts_the_response(tokenizer: Any) -> None:
    row = {"prompt": "Hi", "response": "one two three four five six"}
    prompt, completion = prompt_ids(tokenizer, "Hi"), response_ids(tokenizer, row["response"])
    budget = len(prompt) + 3
    env = sft_env(tokenizer, [row], data_batch_size_per_gpu=1, max_context_length=budget)
    batch = env.next_batch()
    assert batch.input_ids.tolist() == [prompt + completion[:3]]  # cut: no closing eos
    assert batch.labels.tolist() == [[-100] * len(prompt) + completion[:3]]


def test_rows_without_room_for_a_response_are_filtered(tokenizer: Any) -> None:
    rows = [
        {"prompt": "Hi", "response": "fine"},
        {"prompt": "A prompt that is far too long " * 4, "response": "x"},
    ]
    short = len(prompt_ids(tokenizer, "Hi"))
    long = len(prompt_ids(tokenizer, rows[1]["prompt"]))
    for budget in (long - 1, long):  # over the budget, and exactly filling it
        env = sft_env(tokenizer, rows, data_batch_size_per_gpu=2, max_context_length=budget)
        assert env.dataset_size == {"train": 1, "test": 0}
        assert env.next_batch().prompt_lengths.tolist() == [short, short]
    env = sft_env(tokenizer, rows, max_context_length=long + 1)
    assert env.dataset_size == {"train": 2, "test": 0}


def test_min_completion_length_counts_the_remaining_tokens_with_eos(tokenizer: Any) -> None:
    rows = [
        {"prompt": "a", "response": ""},
        {"prompt": "b", "response": "four"},
        {"prompt": "c", "response": "a longer reply here"},
    ]
    lengths = [len(response_ids(tokenizer, r["response"])) for r in rows]
    assert lengths[0] == 1
    assert lengths[1] < lengths[2]
    assert sft_env(tokenizer, rows).dataset_size["train"] == 3  # an empty reply still has eos
    env = sft_env(tokenizer, rows, min_completion_length=lengths[1])
    assert env.dataset_size["train"] == 2
    env = sft_env(tokenizer, rows, min_completion_length=lengths[1] + 1)
    assert env.dataset_size["train"] == 1
    # after truncation: the budget leaves each completion at most 2 tokens
    budget = len(prompt_ids(tokenizer, "c")) + 2
    env = sft_env(tokenizer, rows, max_context_length=budget, min_completion_length=2)
    assert env.dataset_size["train"] == 2


def test_preference_rows_are_dropped_when_either_side_is_too_short(tokenizer: Any) -> None:
    rows = datasets.Dataset.from_list(PREF_ROWS)
    shortest = [
        min(len(response_ids(tokenizer, row[k])) for k in ("chosen", "rejected"))
        for row in PREF_ROWS
    ]
    assert shortest[0] < shortest[1]  # row 0's rejected side is the shortest of all
    env = DatasetEnv(
        rows, rows, tokenizer, objective="preference", min_completion_length=shortest[1]
    )
    assert env.dataset_size == {"train": 1, "test": 1}


def test_a_split_filtered_empty_is_a_clear_error(tokenizer: Any) -> None:
    with pytest.raises(DatasetError, match=r"0 of 3 train rows are left"):
        sft_env(tokenizer, SFT_ROWS, max_context_length=2)


# -- shards, epochs, resume --------------------------------------------------------------------


@pytest.mark.parametrize(("size", "world"), [(12, 1), (12, 4), (10, 3), (7, 2), (5, 5)])
def test_rank_shards_are_disjoint_equal_and_follow_the_task_assigner(
    tokenizer: Any, size: int, world: int
) -> None:
    rows, per_epoch = numbered_rows(size), math.ceil(size / world)
    shards = []
    for rank in range(world):
        env = sft_env(
            tokenizer, rows, data_batch_size_per_gpu=per_epoch, seed=3, rank=rank, world_size=world
        )
        shard = row_indices(tokenizer, env.next_batch(), rows)
        assert shard == TaskAssigner(size, seed=3, rank=rank, world_size=world).shard()
        assert env.num_epochs == 1
        shards.append(shard)
    assert {len(s) for s in shards} == {per_epoch}
    sets = [set(s) for s in shards]
    assert set().union(*sets) == set(range(size))
    assert sum(len(s) for s in sets) == size  # disjoint
    for shard in shards:  # a short shard repeats its own first rows
        distinct = len(set(shard))
        assert shard[distinct:] == shard[: per_epoch - distinct]


def test_more_ranks_than_rows_is_a_clear_error(tokenizer: Any) -> None:
    with pytest.raises(DatasetError, match="4 rank"):
        sft_env(tokenizer, numbered_rows(3), rank=0, world_size=4)


def test_every_epoch_reshuffles_and_batches_run_across_epochs(tokenizer: Any) -> None:
    rows = numbered_rows(8)
    env = sft_env(tokenizer, rows, data_batch_size_per_gpu=8, seed=1)
    first = row_indices(tokenizer, env.next_batch(), rows)
    second = row_indices(tokenizer, env.next_batch(), rows)
    assert sorted(first) == sorted(second) == list(range(8))
    assert first != second
    assert env.num_epochs == 2
    env = sft_env(tokenizer, rows, data_batch_size_per_gpu=3, seed=1)
    drawn = [row_indices(tokenizer, env.next_batch(), rows) for _ in range(3)]
    assert env.num_epochs == 1
    assert [row for batch_rows in drawn for row in batch_rows] == first + second[:1]


def test_state_dict_resumes_the_exact_batch_sequence(tokenizer: Any) -> None:
    rows = numbered_rows(7)
    make = lambda: sft_env(tokenizer, rows, data_batch_size_per_gpu=3, seed=5)  # noqa: E731
    env = make()
    for _ in range(3):
        env.next_batch()
    state = json.loads(json.dumps(env.state_dict()))  # survives a JSON checkpoint
    expected = [env.next_batch() for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.num_epochs == 1
    assert all(same_batch(a, resumed.next_batch()) for a in expected)
    other = sft_env(tokenizer, numbered_rows(6))
    with pytest.raises(DatasetError, match="saved for 7 train rows"):
        other.load_state_dict(state)


# -- eval mode ---------------------------------------------------------------------------------


def test_eval_mode_serves_the_test_split_in_order_once(tokenizer: Any) -> None:
    rows, test_rows = numbered_rows(5), numbered_rows(8)[5:]
    test = datasets.Dataset.from_list(test_rows)
    make = lambda: sft_env(tokenizer, rows, test=test, data_batch_size_per_gpu=2)  # noqa: E731
    env, untouched = make(), make()
    assert env.dataset_size == {"train": 5, "test": 3}
    first = env.next_batch()
    assert same_batch(first, untouched.next_batch())
    env.eval_mode()
    assert env.mode == "eval"
    served = [env.next_batch(), env.next_batch()]
    with pytest.raises(StopIteration):
        env.next_batch()
    with pytest.raises(StopIteration):
        env.next_batch()
    assert [row_indices(tokenizer, b, test_rows) for b in served] == [[0, 1], [2]]
    assert all(same_batch(a, b) for a, b in zip(served, env.iter_test(), strict=True))
    env.train_mode()  # training resumes where it left off
    assert same_batch(env.next_batch(), untouched.next_batch())
    env.eval_mode()  # and eval restarts from the top
    assert same_batch(env.next_batch(), served[0])


def test_eval_mode_with_an_empty_test_split_stops_at_once(tokenizer: Any) -> None:
    env = sft_env(tokenizer, SFT_ROWS)
    env.eval_mode()
    with pytest.raises(StopIteration):
        env.next_batch()
    assert list(env.iter_test()) == []


# -- row errors --------------------------------------------------------------------------------


def test_a_missing_column_names_it_and_the_columns_present(tokenizer: Any) -> None:
    rows = datasets.Dataset.from_list([{"prompt": "p", "answer": "a"}])
    with pytest.raises(DatasetError, match=r"no column 'response'.*\['prompt', 'answer'\]") as info:
        DatasetEnv(rows, EMPTY, tokenizer, objective="sft")
    assert isinstance(info.value, AgileLLMEnvsError)
    assert isinstance(info.value, ValueError)
    with pytest.raises(DatasetError, match="no column 'chosen'"):
        DatasetEnv(rows, EMPTY, tokenizer, objective="preference")
    env = DatasetEnv(rows, EMPTY, tokenizer, objective="sft", response_column="answer")
    assert env.dataset_size == {"train": 1, "test": 0}


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"prompt": 3, "response": "a"}, "'prompt' holds int 3"),
        ({"prompt": "p", "response": None}, "column 'response' holds NoneType"),
    ],
)
def test_a_cell_of_the_wrong_type_names_the_row(tokenizer: Any, row: dict, match: str) -> None:
    with pytest.raises(DatasetError, match=match):
        sft_env(tokenizer, [row])


# -- make_llm_env ------------------------------------------------------------------------------


def spec(path: Path | str, **fields: Any) -> LLMEnvSpec:
    fields.setdefault("objective", "sft")
    return LLMEnvSpec(env_type="dataset", dataset_path=str(path), **fields)


def test_make_llm_env_builds_the_shipped_sft_manifest(tokenizer: Any) -> None:
    manifest_spec = load_manifest(MANIFESTS / "sft_digits.yaml").env
    env = make_llm_env(manifest_spec, tokenizer, data_batch_size_per_gpu=8, seed=0)
    assert isinstance(env, DatasetEnv)
    assert env.dataset_size == {"train": 8, "test": 2}
    rows = [json.loads(line) for line in (MANIFESTS / "data" / "digits_sft.jsonl").open()]
    train = row_indices(tokenizer, env.next_batch(), rows)
    test = [i for batch in env.iter_test() for i in row_indices(tokenizer, batch, rows)]
    assert sorted(train + test) == list(range(10))
    assert test == sorted(test)
    assert isinstance(make_env(manifest_spec, tokenizer=tokenizer), DatasetEnv)


def test_make_llm_env_builds_the_shipped_preference_data(tokenizer: Any) -> None:
    path = MANIFESTS / "data" / "digits_preference.jsonl"
    env = make_llm_env(spec(path, objective="preference"), tokenizer, data_batch_size_per_gpu=4)
    assert env.dataset_size == {"train": 10, "test": 0}
    batch = env.next_batch()
    assert isinstance(batch, PreferenceBatch)
    rows = [json.loads(line) for line in path.open()]
    first = rows[TaskAssigner(10, seed=42).shard()[0]]
    prompt = prompt_ids(tokenizer, first["prompt"])
    n = int(batch.rejected_attention_mask[0].sum())
    assert batch.rejected_input_ids[0, :n].tolist() == prompt + response_ids(
        tokenizer, first["rejected"]
    )


def _qa_table() -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"question": f"Q{i}?", "answer": f"A{i}", "extra": i} for i in range(6)]
    )


def _write(kind: str, rows: datasets.Dataset, path: Path) -> Path:
    if kind == "csv":
        rows.to_csv(str(path), index=False)
    elif kind == "parquet":
        rows.to_parquet(str(path))
    elif kind == "arrow":
        import pyarrow as pa

        table = rows.data.table
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        rows.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["csv", "parquet", "arrow", "folder"])
def test_make_llm_env_reads_files_and_renames_columns(
    tokenizer: Any, tmp_path: Path, kind: str
) -> None:
    path = _write(kind, _qa_table(), tmp_path / f"rows.{kind}")
    columns = {"prompt": "question", "response": "answer"}
    env = make_llm_env(
        spec(path, columns=columns, train_test_split=0.5), tokenizer, data_batch_size_per_gpu=3
    )
    assert env.dataset_size == {"train": 3, "test": 3}
    rows = [{"prompt": f"Q{i}?", "response": f"A{i}"} for i in range(6)]
    train = row_indices(tokenizer, env.next_batch(), rows)
    test = row_indices(tokenizer, next(env.iter_test()), rows)
    assert sorted(train + test) == list(range(6))
    assert test == sorted(test)


def test_load_rows_splits_by_seed_and_keeps_a_source_test_split(tmp_path: Path) -> None:
    path = _write("csv", _qa_table(), tmp_path / "rows.csv")
    train_a, test_a = load_rows(spec(path, train_test_split=0.5), seed=1)
    _, test_b = load_rows(spec(path, train_test_split=0.5), seed=2)
    assert sorted([*train_a["extra"], *test_a["extra"]]) == list(range(6))
    assert list(test_a["extra"]) != list(test_b["extra"])
    assert len(load_rows(spec(path), seed=1)[1]) == 0  # no split asked: no test rows
    both = datasets.DatasetDict({"train": _qa_table(), "test": _qa_table().select([0, 1])})
    folder = _write("folder", both, tmp_path / "splits")  # type: ignore[arg-type]
    train, test = load_rows(spec(folder), seed=0)
    assert (len(train), list(test["extra"])) == (6, [0, 1])
    with pytest.raises(DatasetError, match="own 'test' split"):
        load_rows(spec(folder, train_test_split=0.2), seed=0)


def test_a_mapped_column_the_file_lacks_is_a_clear_error(tokenizer: Any, tmp_path: Path) -> None:
    path = _write("csv", _qa_table(), tmp_path / "rows.csv")
    with pytest.raises(DatasetError, match=r"no column 'query'.*'question', 'answer', 'extra'"):
        make_llm_env(spec(path, columns={"prompt": "query"}), tokenizer)
    with pytest.raises(DatasetError, match="no column 'prompt'"):
        make_llm_env(spec(path), tokenizer)


def test_chat_template_path_replaces_the_template_for_this_env(
    tokenizer: Any, tmp_path: Path
) -> None:
    template = (
        "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>>{% endif %}"
    )
    (tmp_path / "chat.jinja").write_text(template)
    original = tokenizer.chat_template
    path = MANIFESTS / "data" / "digits_sft.jsonl"
    env = make_llm_env(
        spec(path, chat_template_path=str(tmp_path / "chat.jinja")),
        tokenizer,
        data_batch_size_per_gpu=1,
    )
    batch = env.next_batch()
    row = json.loads(path.read_text().splitlines()[TaskAssigner(10, seed=42).shard()[0]])
    prompt = tokenizer.encode(f"<<user>>{row['prompt']}<<assistant>>", add_special_tokens=False)
    assert batch.input_ids.tolist() == [prompt + response_ids(tokenizer, row["response"])]
    assert tokenizer.chat_template == original
    with pytest.raises(AgileLLMEnvsError, match=r"missing\.jinja"):
        make_llm_env(spec(path, chat_template_path=str(tmp_path / "missing.jinja")), tokenizer)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("broken.jsonl", '{"prompt": "a", "response": "b"}\n{not json\n', "could not parse"),
        ("rows.txt", "prompt\n", "suffix '.txt'"),
    ],
)
def test_an_unreadable_file_names_it(tmp_path: Path, name: str, text: str, match: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match=match) as info:
        load_rows(spec(tmp_path / name), seed=0)
    assert name in str(info.value)
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(spec(tmp_path / "absent.jsonl"), seed=0)


def test_a_missing_hf_dataset_id_fails_fast_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # Even with the environment saying "online", nothing is fetched.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    missing = LLMEnvSpec(env_type="dataset", objective="sft", hf_dataset_id="nobody/no-such-set")
    start = time.monotonic()
    with pytest.raises(DatasetError, match=r"'nobody/no-such-set' is not in the local"):
        load_rows(missing, seed=0)
    assert time.monotonic() - start < 10
    assert datasets.config.HF_HUB_OFFLINE is False  # restored


def test_make_llm_env_refuses_a_rollout_spec(tokenizer: Any) -> None:
    rollout = LLMEnvSpec(env_type="rollout", entrypoint="pkg.mod:Env")
    with pytest.raises(AgileLLMEnvsError, match="make_rollout_env_factory"):
        make_llm_env(rollout, tokenizer)
