"""What kind of layer a module is, judged without importing the library that defined it.

Discovery must work on models from any library (Hugging Face, Transformer Engine, a
user's own code), so layers are recognized by duck typing: a weight of the right shape
and the attributes those layers are known to carry.
"""

from __future__ import annotations

from torch import nn

from lightning_5d.plan.model_plan import ProjectionKind


def projection_kind(module: nn.Module) -> ProjectionKind | None:
    """LINEAR or CONV1D for a layer a tensor-parallel plan can shard, PACKED_IN_PROJ for an
    nn.MultiheadAttention with one in_proj_weight, else None."""
    if isinstance(module, nn.MultiheadAttention):
        packed = module._qkv_same_embed_dim and module.in_proj_weight is not None
        return ProjectionKind.PACKED_IN_PROJ if packed else None
    if isinstance(module, nn.Linear):
        return ProjectionKind.LINEAR
    # Its own parameter: a wrapper's `weight` property (peft's LoRA layer, a class named `Linear` with
    # in_features and out_features) returns its base layer's, and the wrapper is not a linear layer.
    weight = module._parameters.get("weight")
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return None
    name = type(module).__name__
    # transformers.pytorch_utils.Conv1D stores its weight transposed ([in, out]).
    if name == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return ProjectionKind.CONV1D
    # Linear layers of other libraries (e.g. Transformer Engine) keep the nn.Linear layout.
    if "Linear" in name and hasattr(module, "in_features") and hasattr(module, "out_features"):
        return ProjectionKind.LINEAR
    return None


def is_projection(module: nn.Module) -> bool:
    return projection_kind(module) is not None


def in_features(module: nn.Module) -> int:
    kind = projection_kind(module)
    if kind is ProjectionKind.CONV1D:
        return int(module.nx)
    if kind is ProjectionKind.PACKED_IN_PROJ:
        return int(module.embed_dim)
    return int(module.in_features)


def out_features(module: nn.Module) -> int:
    kind = projection_kind(module)
    if kind is ProjectionKind.CONV1D:
        return int(module.nf)
    if kind is ProjectionKind.PACKED_IN_PROJ:
        return 3 * int(module.embed_dim)
    return int(module.out_features)


def is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding)


def is_norm(module: nn.Module) -> bool:
    # LayerNorm, RMSNorm, LlamaRMSNorm, FusedLayerNorm, ...: the class name is the only
    # signal shared by every library's norm layers.
    return "Norm" in type(module).__name__


def is_block_list(module: nn.Module) -> bool:
    # ModuleDict keyed "0", "1", ... too: block paths are "<blocks>.<index>" either way.
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return True
    return isinstance(module, nn.ModuleDict) and list(module.keys()) == [str(i) for i in range(len(module))]


def describe_kind(module: nn.Module) -> str:
    """A short phrase for error messages: the class and, for layers, the shape."""
    name = type(module).__name__
    if is_projection(module):
        return f"{name}({in_features(module)} -> {out_features(module)})"
    if is_embedding(module):
        return f"{name}({module.num_embeddings}, {module.embedding_dim})"
    return name
