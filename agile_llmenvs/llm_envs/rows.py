"""Dataset rows from a spec: a local file or a cached Hugging Face dataset, split and renamed.

``datasets`` is imported when rows are loaded, not with this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agile_llmenvs._quiet import quiet_datasets
from agile_llmenvs.errors import AgileLLMEnvsError

if TYPE_CHECKING:
    from datasets import Dataset

    from agile_llmenvs.specs import LLMEnvSpec

__all__ = ["FILE_FORMATS", "DatasetError", "load_rows", "require_columns"]

#: The ``datasets`` builder that reads each rows-file suffix.
FILE_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}


class DatasetError(AgileLLMEnvsError, ValueError):
    """Dataset rows could not be read, or do not have what the env needs."""


def load_rows(spec: LLMEnvSpec, seed: int) -> tuple[Dataset, Dataset]:
    """The train and test rows of a spec's row source, under the env's column names.

    Rows come from ``spec.dataset_path`` (a jsonl, json, csv, parquet or arrow file, or a
    folder written by ``save_to_disk``), or from ``spec.hf_dataset_id`` / ``spec.dataset`` read
    from the local Hugging Face cache only: nothing is downloaded. A source with its own
    ``test`` split keeps it; otherwise ``spec.train_test_split`` of the rows (drawn with
    ``seed``; none by default) are held out as test. Both splits keep the source's row order.
    ``spec.columns`` then renames dataset columns to the env's names:
    ``{"prompt": "question"}`` makes the dataset's ``question`` column the ``prompt``.

    Args:
        spec: A spec with a row source.
        seed: Seed of the train/test split.

    Returns:
        ``(train, test)``; ``test`` may be empty.

    Raises:
        DatasetError: The source is missing, does not parse, is not cached, or lacks a mapped
            column.
    """
    label, rows = _read_source(spec)
    fraction = spec.train_test_split or 0.0
    if isinstance(rows, Mapping):
        train, test = _named_splits(rows, fraction, seed, label)
    else:
        train, test = _hold_out(rows, fraction, seed)
    if spec.columns:
        train, test = _rename(train, spec.columns, label), _rename(test, spec.columns, label)
    return train, test


def require_columns(dataset: Dataset, names: Iterable[str], label: str) -> None:
    """Raise :class:`DatasetError` naming the first of ``names`` that ``dataset`` lacks."""
    present = list(dataset.column_names)
    missing = [name for name in names if name not in present]
    if missing:
        raise DatasetError(
            f"{label}: the rows have no column {missing[0]!r} (they have {present}); "
            "rename one with the spec's `columns`, e.g. {" + f"{missing[0]!r}: 'your_column'" + "}"
        )


def _read_source(spec: LLMEnvSpec) -> tuple[str, Any]:
    if spec.dataset_path is not None:
        return spec.dataset_path, _read_path(Path(spec.dataset_path))
    name, field = (
        (spec.hf_dataset_id, "hf_dataset_id")
        if spec.hf_dataset_id is not None
        else (spec.dataset, "dataset")
    )
    if name is None:
        raise DatasetError(
            f"{spec.label!r} has no rows: set `dataset_path`, `dataset` or `hf_dataset_id`"
        )
    return name, _read_cached(name, field)


def _read_path(path: Path) -> Any:
    import datasets

    if path.is_dir():
        try:
            return datasets.load_from_disk(str(path))
        except Exception as exc:  # foreign errors, translated at this one boundary
            raise DatasetError(f"dataset_path: could not load the folder {path}: {exc}") from exc
    if not path.is_file():
        raise DatasetError(f"dataset_path: {str(path)!r} does not exist")
    builder = FILE_FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(
            f"dataset_path: {path.name} has the suffix {path.suffix!r}; "
            f"expected one of {', '.join(FILE_FORMATS)} (or a save_to_disk folder)"
        )
    try:
        # Offline, or datasets pings the hub to count the load even for a local file
        with _hub_offline(), quiet_datasets():  # no "Generating train split" bar
            return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:
        raise DatasetError(
            f"dataset_path: could not parse {path} as {builder}: {type(exc).__name__}: {exc}"
        ) from exc


def _read_cached(name: str, field: str) -> Any:
    import datasets

    with _hub_offline(), quiet_datasets():
        try:
            return datasets.load_dataset(name)
        except Exception as exc:
            raise DatasetError(
                f"{field}: {name!r} is not in the local Hugging Face cache "
                f"({type(exc).__name__}: {exc}); datasets are never downloaded at run time: "
                f"run datasets.load_dataset({name!r}) once where the Hub is reachable, or point "
                "`dataset_path` at a local file"
            ) from exc


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Force ``datasets`` and ``huggingface_hub`` offline, whatever the environment says, so
    nothing reaches the network: a missing dataset fails at once instead of waiting on it, and
    a local file is read without the hub's load counter."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _named_splits(
    splits: Mapping[str, Dataset], fraction: float, seed: int, label: str
) -> tuple[Dataset, Dataset]:
    names = list(splits)
    if "train" not in splits and len(names) != 1:
        raise DatasetError(f"{label}: no 'train' split among {names}")
    train = splits["train"] if "train" in splits else splits[names[0]]
    if "test" not in splits:
        return _hold_out(train, fraction, seed)
    if fraction > 0:
        raise DatasetError(
            f"{label}: has its own 'test' split, so train_test_split={fraction} would hold out "
            "a second one; drop train_test_split"
        )
    return train, splits["test"]


def _hold_out(rows: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Hold out ``fraction`` of the rows (at least one when positive) as test, by ``seed``."""
    count = len(rows)
    held = 0 if fraction <= 0 else min(count, max(1, round(count * fraction)))
    order = np.random.default_rng(seed).permutation(count)
    test_rows = np.sort(order[:held])
    train_rows = np.sort(order[held:])
    return rows.select(train_rows.tolist()), rows.select(test_rows.tolist())


def _rename(rows: Dataset, columns: Mapping[str, str], label: str) -> Dataset:
    require_columns(rows, columns.values(), label)
    renames = {source: name for name, source in columns.items() if source != name}
    kept = set(rows.column_names) - set(renames)
    clash = sorted(kept & set(renames.values()))
    if clash:
        raise DatasetError(
            f"{label}: `columns` renames a column to {clash[0]!r}, which the rows already have; "
            "rename or drop that column first"
        )
    return rows.rename_columns(renames) if renames else rows
