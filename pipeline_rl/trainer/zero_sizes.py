"""ZeRO-3's sizes, from a decoder layer's parameter count and where the trainer ranks are
(DeepSpeed 0.19.8's zero_optimization keys). Pure arithmetic: the trainer builds its DeepSpeed
config from it (`trainer/model.py`), and the memory plan counts and `--dry-run` prints the same
numbers (`launch/memory_plan.py`).

A decoder layer is ZeRO-3's unit of gathering (`model.gather_whole_layers`), so a layer of L
parameters sets the sizes, where DeepSpeed's defaults are fixed element counts whatever the model
(a 5e7 prefetch against a 32B layer's 4.9e8 fetches a tenth of the next layer ahead):
- stage3_prefetch_bucket_size = L: while one layer computes, the whole next one is gathered.
- stage3_max_live_parameters = 2 L + the embedding: the layer in use, the one prefetched, and
  the embedding or output layer gathered beside a layer at either end of the model; DeepSpeed
  prefetches only below it, and the memory plan counts exactly it.
- stage3_max_reuse_distance = L: a layer stays gathered when it is used again within the next
  layer's worth of parameters (under gradient checkpointing, backward right after the
  recomputation), and is released otherwise.
- reduce_bucket_size = L: a layer's gradients are reduce-scattered as one bucket when its
  backward ends (DeepSpeed allocates the bucket once, in the gradients' dtype: in the plan).
- stage3_param_persistence_threshold = the layer's smallest matrix: every bias and norm weight
  (smaller) stays whole on every rank, every matrix is partitioned (DeepSpeed's 1e5 partitions
  nothing of a model narrower than ~300).
- zero_hpz_partition_size (ZeRO++'s hierarchical partitioning) = the trainer ranks of one node,
  when the ranks span several nodes of GPUs (`trainer.zero3_hierarchical`): each rank also keeps
  a secondary partition of the weights among the ranks of its node, so backward's gathers stay
  within the node and only the forward's cross nodes; it costs the weights in the model's dtype
  over the ranks of a node (in the plan). Off on one node (nothing to gain), and when the nodes
  hold unequal numbers of ranks (DeepSpeed needs groups of one size).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_rl.config import RunConfig
from pipeline_rl.core.model_shape import ModelShape


@dataclass(frozen=True)
class Zero3Sizes:
    layer: int
    """Parameters of the largest decoder layer."""
    prefetch: int
    max_live: int
    max_reuse: int
    reduce_bucket: int
    persistence: int
    hpz: int
    """Ranks of a secondary partition group (1: no hierarchical partitioning)."""

    def keys(self) -> dict[str, int]:
        """The zero_optimization keys of DeepSpeed's config."""
        return {
            "stage3_prefetch_bucket_size": self.prefetch,
            "stage3_max_live_parameters": self.max_live,
            "stage3_max_reuse_distance": self.max_reuse,
            "reduce_bucket_size": self.reduce_bucket,
            "stage3_param_persistence_threshold": self.persistence,
            "zero_hpz_partition_size": self.hpz,
        }


def trainer_nodes(cfg: RunConfig) -> list[int]:
    """Trainer ranks on each node they occupy, as the placement lays them out (launch/placement.py:
    trainers first, one GPU each, filling node 0 then the next); [trainers] on CPU, where every
    rank's collectives are gloo's."""
    w = cfg.world
    if not w.gpus_per_node:
        return [w.trainers]
    full, rest = divmod(w.trainers, w.gpus_per_node)
    return [w.gpus_per_node] * full + ([rest] if rest else [])


def hierarchical_partition(cfg: RunConfig) -> tuple[int, str]:
    """(zero_hpz_partition_size, why) for cfg's trainer ranks under ZeRO-3."""
    nodes = trainer_nodes(cfg)
    if len(nodes) == 1:
        return 1, f"off: the {cfg.world.trainers} ranks share one node"
    if not cfg.trainer.zero3_hierarchical:
        return 1, f"off (trainer.zero3_hierarchical): the ranks span {len(nodes)} nodes"
    if len(set(nodes)) > 1:
        return (
            1,
            f"off: the ranks span {len(nodes)} nodes unequally ({'+'.join(map(str, nodes))}), DeepSpeed needs equal groups",
        )
    return nodes[0], f"the ranks span {len(nodes)} nodes of {nodes[0]}: backward's gathers stay within a node"


def zero3_sizes(cfg: RunConfig, shape: ModelShape) -> Zero3Sizes:
    layer = shape.largest_layer_params
    return Zero3Sizes(
        layer=layer,
        prefetch=layer,
        max_live=2 * layer + shape.embedding_params,
        max_reuse=layer,
        reduce_bucket=layer,
        persistence=shape.smallest_matrix,
        hpz=hierarchical_partition(cfg)[0],
    )
