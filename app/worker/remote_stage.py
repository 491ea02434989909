"""Stages 1..P−1 of the P-stage worker (`tandem worker --stages P --stage-rank s`): a process that loads the model,
joins the link (app/worker/stage_link.py), times its layers for stage 0's PROBE, keeps the slice ASSIGN gives it, and
then runs every FORWARD it receives on its slice (a KV cache per session), passing the result on: to the next stage,
or from the last one back to stage 0. CROP and RELEASE follow the same chain, so they reach this stage in the order
stage 0 issued them. It exits on STOP, when a peer's connection closes, or when it hears nothing for the whole
`stage_timeout` (stage 0 sends a HEARTBEAT when idle); one that stage 0 spawned also exits when stage 0 is gone.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import torch
from torch import nn

from app.worker.compute import compute_device, stage_threads, synchronize
from app.worker.layer_placement import device_memory, time_layers
from app.worker.settings import WorkerSettings
from app.worker.stage_link import STOP_GRACE, Cmd, StageFailure, StageLink, header, short_error
from clients.hat.ragged import RaggedMiddle
from clients.hat.split import LayerStack, SplitKVCache

log = logging.getLogger(__name__)


def serve_stage(settings: WorkerSettings, rank: int) -> int:
    """Run stage `rank` (>= 1) until STOP or until its peers are gone. Returns the exit status."""
    from clients.hf_model import load_hf_model
    from deploy.models import resolve_model

    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s stage {rank}: %(message)s")
    threads = stage_threads(settings, rank)
    if threads:
        torch.set_num_threads(threads)
    _watch_parent()
    device = compute_device(settings.device)
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    model, _tok = load_hf_model(resolve_model(settings.model))
    store = StageLink.rendezvous(rank, settings.stages, settings.master_addr, settings.master_port,
                                 settings.stage_timeout)  # fmt: skip
    link = StageLink.join(store, rank, settings.stages, settings.stage_timeout, device)
    log.info("stage %d of %d connected (%s)", rank, settings.stages, link.backend)
    stage = _Stage(link, model, settings.m, device)
    del model
    try:
        return stage.run()
    except Exception as e:
        log.error("stage %d stops: %s", rank, short_error(e))
        return 1


class _Stage:
    def __init__(self, link: StageLink, model: nn.Module, m: int, device: torch.device) -> None:
        self.link = link
        self.model: nn.Module | None = model
        self.m = m
        self.device = device
        self.last = link.rank == link.world - 1
        self.ragged: RaggedMiddle | None = None
        self.stack: LayerStack | None = None
        self.caches: dict[tuple[int, int], SplitKVCache] = {}
        self.max_context: int | None = None
        self.outbox: queue.SimpleQueue[list[torch.Tensor] | None] = queue.SimpleQueue()
        self.send_error: str | None = None
        self.sender = threading.Thread(target=self._send_loop, name="stage-send", daemon=True)

    def _send_loop(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                self.link.send(msg)
            except Exception as e:
                self.send_error = short_error(e)
                return

    def pass_on(self, msg: list[torch.Tensor]) -> None:
        if self.send_error is not None:
            raise StageFailure(f"sending failed: {self.send_error}")
        self.outbox.put(msg)

    def run(self) -> int:
        self.sender.start()
        try:
            while True:
                head, tensors = self.link.recv_message()
                cmd = Cmd(int(head[0]))
                if cmd == Cmd.STOP:
                    if not self.last:
                        self.pass_on([head])
                    return 0
                self.handle(cmd, head, tensors)
        finally:
            self.outbox.put(None)
            self.sender.join(STOP_GRACE)

    def handle(self, cmd: Cmd, head: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        rank = self.link.rank
        if cmd == Cmd.FORWARD:
            try:
                out, elapsed = self.forward(tensors[0], tensors[1])
            except Exception as e:  # reported to stage 0, which fails the pipeline
                log.exception("stage %d forward failed", rank)
                msg = f"stage {rank} forward failed: {short_error(e)}".encode()
                self.pass_on([header(Cmd.FAILED, int(head[1]), 0, 0, 0, 0, len(msg)),
                              torch.frombuffer(bytearray(msg), dtype=torch.uint8)])  # fmt: skip
                return
            times = tensors[2].clone()
            times[rank] = int(elapsed * 1e9)
            head = head.clone()
            head[0] = Cmd.RESULT if self.last else Cmd.FORWARD
            self.pass_on([head, tensors[0], out, times])
        elif cmd in (Cmd.CROP, Cmd.RELEASE):
            key = (int(head[6]), int(head[7]))
            if cmd == Cmd.RELEASE:
                self.caches.pop(key, None)
            elif key in self.caches:
                self.caches[key].crop(int(head[8]))
            if not self.last:
                self.pass_on([head])
        elif cmd == Cmd.PROBE:
            assert self.model is not None
            layers = int(head[8])
            own = time_layers(self.model, self.m, self.m + layers, tokens=int(head[6]), reps=int(head[7]))
            table = tensors[0].clone()
            table[rank] = torch.tensor([*(int(t * 1e9) for t in own), *device_memory(self.device)])
            self.pass_on([head, table])
        elif cmd == Cmd.ASSIGN:
            assert self.model is not None
            start, end = (int(v) for v in tensors[0][rank])
            self.stack = LayerStack.from_model(self.model, start, end).to(self.device)
            self.ragged = RaggedMiddle(self.stack, int(head[6]), bool(head[7]))
            self.max_context = int(head[8]) or None
            self.model = None  # only this stage's layers stay referenced
            log.info("stage %d runs layers %d..%d", rank, start, end - 1)
            self.pass_on([head, tensors[0]])
        elif cmd == Cmd.FAILED:
            self.pass_on([head, *tensors])
        elif cmd == Cmd.HEARTBEAT:
            if not self.last:
                self.pass_on([head])

    def forward(self, meta: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self.ragged is None or self.stack is None:
            raise StageFailure("FORWARD before ASSIGN")
        t0 = time.perf_counter()
        rows, start = [], 0
        for hi, lo, first, n in meta.tolist():
            cache = self.caches.get((hi, lo))
            if cache is None:
                cache = self.caches[(hi, lo)] = self.stack.new_cache(self.max_context)
            if len(cache) != first:
                raise StageFailure(f"session rows start at {first} but this stage's cache holds {len(cache)}")
            rows.append((hidden[start : start + n], cache))
            start += n
        with torch.inference_mode():
            outs = self.ragged.forward(rows)
            synchronize(self.ragged.device)
        return torch.cat(outs), time.perf_counter() - t0


def _watch_parent() -> None:
    """A stage that stage 0 spawned exits when stage 0 is gone (no orphans, even after a SIGKILL)."""
    parent = os.environ.get("TANDEM_STAGE_PARENT")
    if not parent:
        return
    pid = int(parent)

    def watch() -> None:
        while True:
            if os.getppid() != pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="stage-parent", daemon=True).start()
