"""Weight broadcast from trainer rank 0 to every actor engine, in buckets.

The process group is standalone: a TCPStore hosted by the sender at `addr` and a
ProcessGroupGloo / ProcessGroupNCCL object built directly on it, so the trainer's own
default process group (DeepSpeed's) and vLLM's are never touched. Rank 0 is the sender; the
receivers are the actors, or with tensor-parallel engines every worker of every actor
(`group_ranks`).

One update: the sender publishes its version under the store key "latest" (and, when it
changes, the plan below under "plan"; the sender hosts the store, so both are local sets),
announces a WeightUpdate record (names, shapes, dtypes, tensors per bucket, its group and
plan), then broadcasts the bytes of each bucket. Receivers read the announcement from the
"weights" stream and take part in the broadcast. A receiver asks the store ("latest",
"group" and "plan", one round trip) only when the announcement is not of its group or not
newer than the last update it received there (WeightReceiver._join says why that is safe).

Within a bucket, each run of small tensors goes as one packed message and each large tensor
(>= 1 MiB) as a message of its own, sent from the sender's tensor without a copy. A packed
run whose tensors already lie in one storage as the message has them (parameters that are
views of one flat buffer, as DeepSpeed ZeRO-1/2 keeps them, when no tensor needs padding) is
sent from that storage without a copy too; any other is packed by one `_foreach_copy_`.
The plan ("VERSION:BITS", one bit per bucket) makes a bucket whose tensors all lay flat in
the previous update a single message (still without a copy; each gloo message has a fixed
cost): the sender notes flatness after each update and publishes a change
before the next announcement; a bucket planned whole that is not flat after all is packed
whole, once, and the plan goes back. Messages are not waited for one by one: the sender
starts every message of a bucket and waits for them all before it takes the first tensor of
the next bucket (so a tensor is used before the next bucket's tensors are asked for); a
receiver keeps the messages of two buckets started (one message at a time when staging on
host, through its bounce buffer) and waits for them in order, each within the timeout.

Everything that depends only on the layout (shapes, dtypes, buckets, plan: the same model
each time) is computed once and kept until an announcement differs (told by list
comparisons): the messages, the buffers and the tensor views into them, and on the sender
the announcement's lists. An update of a kept layout allocates nothing, and its per-tensor
Python work is the sender's check of each tensor against the announcement (and whether its
runs lie flat) and the receiver's (name, view) pairs. The sender packs into one reused area
(the packed messages of one bucket side by side, at most a bucket; allocated the first time
a run must be packed), and a receiver receives into one buffer of the whole update and
returns views into it. Those views are overwritten by the next receive(): the engine's
reload copies them into its own weights before the receiver thread receives again
(LLMClient's receiver thread receives, swaps, and only then reads the next announcement).

A delta update (weight_sync/delta.py) is an announcement like any other whose tensors are the
pieces of each weight tensor's change; `base` names the version it applies to. The sender
sends one only to a group whose members all hold that version (`WeightSender.delta_base`: the
group unchanged since its last broadcast, no receiver's RESYNC request pending); any other
update is full. Full and delta updates both announce a checksum per weight tensor.

The group is built lazily by the first transfer and rebuilt after a failure, or when a receiver
registers: the sender gives each group it builds a new name (store key "group", set before the
announcement) and its members (store key "members/NAME"), and a receiver whose group has
another name joins it before receiving, at its index among the members. Membership follows who
is there, so that a run goes on when an actor dies and takes its replacement back: a receiver
registers ("ready/RANK", set to a token of its own) when it connects to the store; the sender
forms a new group when the registrations differ from the group's members (a rank registered
under a new token is a replacement process; two store round trips per update when all are
registered); the first group waits for every receiver (up to the timeout), a later one takes those registered by
then; a member found gone by a failed transfer is unregistered. A trainer that waits for data
sends its weights again when a receiver joins (trainer.py), so a replacement of the only actor
gets current weights. An update whose group was formed without a receiver raises NotMember
there (it joins from the next version, which forms a group with it). A receiver that reads an
announcement older than "latest" or than "plan" (an actor restarted after that transfer
ended), or one of a group other than "group" (the sender has named another group since: that
group's own announcement follows), skips it: every member of a group receives by that group's
announcement, so the workers of one tensor-parallel engine, reading the same announcement a
moment apart, never split between an old group and a new one and wait there for each other.
The sender broadcasts a version once per group (sending one again names a new group), and a
receiver skips a second announcement of a version its group has broadcast already. A receiver
whose store connection broke (the trainer restarted) connects again.

A failed transfer names who is gone: every member beats a counter in the store ("alive/RANK",
every HEARTBEAT_S, from a thread with a store connection of its own, made once the member
has reached the store, so it beats while the member waits in a collective), and the member whose transfer fails reads the counters twice,
DIAGNOSE_S apart, and raises WeightGroupFailed naming the members whose counter stood still
(dead, or hung with the interpreter stuck; names by rank under the store key "members", which
the sender sets). A store that cannot be reached means the sender, which hosts it, is gone.
The timeout of every wait is half the run's `world.collective_timeout_s` (`transfer_timeout_s`:
under ZeRO-3 the other trainer ranks wait for rank 0's broadcast inside a collective that times
out at the whole of it, so a hung receiver costs one failed update, never the trainer pool).

A member that freezes (its node hung or cut off) keeps its sockets open, so a transfer to it
would wait for that whole timeout. Every wait is taken in slices (WAIT_SLICE_S: gloo waits
each slice, NCCL's completion is polled, since a blocking NCCL wait that runs out aborts its
communicator);
between two, the sender reads its members' counters, and once one has stood still for FROZEN_S
it gives the transfer up: it sets ABANDONED to the group's name, keeps the group object for good
(destroying it would join threads that wait on the frozen member; an NCCL communicator is
aborted, which ends its kernel), raises MemberFrozen, and,
through the usual failure path, PeerGone naming the member, which it unregisters. Receivers
still waiting in that group see ABANDONED and give up too; the next version forms a group
without the frozen member, and a member that was only slow registers again when it wakes. A
member whose rank a new process registered at since (the replacement of a tensor-parallel
actor's worker, whose heartbeat now beats at that rank) is given up the same way. Building a
group is waited for likewise (on a store connection of its own, on a thread): gloo connects
every pair of members then, NCCL at a one-element broadcast made there, and a member that registered and then died (a tensor-parallel
actor's other worker, stopped by vLLM after the transfer that named the first) would hold it
for the timeout. The sender sets ABANDONED after every failed transfer, not only a frozen
member's: a member that died after connecting to the sender alone fails the sender's end at
once, while a receiver still building the group would wait for it, and hold the next group up,
for the whole timeout.

An actor that leaves for good (the job was scaled below it: pipeline_rl/core/actor_count.py)
withdraws its ranks' registrations (`leave_group`) and waits, still receiving, until the sender
has formed a group without them, so no transfer is left waiting for it. The sender's ranks grow
with the job (`WeightSender.resize`).
"""

from pipeline_rl.weight_sync.group import (
    DIAGNOSE_S,
    FROZEN_S,
    HEARTBEAT_S,
    INCARNATION,
    SENDER,
    WAIT_SLICE_S,
    Keep,
    MemberFrozen,
    NotMember,
    PeerGone,
    StaleUpdate,
    WeightGroupFailed,
    backend_for,
    group_ranks,
    member_names,
    transfer_timeout_s,
)
from pipeline_rl.weight_sync.receiver import WeightReceiver, leave_group, published_version
from pipeline_rl.weight_sync.sender import WeightSender

__all__ = [
    "DIAGNOSE_S",
    "FROZEN_S",
    "HEARTBEAT_S",
    "INCARNATION",
    "SENDER",
    "WAIT_SLICE_S",
    "Keep",
    "MemberFrozen",
    "NotMember",
    "PeerGone",
    "StaleUpdate",
    "WeightGroupFailed",
    "WeightReceiver",
    "WeightSender",
    "backend_for",
    "group_ranks",
    "leave_group",
    "member_names",
    "published_version",
    "transfer_timeout_s",
]
