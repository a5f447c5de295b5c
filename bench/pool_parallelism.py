"""Threads or processes for one request's draft decoders: what running speculative_degree
model-based decoders in parallel costs in time and memory.

    python -m bench.pool_parallelism [--degrees 1,2,4] [--num-threads 1,2] [--context-tokens 200]
                                     [--draft-length 4] [--num-steps 8]
                                     [--modes sequential,threads,processes] [--out FILE]

The draft pool runs a request's model-based decoders (early exit, layer skip:
draft_svc/strategies/self_draft.py) in a ThreadPoolExecutor (draft_svc/pool.py). This measures
the wall time of ONE draft step, every decoder proposing --draft-length tokens after a context
of --context-tokens, for speculative_degree decoders (early_exit, layer_skip, early_exit, ...)
run three ways over the same weights:

    sequential  one after another on one thread
    threads     in parallel in one process, as the pool runs them (the first on the calling thread)
    processes   one worker process per decoder; each maps the weight segment once, zero-copy
                (specdec/weights/shared.py), and gets its commands as framed int32 arrays over a
                pipe (the manifest as protobuf bytes; nothing pickled)

for each torch intra-op thread count in --num-threads (set in every process). A step is the
steady state of a request: the decoder's cache holds the context, one committed token arrives
(extend), the decoder catches it up and drafts (propose): draft_length one-token forwards over
its layers. The first step after setup is not timed; the median of --num-steps is reported.
It also prints each worker's memory from /proc/PID/smaps_rollup: its USS (private pages) is what
a process per decoder costs beyond the shared weights. Figures, not tests: no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from bench.drafts import smaps_rollup
from draft_svc.strategies.self_draft import SelfDraftConfig, SelfDraftDecoder, self_draft_registry
from specdec.engine.loading import config_from_json, config_to_json, load_model, model_from_manifest
from specdec.model import loader
from specdec.model.llama import Transformer
from specdec.v1 import common_pb2
from specdec.weights.wire import manifest_from_pb, manifest_to_pb
from specdec.flag_spellings import add_spellings

REPO_ROOT = Path(__file__).resolve().parents[1]
KINDS = ("early_exit", "layer_skip")  # cycled over a step's decoders
MODES = ("sequential", "threads", "processes")
MAX_POSITIONS = 1024
OP_EXIT, OP_THREADS, OP_SETUP, OP_STEP = 0, 1, 2, 3  # worker commands: [op, args...] as int32
REPLY_OK = (0,)
FRAME_HEADER = struct.Struct("<I")  # byte length of the frame that follows


# ---- framing: length-prefixed bytes over a pipe --------------------------------------------------


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(FRAME_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes:
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        raise EOFError("the other end closed the pipe")
    (num_bytes,) = FRAME_HEADER.unpack(header)
    return stream.read(num_bytes)


def write_ints(stream: BinaryIO, values: Sequence[int]) -> None:
    write_frame(stream, array("i", values).tobytes())


def read_ints(stream: BinaryIO) -> list[int]:
    values = array("i")
    values.frombytes(read_frame(stream))
    return values.tolist()


# ---- the decoders of one request ------------------------------------------------------------------


def kinds_for(degree: int) -> list[str]:
    return [KINDS[i % len(KINDS)] for i in range(degree)]


def make_decoder(model: Transformer, kind: str, context: Sequence[int], draft_length: int) -> SelfDraftDecoder:
    """A decoder with `context` cached (one propose runs the context through its layers)."""
    decoder = self_draft_registry(SelfDraftConfig()).create(kind, model=model)
    assert isinstance(decoder, SelfDraftDecoder)  # every kind of that registry is one
    decoder.extend(context)
    decoder.propose(draft_length)
    return decoder


def step_one(decoder: SelfDraftDecoder, token_id: int, draft_length: int) -> list[int]:
    decoder.extend([token_id])
    (candidate,) = decoder.propose(draft_length)
    return list(candidate.token_ids)


class LocalDecoders:
    """The decoders in this process: one after another (executor None) or as the pool runs them."""

    def __init__(
        self,
        model: Transformer,
        kinds: Sequence[str],
        context: Sequence[int],
        draft_length: int,
        executor: ThreadPoolExecutor | None,
    ) -> None:
        self._decoders = [make_decoder(model, kind, context, draft_length) for kind in kinds]
        self._draft_length, self._executor = draft_length, executor

    def step(self, token_id: int) -> list[list[int]]:
        if self._executor is None:
            return [step_one(d, token_id, self._draft_length) for d in self._decoders]
        futures = [self._executor.submit(step_one, d, token_id, self._draft_length) for d in self._decoders[1:]]
        first = step_one(self._decoders[0], token_id, self._draft_length)
        return [first, *(f.result() for f in futures)]

    def close(self) -> None:
        for d in self._decoders:
            d.release()


class Worker:
    """One worker process holding one decoder; commands and replies as int32 frames."""

    def __init__(self, manifest_pb: bytes) -> None:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.pool_parallelism", "--worker", str(to_worker_r), str(from_worker_w)],
            pass_fds=(to_worker_r, from_worker_w),
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
        )
        os.close(to_worker_r)
        os.close(from_worker_w)
        self._out = os.fdopen(to_worker_w, "wb")
        self._in = os.fdopen(from_worker_r, "rb")
        write_frame(self._out, manifest_pb)

    def send(self, values: Sequence[int]) -> None:
        write_ints(self._out, values)

    def receive(self) -> list[int]:
        try:
            return read_ints(self._in)
        except EOFError:
            raise RuntimeError(f"worker {self.process.pid} exited with {self.process.wait()}") from None

    def close(self) -> None:
        try:
            self.send([OP_EXIT])
            self._out.close()
        except (BrokenPipeError, ValueError):
            pass
        self.process.wait(timeout=30)
        self._in.close()


class WorkerDecoders:
    """The decoders in worker processes, one each; a step is sent to all, then the replies collected."""

    def __init__(
        self, workers: Sequence[Worker], kinds: Sequence[str], context: Sequence[int], draft_length: int
    ) -> None:
        self._workers = list(workers[: len(kinds)])
        for worker, kind in zip(self._workers, kinds):
            worker.send([OP_SETUP, KINDS.index(kind), draft_length, *context])
        for worker in self._workers:
            worker.receive()

    def step(self, token_id: int) -> list[list[int]]:
        for worker in self._workers:
            worker.send([OP_STEP, token_id])
        return [worker.receive() for worker in self._workers]

    def close(self) -> None:
        pass  # a worker's next OP_SETUP replaces its decoder


def worker_main(read_fd: int, write_fd: int) -> None:
    """A worker: map the manifest's segment, then serve OP_THREADS / OP_SETUP / OP_STEP until OP_EXIT."""
    with os.fdopen(read_fd, "rb") as commands, os.fdopen(write_fd, "wb") as replies:
        manifest, config_json, _, _ = manifest_from_pb(common_pb2.WeightManifest.FromString(read_frame(commands)))
        model = model_from_manifest(manifest, config_from_json(config_json), MAX_POSITIONS)
        decoder: SelfDraftDecoder | None = None
        draft_length = 0
        while True:
            op, *args = read_ints(commands)
            if op == OP_EXIT:
                return
            if op == OP_THREADS:
                torch.set_num_threads(args[0])
                write_ints(replies, REPLY_OK)
            elif op == OP_SETUP:
                if decoder is not None:
                    decoder.release()
                kind, draft_length, context = KINDS[args[0]], args[1], args[2:]
                decoder = make_decoder(model, kind, context, draft_length)
                write_ints(replies, REPLY_OK)
            elif op == OP_STEP:
                if decoder is None:
                    raise ValueError("a step before any setup")
                write_ints(replies, step_one(decoder, args[0], draft_length))
            else:
                raise ValueError(f"unknown op {op}")


