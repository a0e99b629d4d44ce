"""Manifests as data: env specs, the run manifest, YAML/JSON loading and the JSON Schema.

Specs validate at load (``extra="forbid"``, field bounds, cross-field rules) and build nothing;
:mod:`agile_llmenvs.envs` turns them into live environments.
"""

from __future__ import annotations

from agile_llmenvs.specs.env import BanditEnvSpec, EnvServiceSpec, GymEnvSpec, OfflineEnvSpec
from agile_llmenvs.specs.llm import LLMEnvSpec
from agile_llmenvs.specs.manifest import (
    EnvSpec,
    ModelSpec,
    RunManifest,
    TrainingSpec,
    dump_manifest,
    load_manifest,
    manifest_json_schema,
)

__all__ = [
    "BanditEnvSpec",
    "EnvServiceSpec",
    "EnvSpec",
    "GymEnvSpec",
    "LLMEnvSpec",
    "ModelSpec",
    "OfflineEnvSpec",
    "RunManifest",
    "TrainingSpec",
    "dump_manifest",
    "load_manifest",
    "manifest_json_schema",
]
