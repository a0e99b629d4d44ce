"""Weight-sync folders (``training.weight_files``): what each process writes, and the whole
tensors a server reads back."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch
from lora_models import untied_copy
from safetensors import safe_open
from safetensors.torch import load_file
from training.launch import launch_two
from transformers import AutoModelForCausalLM

from agile_llmenvs.weights import local_weights, rank_file, read_weights, write_weights

HERE = Path(__file__).resolve().parent


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_process_writes_a_safetensors_file_of_the_weights(
    tiny_model_dir: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    path = write_weights(tmp_path / "sync", local_weights(model), chunk_bytes=1000)
    assert path == tmp_path / "sync" / "rank-00000-of-00001.safetensors"
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == [path.name]  # no .partial
    expected = _params(model)
    written = load_file(str(path))  # safetensors' own reader takes the hand-laid file
    assert len(written) == 26  # the tiny model: 2 layers of 12, the embedding and final norm
    assert set(written) == set(expected)
    for name, tensor in written.items():
        assert tensor.dtype == dtype
        assert torch.equal(tensor, expected[name]), name
    read = dict(read_weights(tmp_path / "sync"))
    assert set(read) == set(expected)
    assert all(torch.equal(read[name], expected[name]) for name in expected)


def test_lora_weights_are_written_merged(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.25)
    expected = _params(copy.deepcopy(model).merge_and_unload())
    write_weights(tmp_path, local_weights(model))
    read = dict(read_weights(tmp_path))
    assert set(read) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(read[name], tensor, rtol=1e-6, atol=1e-6)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        read[q_proj],
        model.get_base_model().state_dict()["model.layers.0.self_attn.q_proj.base_layer.weight"],
    )


def test_a_folder_missing_a_process_file_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    write_weights(tmp_path, local_weights(model), rank=1, world_size=3, sharded=True)
    with pytest.raises(FileNotFoundError) as raised:
        next(read_weights(tmp_path))
    assert str(raised.value) == (
        f"{tmp_path} is missing rank-00000-of-00003.safetensors, rank-00002-of-00003.safetensors"
    )
    with pytest.raises(FileNotFoundError, match="holds no rank-"):
        next(read_weights(tmp_path / "nothing"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
@pytest.mark.parametrize("mode", ["whole", "fsdp", "fsdp-lora", "fsdp-lora-ends"])
def test_two_processes_write_a_folder_that_reads_back_whole(
    tiny_model_dir: Path, tmp_path: Path, mode: str
) -> None:
    model_dir = tiny_model_dir
    if mode.startswith("fsdp-lora"):
        pytest.importorskip("peft")
    if mode == "fsdp-lora-ends":  # embed_tokens' rows, sharded, merged with A's columns
        model_dir = untied_copy(tiny_model_dir, tmp_path / "untied")
    folder = tmp_path / "sync"
    done = launch_two(HERE / "sharded_weight_files.py", str(model_dir), mode, str(folder))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = torch.load(tmp_path / "expected.pt")
    files = [rank_file(folder, rank, 2) for rank in (0, 1)]
    with safe_open(str(files[0]), "pt") as first, safe_open(str(files[1]), "pt") as second:
        if mode == "whole":  # rank 0 writes the model, rank 1 a file with no tensors
            assert set(first.keys()) == set(expected)
            assert list(second.keys()) == []
        else:  # FSDP2 splits dim 0 as torch.chunk does: rank 0 the first ceil(n / 2) rows
            assert set(first.keys()) == set(second.keys()) == set(expected)
            for name, tensor in expected.items():
                rows = tensor.shape[0]
                assert first.get_slice(name).get_shape()[0] == math.ceil(rows / 2), name
                assert second.get_slice(name).get_shape()[0] == rows - math.ceil(rows / 2)
    read = dict(read_weights(folder))
    assert set(read) == set(expected)
    for name, tensor in expected.items():
        if mode.startswith("fsdp-lora"):  # merged here and by peft: the same sums, maybe reordered
            torch.testing.assert_close(read[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(read[name], tensor), name