# ---- the measurement ------------------------------------------------------------------------------


def context_ids(num_tokens: int, vocab_size: int) -> list[int]:
    """A fixed pseudo-text of token ids: the step time does not depend on which tokens they are."""
    return [(7919 * i + 13) % (vocab_size - 100) + 100 for i in range(num_tokens)]


def time_steps(
    decoders: LocalDecoders | WorkerDecoders, step_tokens: Sequence[int]
) -> tuple[list[float], list[list[list[int]]]]:
    """(wall ms of each step after the first, which is not timed; every step's drafts per decoder)."""
    drafts = [decoders.step(step_tokens[0])]
    times = []
    for token_id in step_tokens[1:]:
        started = time.perf_counter()
        drafts.append(decoders.step(token_id))
        times.append((time.perf_counter() - started) * 1e3)
    return times, drafts


def measure(args: argparse.Namespace, model: Transformer, workers: list[Worker]) -> list[dict]:
    context = context_ids(args.context_tokens, model.config.vocab_size)
    step_tokens = context_ids(args.num_steps + 1 + args.context_tokens, model.config.vocab_size)[-args.num_steps - 1 :]
    rows = []
    reference_drafts: dict[tuple[int, int], list] = {}  # (threads, degree) -> the first mode's drafts
    with ThreadPoolExecutor(max(args.degrees)) as executor:
        for num_threads in args.num_threads:
            torch.set_num_threads(num_threads)
            for worker in workers:
                worker.send([OP_THREADS, num_threads])
                worker.receive()
            for degree in args.degrees:
                for mode in args.modes:
                    kinds = kinds_for(degree)
                    decoders: WorkerDecoders | LocalDecoders
                    if mode == "processes":
                        decoders = WorkerDecoders(workers, kinds, context, args.draft_length)
                    else:
                        decoders = LocalDecoders(
                            model, kinds, context, args.draft_length, executor if mode == "threads" else None
                        )
                    times, drafts = time_steps(decoders, step_tokens)
                    decoders.close()
                    # The same drafts whichever way they ran: the modes did the same work.
                    reference = reference_drafts.setdefault((num_threads, degree), drafts)
                    rows.append(
                        {
                            "mode": mode,
                            "degree": degree,
                            "num_threads": num_threads,
                            "median_ms": statistics.median(times),
                            "mean_ms": statistics.fmean(times),
                            "step_ms": times,
                            "is_same_drafts": drafts == reference,
                        }
                    )
                    print(
                        f"  threads {num_threads} degree {degree} {mode:10s} {rows[-1]['median_ms']:8.1f} ms"
                        f"{'' if drafts == reference else '  (drafts differ from the first mode)'}",
                        flush=True,
                    )
    return rows


