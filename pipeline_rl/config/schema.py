"""The typed configuration schema: every key of a run, documented once, here (the pools'
own sections in `pool_sections.py`).

Choice-valued keys are Enums whose members document themselves (`choices.py`); a key's valid
range is declared on its field (`bounded`, `bounds.py`); `validate.py` checks those and the rules
that span keys. Loading and merging YAML layers lives in `loader.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline_rl.config.bounds import bounded
from pipeline_rl.config.choices import (
    DType,
    LogprobKernel,
    StepGuidanceMode,
    StreamsBackend,
    WandbMode,
)
from pipeline_rl.config.pool_sections import CACHE, ActorConfig, PreprocessConfig, ScorerConfig, TrainerConfig


@dataclass
class SharedConfig:
    """What more than one pool reads. Every other section belongs to one pool (actor,
    preprocess, trainer) or describes the run's machinery (model, world, streams, metrics); a
    pool's code reads its own section and these (tests/unit/test_config_sections.py)."""

    groups_per_step: int = bounded(16, ge=1)
    """Rollout groups in one optimizer step (the RL batch): the actors admit groups by steps, the
    preprocessor packs steps of this many groups, the trainer trains them."""
    max_steps: int = bounded(1000, ge=1)
    """Optimizer steps of the run: the trainer stops after them, the preprocessor after packing them."""
    max_lag: int = bounded(4, ge=0)
    """A sample whose oldest token comes from a policy more than this many versions behind the
    trainer is not trained on (counted), or only its stale tokens are not (`trainer.lag_gate:
    token`). Actors also stop admitting groups beyond this budget (unless `actor.admission_lag`
    says otherwise)."""
    weight_update_interval: int = bounded(1, ge=1)
    """The trainer publishes weights to the actors every this many optimizer steps (the actors'
    admission counts versions by it)."""
    temperature: float = bounded(1.0, gt=0, why="logprobs are taken at it")
    """Sampling temperature of the actors; the trainer and the reference scorer compute
    logprobs at the same temperature."""
    tensor_parallel_size: int = bounded(1, ge=1)
    """Shards of each actor's engine (vLLM's tensor parallelism): on GPU that many GPUs of one
    node per actor, on CPU that many worker processes. Above 1 the weight swap gates whole
    engine steps and every shard swaps between the same two steps (pipeline_rl/engine/tp_swap.py);
    the trainer's weight broadcast reaches every shard."""
    share_prompts: bool = False
    """Read by the preprocessor (the layout it packs) and the trainer (the attention kernel it
    loads): pack a group's rollouts as one prompt followed by their completions, so the trainer
    computes the prompt once per group. Uses an explicit [T, T] attention mask (sdpa/eager, not
    flash-attention): worth it for short rows with long prompts and short answers."""
    routing_replay: bool = False
    """Mixture-of-experts policies: the engine records the experts its routers chose for each
    generated token, the rollout carries them, and the trainer's forward uses exactly those
    experts for those tokens (the router's probabilities still computed and trained), so the
    trainer scores the network that sampled. Needs an MoE model and tensor_parallel_size 1."""


@dataclass
class LoraConfig:
    """Low-rank adapters on the frozen base model (pipeline_rl/lora.py)."""

    rank: int = bounded(16, ge=1, le=512, why="vLLM's largest LoRA rank")
    """Rank r of each adapter pair (A: r x in, B: out x r). The actor's engine reserves it as
    vLLM's max_lora_rank."""
    alpha: int = bounded(32, gt=0)
    """Scale of the adapter's output: alpha / rank (PEFT's lora_alpha)."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in the trainer's training pass (the scorers and the engine
    run without it). Above 0 the trainer's logprobs, and so the importance ratios and the lag-0
    consistency metrics, differ from the behaviour policy's even at lag 0."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get an adapter (the last part of the module name, as in
    PEFT); every name must be a linear layer of the model."""


@dataclass
class ModelConfig:
    path: str = CACHE + "/tiny_model"
    """Hugging Face model directory (config.json + safetensors) loaded by actors, scorers and trainers."""
    dtype: DType = DType.float32
    """Parameter dtype everywhere: float32 or bfloat16."""
    logprob_chunk_tokens: int = bounded(2048, ge=0)
    """Tokens whose logits, float32 log-softmax and entropy over the vocabulary are computed at
    once, in the trainer (only for the tokens it trains) and the logprob scorers; backward
    recomputes each chunk's logits once. The intermediates then exist for one chunk at a time
    (in a bf16 model, 10 bytes per row and vocabulary entry with the eager logprob kernel, 3 GB
    for 2048 rows of a 152k vocabulary; 4 compiled) instead of for every token. 0: all tokens at
    once."""
    logprob_kernel: LogprobKernel = LogprobKernel.auto
    """How each chunk's logits become float32 logprobs, entropies and their gradient, in the
    trainer and the logprob scorers (config/choices.py LogprobKernel)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of all weights (null: full fine-tuning). The trainer trains
    and publishes only the adapter; the actor's engine serves it in one LoRA slot, written in
    place between two decode steps; checkpoints hold it in PEFT format."""
    make_tiny_if_missing: bool = False
    """Build the tiny model at `path` (scripts/make_tiny_model.py) when it does not exist; the
    directory's name says which (pipeline_rl/demo/__init__.py: tiny_model, the demo's;
    tiny_learner, the learning benchmark's second; family_*, the model family defaults are
    judged on; multistep_*, the multi-step task's)."""


