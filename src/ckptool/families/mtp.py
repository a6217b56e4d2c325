"""Multi-token prediction (MTP) layers as Hugging Face releases name them, shared by the families that ship them
(deepseek_v3.py; GLM-4.5's Glm4Moe uses the same names). Torch-free.

DeepSeek-V3/R1 (config.json num_nextn_predict_layers) stores MTP layer k as model.layers.{num_hidden_layers + k}:
a whole decoder layer (its usual names), plus enorm, hnorm, eh_proj (Linear 2h -> h over [enorm(embedding) |
hnorm(hidden)]), shared_head.norm (the norm before the shared head) and its own copies of embed_tokens and
shared_head.head. The released model.safetensors.index.json lists exactly these under model.layers.61 (read in
the public deepseek-ai/DeepSeek-V3 repository); transformers 5 loads them with MtpModel.from_pretrained
(modeling_layers.py; conversion_mapping.py "MtpModel": shared_head.norm -> post_norm, the decoder layer under
mtp_block) and skips embed_tokens / shared_head.head, which it ties to the main model's.

Canonically (spec/gpt.py) an MTP layer is layer num_layers + k with its own tensors under layers.{i}.mtp.*; the
embedding and head copies are no canonical tensors: the reader checks each is equal to the main model's
(embed.word, output.weight) and refuses a checkpoint where they differ, the writer writes the main model's again.
"""
from __future__ import annotations

from typing import Dict

# layer-relative HF name -> the canonical entry (family.Names.mtp)
DEEPSEEK_MTP = {
    "enorm.weight": ("copy", "mtp.enorm.weight"),
    "hnorm.weight": ("copy", "mtp.hnorm.weight"),
    "eh_proj.weight": ("copy", "mtp.eh_proj.weight"),
    "shared_head.norm.weight": ("copy", "mtp.final_norm.weight"),
}
# layer-relative HF name -> the main model's canonical tensor it is a copy of (family.Names.mtp_shared)
DEEPSEEK_MTP_SHARED: Dict[str, str] = {
    "embed_tokens.weight": "embed.word",
    "shared_head.head.weight": "output.weight",
}
# config.json's number of MTP layers (family.Family.mtp_key): DeepSeek-V3 and GLM-4.5 (transformers 5 reads it
# as num_mtp_layers through its attribute map)
NEXTN_KEY = "num_nextn_predict_layers"


def layers_held(entries, conf: dict, family, num_layers: int) -> int:
    """The MTP layers a Hugging Face checkpoint holds: config.json's count (the family's mtp_key) when the first
    one's own tensors are among the entries; 0 when they are not: transformers' save_pretrained leaves MTP layers out
    while its config keeps num_nextn_predict_layers (default 1), so such a model has nothing to carry and is read
    without MTP, silently (to-hf then writes 0). Shared by the reader and the quick inspect (torch-free)."""
    declared = (conf.get(family.mtp_key) or 0) if family.mtp_key else 0
    first_own = family.names.layer_prefix.format(i=num_layers) + next(iter(family.names.mtp), "")
    return declared if declared and first_own in entries else 0

