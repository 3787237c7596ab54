"""Where a TP = 1 swap's device work runs on CUDA, and what orders it.

The receiver thread takes part in the broadcast on a stream of its own (`receiving`): NCCL's
wait for a message is then a wait of that stream, and the engine's forward passes, queued on the
engine's stream meanwhile, run during the transfer. When the last message is in, an event is
recorded there.

The load, under the swap lock, is queued on the engine's stream itself (`loading`): the stream
the engine thread's forward passes are launched on, noted at each pass (`note_engine_stream`).
Queued there, the copies run after the pass in flight (vLLM returns from `execute_model` before
its kernels end) and before the next one; they first wait for the receive's event. Nothing waits
on the host, and no device-wide synchronize is needed.

The receive buffers are written again only after the copies out of them: the next receive's
stream waits for an event recorded after the load.

Elsewhere (CPU) there are no streams: every method does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SwapStreams:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.receive: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None
        self.engine: torch.cuda.Stream | None = None
        """The stream of the engine's last forward pass."""
        self.received: torch.cuda.Event | None = None
        """Recorded on the receive stream once an update is all in its buffers."""
        self.loaded: torch.cuda.Event | None = None
        """Recorded on the engine's stream once the last load has copied out of the buffers."""

    def note_engine_stream(self) -> None:
        """Called by the engine thread at each forward pass, under the swap lock."""
        if self.cuda:
            self.engine = torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Around one receive, in the receiver thread."""
        if self.receive is None:
            yield
            return
        with torch.cuda.stream(self.receive):
            if self.loaded is not None:
                self.receive.wait_event(self.loaded)
            yield
            received = torch.cuda.Event()
            received.record(self.receive)
            self.received = received

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Around one load, under the swap lock: the copies are queued on the engine's stream,
        after the receive's event."""
        if not self.cuda:
            yield
            return
        stream = self.engine if self.engine is not None else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            if self.received is not None:
                stream.wait_event(self.received)
            yield
            loaded = torch.cuda.Event()
            loaded.record(stream)
            self.loaded = loaded
