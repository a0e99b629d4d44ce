"""What ``agile-llmenvs validate`` checks: a run manifest or an eval config, from its fields
to the files, imports and model it names, without loading weights.

First the fields (pydantic); then, unless ``check_files=False``, that each file a run reads
exists (dataset rows and ``env_config`` files also parse, and rows have the columns the env
reads), that rubric functions, entrypoints, factories, wrappers and processors import, that a
model path is a local model folder whose config and tokenizer load, and that the optional
packages the settings need are installed; unless ``build=False``, one env of a rollout
manifest's ``entrypoint`` is built with its ``env_config`` (as training builds it) and closed.
Nothing is downloaded and no server is contacted: an ``env_url`` is taken as given, an env
placed on Ray env hosts is not built here, and a model path that is not on disk is an error
even when it names a hub model. Each problem names its field path (``env.rubric_name``) and
says how to fix it.
"""

from __future__ import annotations

from agile_llmenvs.validation._files import (
    Validation,
    check_eval_config,
    check_run_manifest,
    describe_manifest,
    problem_lines,
    report_lines,
    validate_file,
)
from agile_llmenvs.validation._problems import Problem, problems_of

__all__ = [
    "Problem",
    "Validation",
    "check_eval_config",
    "check_run_manifest",
    "describe_manifest",
    "problem_lines",
    "problems_of",
    "report_lines",
    "validate_file",
]
