"""``ModelPlan``: where the parts of a transformer are, as discovered in a user's module.

Every parallel dimension reads the model through this one description instead of
guessing on its own: TP shards the projections it names, PP cuts at its blocks, EP
shards its expert lists, CP swaps the attention it points at. Paths of the top-level
parts (embedding, blocks, final norm, head) are dotted paths from the module that was
discovered (the LightningModule under the strategy); paths inside a block are relative
to that block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from torch import nn

from lightning_5d.plan.linear_bias import LinearBias
from lightning_5d.plan.position_reads import PositionRead


class PlanSource(str, Enum):
    """Where a plan came from, in the order they are tried."""

    EXPLICIT = "explicit"  # the user's `model_plan` (module-path patterns -> roles)
    PUBLISHED = "published"  # the model's own plans (Hugging Face base_model_tp_plan, ...)
    REGISTRY = "registry"  # a known architecture
    STRUCTURAL = "structural"  # found from the module tree and names


class ProjectionKind(str, Enum):
    LINEAR = "linear"  # nn.Linear-like: weight [out, in], y = x W^T + b
    CONV1D = "conv1d"  # GPT-2's transformers.pytorch_utils.Conv1D: weight [in, out], y = x W + b
    # nn.MultiheadAttention itself: its in_proj_weight [3E, E] is a fused [q|k|v]; torch's
    # F.multi_head_attention_forward applies it (and out_proj's weight) inside one call
    PACKED_IN_PROJ = "packed_in_proj"


class AttentionKernel(str, Enum):
    """How the attention module computes softmax(QK^T)V (what CP must swap)."""

    SDPA = "sdpa"  # F.scaled_dot_product_attention (directly or via HF's attention interface)
    EXPLICIT_SOFTMAX = "softmax"  # matmul + softmax written out in the module
    UNKNOWN = "unknown"


class ColumnLayout(str, Enum):
    """How a column projection's output features are ordered, as far as tensor parallelism cares.

    PLAIN: one tensor (a q, an up projection); SEGMENTS: fused pieces side by side (``[q|k|v]``,
    ``[gate|up]``), each cut into tp pieces; PER_GROUP: fused per head or per kv group
    (GPT-NeoX's ``[q_h|k_h|v_h]``, pairs ``[g_i, u_i]``), so a plain contiguous cut keeps whole
    groups; UNKNOWN: fused in an order the probe could not match (tensor parallelism refuses).
    """

    PLAIN = "plain"
    SEGMENTS = "segments"
    PER_GROUP = "per_group"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Projection:
    """One linear map inside a block.

    ``segments`` are the sizes, along the output features, of the pieces a fused
    projection concatenates (GPT-2's ``c_attn`` is ``(E, E, E)`` for q|k|v; a fused
    Llama-style qkv with GQA is ``(H*d, KV*d, KV*d)``). Empty for an unfused projection.
    Column sharding cuts every segment into ``tp`` pieces so each rank keeps a whole
    q, k and v part of its own heads.
    """

    path: str  # relative to the block
    kind: ProjectionKind = ProjectionKind.LINEAR
    segments: tuple[int, ...] = ()
    layout: ColumnLayout = ColumnLayout.PLAIN

    def __post_init__(self) -> None:
        if self.segments and self.layout is ColumnLayout.PLAIN:  # segments given: that is the layout
            object.__setattr__(self, "layout", ColumnLayout.SEGMENTS)


@dataclass(frozen=True)
class AttentionPlan:
    path: str  # the attention module, relative to the block
    o: Projection
    q: Projection | None = None
    k: Projection | None = None
    v: Projection | None = None
    kv: Projection | None = None  # fused [k|v] beside q (then k, v are None); segments (KV*d, KV*d)
    qkv: Projection | None = None  # fused q|k|v (then q, k, v are None)
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    # Integer attributes of the attention module that hold a full head count or a full
    # head width (e.g. GPT-2's ``split_size``, ``num_heads``); TP divides them by tp
    # because the module reshapes with them ("layer rewriting").
    head_attributes: tuple[str, ...] = ()
    kernel: AttentionKernel = AttentionKernel.UNKNOWN
    # view/reshape/split calls of the forward whose sizes hold a full head count or width
    # (``plan.shape_sites.ShapeSite``, observed at full size): tp replays them with local sizes.
    shape_sites: tuple = ()
    # Observed: the attention call gets a float mask with a different bias per head (ALiBi
    # slopes), built inside the model from the full head count.
    per_head_bias: bool = False
    # Observed: that mask proven to be slopes x token distances (+ the causal mask), so context
    # parallelism can rebuild it from global positions (plan/linear_bias.py); None otherwise.
    linear_bias: LinearBias | None = None

    @property
    def column(self) -> tuple[Projection, ...]:
        return tuple(p for p in (self.q, self.k, self.v, self.kv, self.qkv) if p is not None)

    @property
    def packed(self) -> bool:
        """nn.MultiheadAttention: q/k/v in its in_proj_weight; its projections run inside one torch call."""
        return self.qkv is not None and self.qkv.kind is ProjectionKind.PACKED_IN_PROJ

    @property
    def row(self) -> tuple[Projection, ...]:
        return (self.o,)


@dataclass(frozen=True)
class MLPPlan:
    path: str  # the MLP module, relative to the block
    column: tuple[Projection, ...]  # up/gate, fc1, c_fc
    row: tuple[Projection, ...]  # down, fc2, c_proj


class ExpertsKind(str, Enum):
    """How a MoE holds its experts (what expert parallelism must split and how it calls them)."""

    MODULE_LIST = "module_list"  # nn.ModuleList of expert MLPs; each called on its own tokens
    GROUPED = (
        "grouped"  # one module holding [num_experts, ...] weights, called as experts(x, top_k_index, top_k_weights)
    )


@dataclass(frozen=True)
class MoEPlan:
    path: str  # the MoE feed-forward module, relative to the block
    router: str  # relative to the block: a linear layer, or a module whose weight is [num_experts, hidden]
    experts: str  # the experts (see experts_kind), relative to the block
    num_experts: int
    shared_experts: str | None = None  # always-on expert MLP(s), relative to the block
    experts_kind: ExpertsKind = ExpertsKind.MODULE_LIST
    top_k: int = 0  # experts per token, 0 when discovery could not tell
    shared_expert_gate: str | None = None  # Qwen2-MoE's sigmoid gate on the shared expert, relative to the block


@dataclass(frozen=True)
class BlockPlan:
    # None: an entry of a block list that alternates attention and MLP entries (its MLP one)
    attention: AttentionPlan | None
    mlp: MLPPlan | None = None
    moe: MoEPlan | None = None
    norms: tuple[str, ...] = ()  # norm modules directly in the block (not inside attention/MLP)


class Phase(str, Enum):
    """When in the forward a parameter outside every part is read (see plan.loose_params)."""

    BEFORE = "before the first block"
    AMONG = "among the blocks"
    AFTER = "after the last block"


@dataclass(frozen=True)
class LooseParam:
    """A parameter of no part (not embedding, blocks, final norm or head), e.g. a raw
    ``nn.Parameter`` of learned positions on the model, and when the probe forward read it."""

    name: str  # from the discovered module
    phases: frozenset[Phase]

    @property
    def phase(self) -> Phase | None:
        """The one phase it was read in (None: several, or never)."""
        return next(iter(self.phases)) if len(self.phases) == 1 else None


@dataclass(frozen=True)
class ModelPlan:
    source: PlanSource
    embedding: str
    blocks: str  # the nn.ModuleList of blocks
    block_plans: tuple[BlockPlan, ...]  # one per block, in order
    vocab_size: int
    hidden_size: int
    final_norm: str | None = None
    head: str | None = None  # the output projection (lm_head); None for a headless model
    position_embedding: str | None = None  # learned absolute positions (GPT-2's wpe)
    tied_head: bool = False  # head.weight is embedding.weight
    # Observed by the probe (plan/position_reads.py) for a model whose forward takes no
    # position_ids: where the forward reads token positions. uses_positions False: nowhere (NoPE);
    # True: exactly at position_reads; None: not observed (or the positions are an input).
    uses_positions: bool | None = None
    # Observed by the probe: parameters of no part and when the forward read them (empty when
    # there are none, or when the model could not run: meta weights, a forward not on ids).
    loose_params: tuple[LooseParam, ...] = ()
    position_reads: tuple[PositionRead, ...] = ()
    # The root has no forward: the probe ran embedding -> blocks -> final norm -> head itself.
    chain_assumed: bool = False
    notes: tuple[str, ...] = field(default=())  # what the detector assumed, for describe()

    @property
    def num_blocks(self) -> int:
        return len(self.block_plans)

    def block_path(self, index: int) -> str:
        return f"{self.blocks}.{index}" if self.blocks else str(index)

    def blocks_of(self, root: nn.Module) -> list[nn.Module]:
        # children(), not iteration: an nn.ModuleDict of blocks iterates over its keys.
        return list(root.get_submodule(self.blocks).children())

    @property
    def attentions(self) -> list[tuple[int, "AttentionPlan"]]:
        """(block index, attention) of every block that has one."""
        return [(i, b.attention) for i, b in enumerate(self.block_plans) if b.attention is not None]

    @property
    def has_moe(self) -> bool:
        return any(b.moe is not None for b in self.block_plans)
