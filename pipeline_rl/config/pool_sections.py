"""The pools' own config sections: the actor's (its engine, rollouts and their data), the
preprocessor's and the trainer's, each read only by its pool (tests/unit/test_config_sections.py).
The run's other sections and the whole `RunConfig` are in `schema.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.config.bounds import bounded
from pipeline_rl.config.choices import (
    ActorMode,
    Attention,
    LagGateMode,
    LossKind,
    LossNormalize,
    LrBySignal,
    LrDecay,
    RatioLevel,
)
from pipeline_rl.wire import CACHE_ENV

CACHE = f"${{oc.env:{CACHE_ENV},.cache}}"


@dataclass
class DatasetConfig:
    loader: str = "jsonl"
    """jsonl, parquet, or an import path `module:function` returning a list of problem dicts."""
    train: str = CACHE + "/arithmetic/train.jsonl"
    """Training problems."""
    test: str = CACHE + "/arithmetic/test.jsonl"
    """Held-out problems for evaluation."""


@dataclass
class LLMConfig:
    kv_cache_gib: float = bounded(1.0, gt=0)
    """KV-cache size per engine in GiB (CPU needs it set explicitly)."""
    gpu_memory_utilization: float = bounded(0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may use (GPU only)."""
    enforce_eager: bool = True
    """Skip torch.compile / CUDA graphs (fast start-up; on CPU also the faster path)."""
    max_num_seqs: int = bounded(256, ge=1)
    """Most sequences one engine step batches."""
    max_model_len: int = bounded(256, ge=1)
    """Longest prompt + completion the engine accepts."""
    stage_weights_on_host: bool = False
    """Keep each received weight update in host memory (pinned) instead of on the GPU: the GPU
    then needs room for one bucket, not a copy of the whole model, and the swap copies to it
    under the lock (a longer pause). Host memory: one model copy per receiver (per TP worker)."""


@dataclass
class ActorConfig:
    mode: ActorMode = ActorMode["async"]
    """async: PipelineRL (generate while training, swap weights in flight); sync: conventional RL
    (generate one batch with the current policy, wait for the update, repeat)."""
    domain: str = "arithmetic"
    """Rollout plug-in: a built-in name (arithmetic, math, multistep, agent, verifiers) or `module:function`."""
    domain_settings: dict[str, Any] = field(default_factory=dict)
    """The domain's own settings, read into the type it declares (`@takes_settings`,
    docs/extending.md) when it is loaded: unknown keys are refused as here. The built-in math,
    agent and verifiers domains' are listed below; a domain that declares none takes none."""
    attempts: int = bounded(8, ge=1)
    """Completions sampled per problem (the group size)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling."""
    max_new_tokens: int = bounded(16, ge=1)
    """Longest completion."""
    max_groups_in_flight: int = bounded(64, ge=1)
    """Most groups one actor generates at once (continuous batching fills the engine)."""
    skip_solved: float = bounded(0.0, ge=0, lt=1)
    """Probability of passing over a training problem whose last group had every attempt at the
    best reward seen in the run (pipeline_rl/actor/problems.py: no advantage, so no gradient).
    The draw goes to the next problem; each one passed over is counted (`skipped_solved_total`).
    Judged on the actor's own rewards, so refused with `preprocess.scorers`. 0: off."""
    in_flight_save_s: float = bounded(10.0, ge=0)
    """How often an actor saves its rollouts in flight (pipeline_rl/actor/in_flight.py), so that
    a restarted actor continues them instead of generating them again: a killed actor loses at
    most this long of generation, or on Redis streams the whole save once groups that landed
    after it were consumed and trimmed; a graceful stop saves them all. 0: only at a graceful stop."""
    admission_lag: int | None = bounded(None, ge=0)
    """How many versions behind the trainer a group may land and still be started
    (pipeline_rl/actor/admission.py); null: shared.max_lag, so the lag gate rarely has anything
    to drop. A larger value keeps actors generating when training is slow, and what then lands
    beyond max_lag is dropped or masked by `trainer.lag_gate`. Ignored in sync mode."""
    reward_timeout_s: float = bounded(5.0, gt=0)
    """Time limit of one reward call; past it the rollout gets reward 0 and is counted."""
    reward_workers: int = bounded(2, ge=1)
    """Worker processes per actor that run reward checks under the time limit (pipeline_rl/rollouts/rewards.py)."""
    eval_every_s: float = bounded(30.0, ge=0)
    """Actor 0 evaluates on held-out problems this often (0: never)."""
    eval_problems: int = bounded(200, ge=1)
    """Held-out problems per evaluation."""
    metrics_every_s: float = bounded(5.0, gt=0)
    """How often an actor publishes its metrics."""
    llm: LLMConfig = field(default_factory=LLMConfig)
    """vLLM engine settings."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Where problems come from."""