@dataclass
class RedisConfig:
    host: str = "127.0.0.1"
    """Redis host. With `start_server` the run's redis-server listens on it; on Ray the driver sets
    it to the address of trainer rank 0's node, where that server runs."""
    port: int = bounded(6379, ge=1, le=65535)
    """Redis port."""
    password_env: str | None = None
    """Name of the environment variable that holds the password (AUTH) of an external Redis
    (`start_server: false`), or null for none; every process reads it from its environment, so the
    secret itself is never in a config file. A Redis the run starts ignores it: it gets a random
    password of its own, kept in RUN_DIR/redis.password (mode 0600)."""
    tls: bool = False
    """Connect to an external Redis with TLS (the server's certificate is verified against
    `tls_ca_file`, or the system's CAs, and must name `host`). A Redis the run starts has no TLS."""
    tls_ca_file: str | None = None
    """PEM file of the CA that signed the Redis server's certificate (null: the system's CAs)."""
    tls_cert_file: str | None = None
    """PEM client certificate, for a server that requires one (tls-auth-clients); with `tls_key_file`."""
    tls_key_file: str | None = None
    """PEM private key of `tls_cert_file`."""
    maxlen: int = bounded(100000, ge=0)
    """Approximate cap on entries kept per stream key (XADD MAXLEN ~) of the small broadcast
    topics (metrics, weights, dead letters); 0 keeps everything. The data topics
    (actor, scored, trainer) are never capped: they are trimmed only below the positions their
    readers have saved (see ARCHITECTURE.md, resume)."""
    start_server: bool = False
    """The run starts its own redis-server (binary on PATH of trainer rank 0's node) on `port`, beside
    trainer rank 0, for the run's lifetime."""


@dataclass
class StreamsConfig:
    backend: StreamsBackend = StreamsBackend.jsonl
    """jsonl (files under the run directory, one node) or redis (several nodes)."""
    redis: RedisConfig = field(default_factory=RedisConfig)
    """Redis connection, used when backend=redis."""


@dataclass
class WorldConfig:
    nodes: int = bounded(1, ge=1)
    """Number of nodes. Above 1 the run goes on a running Ray cluster (`world.ray_address`): one
    launch.py, on any node of it, places every process (pipeline_rl/launch/ray_driver.py)."""
    ray_address: str | None = None
    """Address of the Ray cluster (`ray start --head`'s, e.g. 10.0.0.1:6379) for a run of several
    nodes; null: the RAY_ADDRESS environment variable, else the cluster started on this machine.
    Set, it also puts a one-node run on Ray."""
    gpus_per_node: int = bounded(0, ge=0)
    """GPUs on each node; 0 means CPU only (every process gets one CPU thread)."""
    gpu_memory_gib: float = bounded(80.0, gt=0)
    """Memory of one GPU; `--dry-run` checks the memory plan against it."""
    actors: int = bounded(1, ge=1)
    """Actor processes (each owns one vLLM engine, which takes shared.tensor_parallel_size GPUs)."""
    preprocessors: int = bounded(1, ge=1)
    """Preprocessor processes."""
    preprocessor_gpus: int = bounded(0, ge=0)
    """GPUs per preprocessor (for scorers that run a model); ignored on CPU."""
    trainers: int = bounded(1, ge=1)
    """Trainer ranks (one process, one GPU each)."""
    weight_sync_port: int = bounded(29600, ge=1, le=65535)
    """Port of the weight-update process group's store, on the trainer's node."""
    trainer_port: int = bounded(29500, ge=1, le=65535)
    """MASTER_PORT of the trainers' own process group."""
    collective_timeout_s: float = bounded(600.0, gt=0)
    """Timeout of every collective and rendezvous store of the run: the trainers' process group
    (DeepSpeed's), the weight-update group and its TCPStore (the weight-update group's waits end
    at half of it, so that trainer ranks waiting for rank 0's broadcast in a ZeRO-3 gather do
    not time out with a hung actor: weight_sync.transfer_timeout_s). A peer that died or hangs makes the
    survivors fail within it (NCCL's watchdog aborts the collective, and the next one raises:
    pipeline_rl/collectives.py), and the process stops naming the peer. It must exceed the longest legitimate wait inside a collective:
    trainer ranks wait at a checkpoint's barrier while rank 0 writes the Hugging Face weights
    (`--dry-run` prints that estimate)."""
    socket_ifname: str | None = None
    """Network interface (a name, e.g. eth0) that gloo and NCCL use across nodes, on every node
    (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); null: on each node the interface that holds the
    address its route to node 0 leaves from, unless the node's environment sets those variables.
    A process fails at start when its node has no interface of that name; `--dry-run` checks the
    launcher's node."""
    max_restarts: int = bounded(3, ge=0)
    """Restarts of one process within an hour before the run stops, naming it: a lost actor or
    preprocessor is started again in its slot (it resumes from its position file), a lost
    trainer rank restarts the trainer pool from the last checkpoint while the actors and
    preprocessors go on (pipeline_rl/launch/restarts.py; `--dry-run` prints the policy). 0: any
    lost process stops the run. On Ray a process is started again in its bundle: on its node,
    or where Ray places the bundle again after the node was lost; the actors of a node that
    froze (only actors) start in placement groups of their own on nodes with room; losing node 0
    (trainer rank 0 and Redis), or the freeze of a node that held any other process, stops the
    run."""
    disk_gib_per_s: float = bounded(1.0, gt=0)
    """Assumed read and write bandwidth of the file system under run_dir and model.path, GiB/s
    (one shared stream: every rank's checkpoint shards together). The plan's checkpoint-write and
    model-load estimates divide bytes by it; they set the trainers' stop grace period and the
    start-up watchdog unless those are given."""


