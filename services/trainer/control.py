"""How the trainer's ranks and its gRPC server agree on what happens next.

Rank 0 drives control flow: at each decision point it broadcasts one message (a batch, "stop",
"checkpoint now", "data exhausted", "publish again", "nothing yet") and every rank acts on it,
so all of them make the same collective calls. The server thread talks to the training thread
through `Control`: the stop event (SIGTERM), the checkpoint request (CheckpointNow) answered
through `checkpoint_done`, and the `Status` that GetStatus reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kuberl.trainer.distributed import DistInfo, all_reduce_max, broadcast_bytes

# Control messages broadcast by rank 0 (first byte), followed by a payload.
MSG_BATCH, MSG_STOP, MSG_CHECKPOINT, MSG_EXHAUSTED = b"B", b"S", b"C", b"X"
# "Nothing yet": goes out at least every minute while rank 0 waits for rollout, so the other
# ranks never sit in one collective long enough for a NCCL/gloo timeout.
MSG_WAIT = b"W"
# "Publish the current weights again": goes out while rank 0 waits for rollout after a publish
# failed. Replicas left on old weights produce only groups too stale to train on, and the
# trainer, which otherwise publishes only after a step, would wait forever.
MSG_PUBLISH = b"P"


@dataclass
class Status:
    """What GetStatus reports; written by the training thread, read by the server."""

    mode: str = "rl"
    step: int = 0
    total_steps: int = 0
    policy_version: int = 0
    #: The newest dataset epoch of the buffer's groups trained so far (their keys are
    #: `<prompt>@<epoch>`); in sft mode from `sft_data`, the epoch of that file being read.
    epoch: int = 0
    world_size: int = 1
    # (path, step) of the newest checkpoint in one assignment: a reader never pairs one
    # checkpoint's path with a step the trainer reached later (CheckpointNow answers with it).
    saved: tuple[str, int] = ("", 0)
    #: Checkpoint requests answered: by a checkpoint written, or by the newest one when it
    #: holds the current step already. Counted after `saved` is set (CheckpointNow waits on it).
    checkpoints_answered: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    finished: bool = False
    ready: bool = False
    error: str = ""

    @property
    def last_checkpoint(self) -> str:
        return self.saved[0]


class Control:
    """The requests that reach the training thread and the messages rank 0 broadcasts."""

    def __init__(self, dist: DistInfo, status: Status) -> None:
        self.dist = dist
        self.status = status
        self.stop_event = threading.Event()
        self.checkpoint_request = threading.Event()
        self.checkpoint_done = threading.Condition()

    def pending(self) -> bytes | None:
        """A request that ends rank 0's wait for a batch: stop, then checkpoint; else None."""
        if self.stop_event.is_set():
            return MSG_STOP
        if self.checkpoint_request.is_set():
            return MSG_CHECKPOINT
        return None

    def receive(
        self, fetch: Callable[[], bytes] | None, republish: Callable[[], None]
    ) -> tuple[bytes, bytes]:
        """Rank 0's next message on every rank, as (tag, payload). `fetch` (rank 0) asks the
        buffer; without it (batches read from a file) only a stop or checkpoint request goes
        out, else MSG_BATCH. MSG_PUBLISH is acted on here and MSG_WAIT skipped, in short rounds
        so that no rank sits in one collective for long. Collective."""
        while True:
            self.share_stop()
            if fetch is None:
                payload = (self.pending() or MSG_BATCH) if self.dist.is_main else None
            else:
                payload = fetch() if self.dist.is_main else None
            data = broadcast_bytes(payload, self.dist)
            tag, body = data[:1], data[1:]
            if tag == MSG_PUBLISH:
                republish()
            elif tag != MSG_WAIT:
                return tag, body

    def share_stop(self) -> None:
        """A SIGTERM that reached any rank stops the job (collective): a worker rank's own stop
        (its pod evicted) must not wait until torchrun kills it, losing the last checkpoint."""
        if all_reduce_max(int(self.stop_event.is_set()), self.dist):
            self.stop_event.set()

    def answered(self) -> None:
        """A checkpoint request is answered by `status.saved` (set before: CheckpointNow
        replies with it once the count moves)."""
        self.status.checkpoints_answered += 1
        self.notify()

    def notify(self) -> None:
        with self.checkpoint_done:
            self.checkpoint_done.notify_all()