@dataclass
class AdvantageConfig:
    divide_by_std: bool = False
    """Divide by the group's reward standard deviation."""
    leave_one_out: bool = False
    """Baseline each rollout by the mean of the *other* rollouts in its group."""
    filter_zero: bool = True
    """Skip (and count) groups whose advantages are all zero: they carry no gradient."""
    count_filtered: bool = True
    """The filtered groups' completion tokens (and sequences) still count in the step's loss
    denominators, as they would if trained with advantage 0: a step in which few groups carry a
    reward spread makes a proportionally smaller update. False: the loss is the mean over the
    kept groups alone, so every step is a full-size update however little signal it holds."""


@dataclass
class ScorerConfig:
    cls: str = ""
    """Import path `module:Class` of a scorer (see pipeline_rl/scorers/base.py)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the scorer's constructor."""


@dataclass
class PreprocessConfig:
    seq_length: int = bounded(2048, ge=1)
    """Tokens per packed micro-batch."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Group-relative advantage options."""
    scorers: list[ScorerConfig] = field(default_factory=list)
    """Scorers run on every batch of groups, in order."""
    batch_groups: int = bounded(16, ge=1)
    """Groups a preprocessor scores together."""


@dataclass
class LossConfig:
    kind: LossKind = LossKind.reinforce
    """reinforce: policy gradient with truncated importance weights; ppo: clipped ratio objective;
    cispo: policy gradient with the importance weight clipped to the PPO range and detached."""
    is_truncation: float = bounded(5.0, gt=0)
    """Upper bound of the importance weight in reinforce mode."""
    ppo_clip: float = bounded(0.2, gt=0, lt=1)
    """PPO clip range epsilon: the ratio is clipped to [1 - ppo_clip, 1 + ppo_clip_high] (ppo and
    cispo)."""
    ppo_clip_high: float | None = None
    """Upper clip epsilon, when larger than the lower one (DAPO clip-higher, e.g. 0.28 with
    ppo_clip 0.2: lets unlikely good tokens grow faster); null: ppo_clip."""
    ratio: RatioLevel = RatioLevel.token
    """token: one importance ratio per token; sequence: one per sequence (GSPO)."""
    ratio_mask: float | None = bounded(None, gt=1, why="tokens kept: ratio in [1/c, c]")
    """IcePop / masked importance sampling, c > 1: a token whose ratio exp(logprob - behaviour
    logprob) lies outside [1/c, c] gets no gradient (it still counts in the normalisation), so
    tokens the engine and the trainer disagree on, or that went far off-policy, cannot steer
    the update; the share masked is the metric `ratio_masked_fraction`. null: no mask."""
    kl_coef: float = bounded(0.0, ge=0)
    """Weight of the k3 KL estimate to the reference model (needs a reference scorer)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight: the loss subtracts it times the policy's mean entropy over the
    trained tokens (with the same denominators as the policy term), which keeps a policy from
    turning certain where no reward has told it to. `conf=tiny` sets 0.01 (docs/learning.md)."""
    function: str = "pipeline_rl.trainer.loss:policy_loss"
    """The loss as `module:function`, called like `pipeline_rl.trainer.loss.policy_loss(inputs, cfg)` (the
    contract is `pipeline_rl.trainer.loss.LossFn`); the options of this section reach it as `cfg`."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The own settings of a loss `function` that declares them (`@takes_settings`,
    docs/extending.md), read into its type at load and passed to it as `settings=`; the built-in
    loss takes none (its options are this section's other keys)."""
    normalize: LossNormalize = LossNormalize.token
    """token: average over all tokens of the step; sequence: average per sequence, then over sequences."""


