"""The choices of choice-valued config keys: one Enum per key kind, each member documented
(the schema in `schema.py` types its keys with them)."""

from __future__ import annotations

from enum import StrEnum


class DType(StrEnum):
    """Parameter dtype of every process."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class StreamsBackend(StrEnum):
    """Stream transport between pools."""

    jsonl = "jsonl"
    """Append-only files under RUN_DIR/streams: one node only."""
    redis = "redis"
    """Redis streams (XADD/XREAD): any number of nodes; options under `streams.redis`."""


# `async` is a Python keyword, so this Enum is built by name.
ActorMode = StrEnum("ActorMode", {"async": "async", "sync": "sync"})
"""async: generate while training, weights swapped in flight (PipelineRL); sync: conventional
RL, generate one batch with the current policy, wait for the update, repeat."""


class StepGuidanceMode(StrEnum):
    """What the actors do with the scores of their attempts' steps (`step_guidance.mode`)."""

    none = "none"
    """Nothing is scored while attempts are generated."""
    cut = "cut"
    """An attempt whose step scores below `step_guidance.cut_below` stops at that step; its tokens
    up to the step stay in its group and are trained with the domain's reward of the partial
    completion (a failure on the built-in tasks), so the tokens the scorer judged wrong are
    pushed down and leaving them out does not raise the group's baseline."""
    branch = "branch"
    """As cut, and the call gets a new attempt in place of each cut one, continuing the call's
    best-scored prefix (its highest-scored step, the latest of equals), while the call's
    `step_guidance.branch_tokens` last: the group's attempts then differ where it matters. A
    branch's tokens taken from the prefix are trained once, in the attempt they come from (mask 0
    in the branch), and its own tokens with its own advantage, against the whole group's mean.
    Groups in flight at a stop are not continued (counted lost): a branch adds a sequence to a call
    that a continued rollout could not replay. Single-turn domains (`make_rollout`)."""


class LrBySignal(StrEnum):
    """Which filtered groups make an update's lr smaller (`trainer.optimizer.lr_by_signal`)."""

    scheduled = "scheduled"
    """The lr as scheduled."""
    all = "all"
    """lr x trained / (trained + the samples of every group filtered for zero advantage)."""
    unsolved = "unsolved"
    """lr x trained / (trained + the samples of the filtered groups whose reward is below the
    step's mean): a group every attempt solved is learned, one every attempt failed is a
    problem the policy is sure of and wrong on; only the latter says the update rests on thin
    evidence, so a policy that solves most problems keeps its lr."""


class LrDecay(StrEnum):
    """The learning rate after warm-up."""

    constant = "constant"
    """Stays at lr."""
    cosine = "cosine"
    """Falls along a half cosine to `min_lr_ratio` x lr at the end of the run: at
    `shared.max_steps`, or at `max_time_s` when the run is bounded by time and that comes first
    (the schedule then follows the wall clock, so it fits a run of any speed). Late in a run a
    sharpened policy that each version still moves by a full step oscillates; smaller steps there
    let it settle."""


class LossKind(StrEnum):
    """Policy-gradient objective of the built-in loss (`trainer.loss.function`)."""

    reinforce = "reinforce"
    """-min(w, is_truncation).detach() * A * logprob; option: `is_truncation`."""
    ppo = "ppo"
    """-min(w * A, clip(w, 1 - ppo_clip, 1 + ppo_clip) * A); option: `ppo_clip`."""
    cispo = "cispo"
    """-clip(w, 1 - ppo_clip, 1 + ppo_clip_high).detach() * A * logprob (CISPO): every token keeps
    its gradient, only the weight is clipped; options: `ppo_clip`, `ppo_clip_high`."""


class RatioLevel(StrEnum):
    """What one importance ratio w = pi / pi_behaviour covers in the built-in loss."""

    token = "token"
    """One ratio per token (PPO, GRPO)."""
    sequence = "sequence"
    """One ratio per sequence, the geometric mean of its tokens' ratios exp(mean log w), given to
    every token of the sequence (GSPO): clipping and truncation act on whole sequences. GSPO
    pairs it with `normalize: sequence` and a small `ppo_clip` (about 3e-4)."""


class Attention(StrEnum):
    """The trainer's attention kernel for packed rows (several sequences per row, their
    position_ids restarting at 0)."""

    auto = "auto"
    """With shared prompts: sdpa (their layout needs its mask). Otherwise varlen, or on GPU
    flash_attention_2 when the flash-attn package is installed."""
    flash_attention_2 = "flash_attention_2"
    """Varlen flash-attention: sequence boundaries come from position_ids, no [T, T] mask."""
    varlen = "varlen"
    """Each packed sequence attends only to itself (pipeline_rl/core/packed_attention.py):
    torch's varlen flash-attention kernel on GPU (bf16/fp16), per-sequence sdpa elsewhere. Work
    grows with the sum of the squared sequence lengths, not the squared row, and no [T, T] mask
    is made. Needs no package beyond torch."""
    flex_attention = "flex_attention"
    """torch's flex_attention with a block mask built from position_ids: no [T, T] mask per layer
    (sdpa's grows with the square of the row: 48 GiB over 24 layers at 32k tokens), but it
    compiles on first use and again for each new row length (GPU)."""
    sdpa = "sdpa"
    """torch's scaled_dot_product_attention with a block-diagonal mask built from position_ids;
    it keeps a [T, T] mask in the model's dtype per layer for backward."""
    eager = "eager"
    """Plain matmul attention with the same mask (slow; for debugging)."""


class LogprobKernel(StrEnum):
    """How each chunk of the output layer's logits becomes logprobs and entropies, and their
    gradient (pipeline_rl/core/logprobs.py): the same float32 arithmetic either way."""

    auto = "auto"
    """compiled on a GPU where torch has its Triton compiler, eager elsewhere (on CPU the first
    compile takes tens of seconds per process, more than a short run gains)."""
    compiled = "compiled"
    """torch.compile fuses the float32 log-softmax, entropy and gradient of a chunk into a few
    passes over its logits in the model's dtype: no float32 [chunk, V] tensor exists (4 bytes
    per row and vocabulary entry live in a bf16 model, against eager's 10). Compiles on the first
    micro-batch of each process."""
    eager = "eager"
    """PyTorch operators, in place on a float32 copy of the chunk: a dozen passes over [chunk, V]
    float32 tensors."""


class LagGateMode(StrEnum):
    """What the max_lag gate removes from a stale sample (pipeline_rl/trainer/lag_gate.py)."""

    sample = "sample"
    """The whole sample, when its oldest trained token is more than max_lag versions old."""
    token = "token"
    """Only its tokens more than max_lag versions old (counted as masked tokens); the fresh tail
    is trained on. A sample with no fresh token left is dropped as in `sample` mode."""


class LossNormalize(StrEnum):
    """How token losses are averaged over an optimizer step."""

    token = "token"
    """Every trained token of the step weighs the same."""
    sequence = "sequence"
    """Each sequence's mean over its tokens, then the mean over sequences."""


class WandbMode(StrEnum):
    online = "online"
    offline = "offline"
    """Needs no network; sync later with `wandb sync`."""
