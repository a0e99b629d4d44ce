"""Evaluation configs: the YAML schema (:class:`EvalConfig`) and the factories it feeds.

```python
config = EvalConfig.from_yaml("manifests/eval/leg_counting.yaml")
env = EnvironmentFactory.create(config.environments[0])
backend = BackendFactory.create(config.model)
params = create_sampling_params(config.inference)
```
"""

from __future__ import annotations

from agile_llmenvs.config.factories import (
    BackendFactory,
    EnvironmentFactory,
    create_sampling_params,
)
from agile_llmenvs.config.models import (
    TINY_MODEL,
    TINY_VLM_MODEL,
    EnvironmentConfig,
    EvalConfig,
    InferenceConfig,
    ModelConfig,
    ResultsConfig,
)

__all__ = [
    "TINY_MODEL",
    "TINY_VLM_MODEL",
    "BackendFactory",
    "EnvironmentConfig",
    "EnvironmentFactory",
    "EvalConfig",
    "InferenceConfig",
    "ModelConfig",
    "ResultsConfig",
    "create_sampling_params",
]
