"""Model-family specs, the single source of truth for canonical tensors and their names in each format
(schema.py: what a spec is; gpt.py: the GPT family). Torch-free.

FAMILIES is where a family's spec is chosen: every view that has a model config (state.expected_names,
roles.tables_for, megatron_names.dialects_for) asks spec_for(config), keyed by the config's `family`. A new
family is its spec module beside gpt.py and one line here."""
from __future__ import annotations

from typing import Dict

from .gpt import GPT
from .schema import Spec

FAMILIES: Dict[str, Spec] = {
    "gpt": GPT,
}


def spec_for(config) -> Spec:
    """The spec of the family a model config says it is (GPTConfig.family: "gpt")."""
    family = config.family
    if family not in FAMILIES:
        # a programming error (a config class without its spec), not bad input: no reader makes such a config
        raise KeyError(f"no spec for model family {family!r}; spec/__init__.py FAMILIES has {sorted(FAMILIES)}")
    return FAMILIES[family]