@dataclass
class StepGuidanceConfig:
    mode: StepGuidanceMode = StepGuidanceMode.none
    """none, cut or branch (config/choices.py StepGuidanceMode): each attempt is scored at every
    step boundary while it is generated (pipeline_rl/actor/step_guide.py), by `scorer` in the
    preprocessor pool, and stopped at a step scored below `cut_below`; branch also refills the
    call from its best-scored prefix."""
    separator: str = "\n"
    """What ends a step, as text; matched in the policy's token ids (the ids its tokenizer gives
    the separator), as the process reward scorer cuts steps."""
    cut_below: float = bounded(0.5, ge=0, le=1)
    """A step scored below this stops its attempt (modes cut and branch)."""
    branch_tokens: int = bounded(0, ge=0)
    """Mode branch: tokens each generate call may spend on branches. A branch is started when the
    tokens it may generate (the call's max_tokens less the prefix it continues) fit in what is
    left, and they are charged at once."""
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    """The step scorer: `module:Class`, built as `Class(cfg, **kwargs)` by each preprocessor
    (pipeline_rl/scorers/step_scorer.py)."""


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    """Also write TensorBoard event files under RUN_DIR/tensorboard."""
    wandb_project: str | None = None
    """Weights & Biases project; null disables it."""
    wandb_mode: WandbMode = WandbMode.offline
    """online or offline (offline needs no network)."""
    plot_at_end: bool = True
    """Write PNG plots into RUN_DIR/plots when the run ends."""


@dataclass
class RunConfig:
    run_dir: str = "runs/${name}"
    """Output directory: resolved config, streams, logs, metrics, checkpoints, plots."""
    name: str = "run"
    """Name of the run (also the Redis key namespace)."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    max_time_s: float = bounded(0.0, ge=0)
    """Stop the run after this much wall time (0: run until shared.max_steps)."""
    watchdog_s: float = bounded(300.0, ge=0)
    """Stall limit: when the policy version has not advanced for max(watchdog_s, 5 x the longest
    interval between two versions so far) while every process is alive, the launcher prints
    what each process last did and waits on, stops the run and exits non-zero. Adapts to slow
    steps (a 32B run), yet catches a stalled tiny demo within minutes. 0 disables it."""
    watchdog_startup_s: float | None = bounded(None, ge=0)
    """The same limit for the first version (engines and models loading, compilation, the first
    step's rollouts); null: derived from the model size (pipeline_rl/launch/budget.py, printed
    by `--dry-run`)."""
    shared: SharedConfig = field(default_factory=SharedConfig)
    """What more than one pool reads."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    world: WorldConfig = field(default_factory=WorldConfig)
    """Nodes and how processes are placed."""
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    """The stream layer between pools."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Actor pool."""
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    """Preprocessor pool."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer pool."""
    step_guidance: StepGuidanceConfig = field(default_factory=StepGuidanceConfig)
    """Attempts scored step by step while they are generated (actors and preprocessors)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metrics sinks and plots."""