def print_table(rows: list[dict], modes: Sequence[str]) -> None:
    by_key = {(r["num_threads"], r["degree"], r["mode"]): r["median_ms"] for r in rows}
    print(
        f"\n{'threads':>7} {'degree':>6} "
        + " ".join(f"{m + ' ms':>14}" for m in modes)
        + "".join(f" {m + ' speedup':>18}" for m in modes if m != "sequential")
    )
    for num_threads, degree in dict.fromkeys((r["num_threads"], r["degree"]) for r in rows):
        times = [by_key[(num_threads, degree, m)] for m in modes]
        line = f"{num_threads:>7} {degree:>6} " + " ".join(f"{t:14.1f}" for t in times)
        if "sequential" in modes:
            base = by_key[(num_threads, degree, "sequential")]
            line += "".join(f" {base / by_key[(num_threads, degree, m)]:17.2f}x" for m in modes if m != "sequential")
        print(line)


def memory_figures(pid: int) -> dict[str, int]:
    mem = smaps_rollup(pid)
    return {
        "rss_kb": mem["Rss"],
        "pss_kb": mem["Pss"],
        "uss_kb": mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0),
    }


def print_memory(memory: dict) -> None:
    print("\nmemory (MiB)        Rss     Pss     USS")
    for name, m in [("this process", memory["main"]), *((f"worker {w['pid']}", w) for w in memory["workers"])]:
        print(f"{name:16s} {m['rss_kb'] / 1024:7.0f} {m['pss_kb'] / 1024:7.0f} {m['uss_kb'] / 1024:7.0f}")
    print(f"weights (shared segment, mapped by every process): {memory['weight_bytes'] / 2**20:.0f} MiB")


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":  # started by Worker, not by hand
        worker_main(int(sys.argv[2]), int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--degrees", type=_csv_ints, default=[1, 2, 4])
    p.add_argument("--num-threads", type=_csv_ints, default=[1, 2], help="torch intra-op threads per process")
    p.add_argument("--context-tokens", type=int, default=200)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=8, help="timed steps per setting (after one untimed)")
    p.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES))
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = add_spellings(p).parse_args()
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; known: {MODES}")
    if args.context_tokens + args.num_steps + args.draft_length + 1 > MAX_POSITIONS:
        p.error(f"context + steps + draft length must fit {MAX_POSITIONS} positions")

    owner = load_model(
        loader.resolve_model_dir(None, loader.default_cache_dir(), show_progress=False),
        "fp32",
        max_positions=MAX_POSITIONS,
        is_shared=True,
    )
    assert owner.shared is not None  # loaded with is_shared=True
    shared = owner.shared
    workers: list[Worker] = []
    try:
        config_json = config_to_json(owner.config)
        # This process drafts over its own mapping of the segment, as the draft pool does.
        model = model_from_manifest(shared.manifest, owner.config, MAX_POSITIONS)
        if "processes" in args.modes:
            manifest_pb = manifest_to_pb(shared.manifest, config_json, "fp32", "bench").SerializeToString()
            workers = [Worker(manifest_pb) for _ in range(max(args.degrees))]
        print(
            f"{len(owner.model.layers)} layers, fp32; context {args.context_tokens} tokens, draft length "
            f"{args.draft_length}, {args.num_steps} timed steps; decoders cycle {KINDS}",
            flush=True,
        )
        rows = measure(args, model, workers)
        print_table(rows, args.modes)
        memory = {
            "main": memory_figures(os.getpid()),
            "weight_bytes": owner.weight_bytes,
            "workers": [{"pid": w.process.pid, **memory_figures(w.process.pid)} for w in workers],
        }
        print_memory(memory)
    finally:
        for worker in workers:
            worker.close()
        shared.unlink()
    if args.out:
        settings = {
            k: getattr(args, k)
            for k in ("degrees", "num_threads", "context_tokens", "draft_length", "num_steps", "modes")
        }
        Path(args.out).write_text(
            json.dumps({"settings": settings, "kinds": KINDS, "rows": rows, "memory": memory}, indent=2)
        )


if __name__ == "__main__":
    main()
