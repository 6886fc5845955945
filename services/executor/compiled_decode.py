"""The decode step, compiled: the rows of a step that feed one token each run as one
compiled function (`NemotronH.decode_logits`) instead of a few hundred eager tensor
operations.

On a model this small every eager operation costs more in dispatch than in arithmetic
(on a GPU, in launch overhead), so decode is bound by the operation count; inductor
fuses the step into a handful of kernels around the matrix products. The rows are
padded up to the next batch-size bucket with rows of the padding sink (slot 0, KV index
0: `DecodeRows`), so a step has one of a few shapes, and every bucket is compiled at
start-up, before the executor's first heartbeat: no request waits for a compilation.
On CPU the batch and the context length are dynamic dimensions of the graph, so the
buckets share one compilation (start-up pays for one, not one per bucket).

On CUDA each bucket is in addition captured as CUDA graphs, one per context-length
bucket (a power of two), replayed from static input buffers (`CudaGraphs`), which
removes launch overhead altogether. That path is written for real but has never run
here (no GPU on these machines); the README says so.

Prefill chunks stay eager, and so does sampling: a step mixing prefill and decode runs
its one-token rows compiled and its prefill rows eagerly (runner.py), and more one-token
rows than the largest bucket run a bucket's worth at a time. Both paths run the same
arithmetic (`DecodeRows`), so they agree to float rounding
(tests/executor/test_compiled_decode.py holds them to it).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from services.executor.model.batch import DecodeRows
from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools
from shared.messages.forward import StepRow

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """The batch sizes compiled for a scheduler that runs at most `max_rows` rows: the
    powers of two below it, and it."""
    return (*(b for b in BUCKETS if b < max_rows), max_rows)


class CompiledDecode:
    """Runs the one-token rows of a step through the compiled model."""

    def __init__(self, model: NemotronH, pools: DevicePools, max_rows: int) -> None:
        self.model, self.pools = model, pools
        self.buckets = buckets_for(max_rows)
        self.device = pools.device
        self.compiled = torch.compile(model.decode_logits, fullgraph=True, dynamic=None)
        self.graphs = CudaGraphs(self) if self.device.type == "cuda" else None
        self.compile_seconds = 0.0

    def logits(self, rows: list[StepRow]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one-token rows, any number of them: run by the
        largest bucket's worth at a time."""
        top = self.buckets[-1]
        parts = [self._bucketed(rows[i : i + top]) for i in range(0, len(rows), top)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _bucketed(self, rows: list[StepRow]) -> torch.Tensor:
        bucket = next(b for b in self.buckets if b >= len(rows))
        padded = DecodeRows.of(rows, self.device, padded_to=bucket)
        if self.graphs is not None:
            return self.graphs.replay(padded)[: len(rows)]
        return self.run(padded)[: len(rows)]

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """The compiled step on rows already padded to a bucket. Rows and context length
        are dynamic dimensions: one graph serves every bucket and every length (the
        one-row bucket may get its own, as torch specialises a dimension of size 1)."""
        for field in dataclasses.fields(rows):
            torch._dynamo.mark_dynamic(getattr(rows, field.name), 0)
        torch._dynamo.mark_dynamic(rows.context, 1)
        torch._dynamo.mark_dynamic(rows.mask, 1)
        return self.compiled(rows, self.pools)

    def warm_up(self) -> float:
        """Compile (and on CUDA capture) every bucket on rows of the sink; seconds taken.
        The caller zeroes the sink afterwards, as after its eager warm-up."""
        start = time.perf_counter()
        with torch.inference_mode():
            for bucket in self.buckets:
                rows = DecodeRows.of([], self.device, padded_to=bucket)
                self.run(rows)
                if self.graphs is not None:
                    self.graphs.capture(bucket)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds


class CudaGraphs:
    """CUDA graphs of the compiled decode step: one per (batch bucket, context bucket),
    replayed from static inputs. A context is padded to the next power of two (from 64)
    with the sink, masked, so a graph serves every length up to its bucket. Not run on
    these machines (no GPU)."""

    MIN_CONTEXT = 64

    def __init__(self, decode: CompiledDecode) -> None:
        self.decode = decode
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeRows, torch.Tensor]]
        self.graphs = {}

    def context_buckets(self) -> list[int]:
        longest = self.decode.model.cfg.max_position_embeddings
        sizes, size = [], self.MIN_CONTEXT
        while size < longest:
            sizes.append(size)
            size *= 2
        return [*sizes, longest]

    def capture(self, bucket: int) -> None:
        for length in self.context_buckets():
            static = _sink_rows(bucket, length, self.decode.device)
            self.decode.run(static)  # compiled for this shape before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.decode.run(static)
            self.graphs[(bucket, length)] = (graph, static, out)

    def replay(self, rows: DecodeRows) -> torch.Tensor:
        bucket, longest = rows.tokens.shape[0], rows.context.shape[1]
        length = next(n for n in self.context_buckets() if n >= longest)
        graph, static, out = self.graphs[(bucket, length)]
        for name in ("tokens", "slots", "out_slots", "snapshot_slots", "new_kv"):
            getattr(static, name).copy_(getattr(rows, name), non_blocking=True)
        static.context.zero_()
        static.mask.zero_()
        static.context[:, :longest].copy_(rows.context, non_blocking=True)
        static.mask[:, :longest].copy_(rows.mask, non_blocking=True)
        graph.replay()
        return out.clone()  # the next replay of this graph (a step's next chunk) reuses `out`


def _sink_rows(count: int, length: int, device: torch.device) -> DecodeRows:
    """`count` rows of the sink with a context of `length` entries (the first real)."""
    rows = DecodeRows.of([], device, padded_to=count)
    context = torch.zeros(count, length, dtype=torch.long, device=device)
    mask = torch.zeros(count, length, dtype=torch.bool, device=device)
    mask[:, 0] = True
    return DecodeRows(
        rows.tokens, rows.slots, rows.out_slots, rows.snapshot_slots, context, mask, rows.new_kv
    )
