"""DTensors in torch files, read as data: a rank's shard of an FSDP2 model's state_dict() that torch.save wrote
(verl's model_world_size_N_rank_R.pt), never a live DTensor, no process group.

How torch pickles a DTensor (torch/_tensor.py Tensor._reduce_ex_internal for wrapper subclasses, torch 2.13; the
same form since DTensor moved to torch.distributed.tensor in 2.5): _rebuild_from_type_v2(_rebuild_wrapper_subclass,
DTensor, (DTensor, dtype, global size, global stride, storage offset, layout, device, requires_grad), state) with
state (None, {"_local_tensor": this rank's plain tensor, "_spec": DTensorSpec(mesh=DeviceMesh, placements=(Shard(dim) |
Replicate() | Partial(...) | _StridedShard(...), ...), tensor_meta=TensorMeta(...), ...)}) (its __slots__). The safe unpickler
(safe_pickle.py, torchfile.py) builds the DTensor, DTensorSpec, DeviceMesh and placement classes as inert
StandIns and hands the rebuild call to from_pickle, which keeps the local tensor (lazy where the file is read
lazily), the global shape and the placements: calling _rebuild_wrapper_subclass would build nothing we use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..errors import CkptError
from .standin import stands_for

# The modules of the classes a pickled DTensor names (torch 2.5+), loaded as inert StandIns.
DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed.tensor._api", "torch.distributed.tensor._dtensor_spec",
                   "torch.distributed.tensor.placement_types", "torch.distributed.device_mesh",
                   "torch.distributed._mesh_layout")
# Placements by class name -> the kind read ("shard" keeps its dim); others (_StridedShard, Partial) refused.
PLACEMENTS = {"Shard": "shard", "Replicate": "replicate"}


@dataclass(frozen=True)
class DTensorShard:
    """One rank's part of a DTensor: its local tensor, the global shape and, per mesh dimension, the placement
    (("shard", dim) or ("replicate",)) and this rank's coordinate on it (None where the pickle does not say)."""
    local: Any
    global_shape: Tuple[int, ...]
    placements: Tuple[tuple, ...]
    coordinate: Optional[Tuple[int, ...]]

    @property
    def shape(self):
        return self.global_shape


def wrapper_subclass_args(*args):
    """Stands for torch._utils._rebuild_wrapper_subclass in a pickle. Never called for a DTensor (the rebuild hands
    its arguments to from_pickle); a pickle calling it on its own asks for a tensor subclass ckptool does not read."""
    raise CkptError("this torch file holds a tensor kind ckptool does not read (a tensor subclass other than "
                    "a DTensor)", "re-save the checkpoint with plain dense tensors")


def _placement(p) -> tuple:
    module, name = stands_for(p)
    kind = PLACEMENTS.get(name) if module.startswith("torch.distributed") else None
    if kind is None:
        raise CkptError(f"a DTensor placed as {name} (module {module}), which ckptool does not read",
                        "ckptool reads DTensors sharded on one dimension (Shard) or replicated, as FSDP2 saves them")
    if kind == "shard":
        dim = getattr(p, "dim", None)
        if not isinstance(dim, int):
            raise CkptError(f"a DTensor Shard placement without its dimension ({dim!r})", "the file is damaged")
        return ("shard", dim)
    return ("replicate",)


def from_pickle(new_type, args, state) -> DTensorShard:
    """_rebuild_from_type_v2(wrapper_subclass_args, new_type, args, state) of a DTensor as a DTensorShard."""
    if isinstance(state, tuple):  # (__dict__ or None, slots): DTensor keeps its fields in __slots__
        state = {k: v for part in state if isinstance(part, dict) for k, v in part.items()}
    is_dtensor = getattr(new_type, "_ckptool_name", "") == "DTensor" and \
        getattr(new_type, "_ckptool_module", "") in DTENSOR_MODULES
    if not is_dtensor or not isinstance(state, dict):
        raise CkptError(f"this torch file holds a tensor subclass {getattr(new_type, '__name__', new_type)!r}, "
                        "which ckptool does not read", "ckptool reads plain tensors and DTensors")
    spec, local = state.get("_spec"), state.get("_local_tensor")
    size = args[2] if isinstance(args, tuple) and len(args) > 2 else None  # (cls, dtype, size, stride, ...)
    if spec is None or local is None or not isinstance(size, tuple):
        raise CkptError("a pickled DTensor without its local tensor, spec or global size", "the file is damaged")
    placements = tuple(_placement(p) for p in getattr(spec, "placements", None) or ())
    coordinate = getattr(getattr(spec, "mesh", None), "_coordinate_on_dim", None)
    return DTensorShard(local, tuple(int(n) for n in size), placements,
                        tuple(coordinate) if isinstance(coordinate, (tuple, list)) else None)


def is_dtensor_rebuild(func) -> bool:
    return func is wrapper_subclass_args