@dataclass
class OptimizerConfig:
    lr: float = bounded(1e-5, ge=0)
    """Peak learning rate, reached at the end of warm-up."""
    warmup_steps: int = bounded(10, ge=0)
    """Linear warm-up over this many optimizer updates (`trainer.epochs x updates_per_step` per step).
    Adam's first updates move every weight by about the full lr whatever its gradient's noise
    (its moment estimates hold one sample), so without warm-up they are a run's largest by far:
    on four models of the family the first updates' KL to the behaviour policy was 6-40x the later
    median (docs/learning.md); 0 turns it off."""
    decay: LrDecay = LrDecay.constant
    """What the lr does after warm-up."""
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    """Where `decay: cosine` ends, as a fraction of lr."""
    lr_by_signal: LrBySignal = LrBySignal.scheduled
    """Scale each update's lr by the share of its samples that carry a signal, against the
    filtered groups that `preprocess.advantage.count_filtered` counts (the choice's members say
    which). Adam divides out a gradient's overall scale, so counting the filtered groups in the
    loss's denominators alone leaves an update with few signal-carrying samples (mostly noise)
    as large as one with many; scaling the lr makes each update's size follow its evidence.
    Without count_filtered the share is 1 and nothing changes. `scheduled` by default: on the
    model family `all` helped a policy that turned certain before it turned right and slowed one
    that was learning, `unsolved` slowed it less (docs/learning.md)."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = bounded(1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = bounded(1.0, ge=0)
    """Max global gradient norm (0 disables; DeepSpeed's own default would be 1.0)."""
    offload: bool = False
    """Keep the optimizer state (fp32 master weights, both Adam moments: 12 bytes a parameter)
    in host memory and step it on the CPU (DeepSpeed ZeRO-Offload with DeepSpeedCPUAdam, an op
    DeepSpeed compiles on first use). Needs trainer.zero_stage >= 1."""


@dataclass
class TrainerConfig:
    lag_gate: LagGateMode = LagGateMode.sample
    """sample: drop a stale sample whole; token: mask only its tokens older than max_lag."""
    updates_per_step: int = bounded(1, ge=1)
    """Optimizer updates per step: the step's micro-batches are split, in order, into this many
    mini-batches, each normalised on its own and followed by an optimizer update (the later
    ones are off-policy; the importance ratios and clipping correct for it). The policy version
    counts steps, not updates. At most the step's micro-batches per rank are used."""
    epochs: int = bounded(1, ge=1)
    """Passes over the step's samples: each pass makes `updates_per_step` optimizer updates on
    the same micro-batches (PPO's epochs), so a step makes `epochs x updates_per_step` updates.
    Later passes are off-policy by the updates before them (the ratio clip bounds them). Meant
    for trainers that wait for actors on devices of their own; on a shared 2-core CPU two
    passes learned slower (docs/learning.md)."""
    zero_stage: int = bounded(2, ge=0, le=3)
    """DeepSpeed ZeRO stage (0-3). ZeRO-2 runs faster than ZeRO-3 (docs/gpu.md); `--dry-run`
    prints the lowest of the two whose memory plan fits, and ZeRO-3's sizes, derived from a
    decoder layer (pipeline_rl/trainer/zero_sizes.py)."""
    zero3_hierarchical: bool = True
    """Under ZeRO-3 with trainer ranks on several GPU nodes, also partition the weights among the
    ranks of each node (DeepSpeed ZeRO++'s hpZ) so that backward's gathers stay within a node;
    costs the weights in model.dtype over the ranks of a node, per GPU (in the memory plan)."""
    checkpoint_every: int = bounded(50, ge=0)
    """Save a checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_checkpoints: int = bounded(2, ge=1)
    """Most recent checkpoints kept on disk."""
    stop_grace_s: float | None = bounded(None, ge=0)
    """How long a normal stop (SIGTERM, Ctrl-C, max_time_s, the watchdog) waits for trainers to
    finish their micro-batch and write the final checkpoint before killing them; null: derived
    from the model size (pipeline_rl/launch/budget.py, printed by `--dry-run`)."""
    weight_bucket_mb: int = bounded(256, ge=1)
    """Size of one weight-broadcast bucket."""
    weight_delta: bool = True
    """Send each weight update as the elements whose published value changed since the version
    the actors hold (per tensor the smallest of indices, a bitmask or the whole tensor; a bf16
    weight's value changes at few steps, an fp32 one's at every step, so fp32 models go dense),
    computed from each rank's own shard (no gather of the model), with per-tensor checksums the
    actors check their weights against. Full updates still go first, to a changed group, on an
    actor's request and every `full_update_every`. Costs each rank its share of the weights in
    model.dtype. Ignored with model.lora (adapter updates are small and go whole)."""
    full_update_every: int = bounded(50, ge=0)
    """With weight_delta: every this many weight updates one is sent whole, bounding what a
    mistake could let drift (the checksums catch any that does); 0: only when needed."""
    gradient_checkpointing: bool = False
    """Each decoder layer keeps only its input for backward and runs again there: activations of
    one hidden state per token and layer (plus one layer's at a time) for about a third more
    forward work. Long micro-batches of large models need it (`--dry-run` shows the plan)."""
    attention: Attention = Attention.auto
    """Attention kernel for packed rows; works with gradient checkpointing either way."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy-gradient loss settings."""
