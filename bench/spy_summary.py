"""Where a server's busy time went, from py-spy raw profiles (`scripts/gpu/profile.sh`).

    python -m bench.spy_summary DIR [--top 25] [--json OUT]

One line per profile (role-pid.txt, with role-pid.cmd beside it): samples in which a thread was running
Python code rather than waiting (the waits of an idle event loop, thread pool, ZMQ or NCCL poller are left
out), split into the server's startup and the stages of a vLLM API server hop: request JSON (parsing and
validation), chat template, tokenizer, detokenizer, response JSON, engine client. A sample is 1/rate s
(scripts/gpu/profile.sh samples at 200 Hz: 5 ms). Then the functions with the most busy samples,
inclusive, for the profile with the most."""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

# A sample whose innermost frame is one of these is a thread waiting, not working.
_IDLE = (
    "select (selectors.py",
    "Condition.wait",
    "_worker (concurrent/futures/thread.py",
    "Poller.poll",
    "GarbageCollectorThread.run",
    "Connection._recv",
    "sched_yield",
    "run_forever",
    "Event.wait",
    "_recv_msg",
    "time.sleep",
    "Runner.run (asyncio/runners.py",
    "run (uvloop",
)
# Also waits, in an engine's processes: the worker polling for its next step, the core's input thread.
_WAITS = (
    "acquire_read",
    "SpinCondition.wait",
    "memory_fence",
    "ReadTimeoutWithWarnings",
    "MessageQueue.dequeue",
    "sched_yield",
    "Queue.get (queue.py",
    "_poll (",
    "recv (",
)
# Stage of a busy sample: the first of these that any frame of its stack names.
_STAGES = (
    # Loading modules, the model config and the tokenizer, and the app's lifespan: before any request.
    (
        "startup",
        ("_find_and_load", "build_async_engine_client", "lifespan (", "from_pretrained", "init_app_state"),
    ),
    ("detokenizer", ("detokenizer.py", "DecodeStream", "detokenize")),
    ("tokenizer", ("_encode_plus", "_tokenize_prompt", "tokenization_utils", "TokenizerPool")),
    ("chat template", ("jinja2", "apply_hf_chat_template", "render_messages", "_render_chat_template")),
    ("request JSON", ("request_body_to_args", "_validate_value_with_model_field", "json/decoder")),
    ("response JSON", ("JSONResponse.render", "json/encoder", "model_dump")),
    ("engine client", ("async_llm.py", "output_processor.py", "core_client.py", "msgspec")),
)
# The same for an engine core and its worker (`py-spy record --subprocesses`).
_ENGINE_STAGES = (
    ("model", ("execute_model", "sample_tokens")),
    ("block hashes", ("request_block_hasher", "hash_block_tokens")),
    ("agentkv connector", ("agentkv/server/engine/_connector",)),
    ("request intake", ("process_input_sockets", "preprocess_add_request", "MsgpackDecoder")),
    ("scheduler", ("Scheduler.schedule", "Scheduler.update_from_output", "kv_cache_manager")),
)
_API_EXTRA = (
    ("id validation", ("validate_token_ids", "_validate_model_input")),
    ("agentkv plugin", ("agentkv/server/_forwarded_ids", "agentkv/server/_tokenizer_cache")),
)


def _process(frames: list[str]) -> tuple[str, list[str]]:
    """The innermost process a `--subprocesses` sample names (API server, EngineCore, Worker) and the
    sample's frames without the process names."""
    names = [f for f in frames if f.startswith("process ")]
    rest = [f for f in frames if not f.startswith("process ")]
    if not names:
        return "process", frames
    last = names[-1]
    kind = "engine core" if "EngineCore" in last else "worker" if "Worker" in last else "API server"
    return kind, rest


def summarise_processes(path: Path) -> dict[str, dict[str, int]]:
    """Busy samples per process and stage of a `py-spy record --subprocesses` raw profile."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        process, frames = _process(stack.split(";"))
        if not frames or any(idle in frames[-1] for idle in (*_IDLE, *_WAITS)):
            continue
        stages = _ENGINE_STAGES if process != "API server" else (*_API_EXTRA, *_STAGES)
        stage = next((name for name, marks in stages if any(m in f for f in frames for m in marks)), "other")
        out[process][stage] += int(count)
    return {process: dict(c.most_common()) for process, c in out.items()}


def summarise(path: Path) -> dict[str, Any]:
    stages: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    busy = total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        if any(idle in frames[-1] for idle in _IDLE):
            continue
        busy += n
        stage = next((name for name, marks in _STAGES if any(m in f for f in frames for m in marks)), "other")
        stages[stage] += n
        for f in set(frames[1:]):
            inclusive[f] += n
    cmd = path.with_suffix(".cmd")
    return {
        "profile": path.name,
        "command": cmd.read_text().strip() if cmd.exists() else None,
        "samples": total,
        "busy": busy,
        "stages": dict(stages.most_common()),
        "top": inclusive.most_common(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = [summarise(p) for p in sorted(args.dir.glob("*.txt"))]
    for r in rows:
        stages = ", ".join(f"{k} {v}" for k, v in r["stages"].items())
        print(f"{r['profile']}: {r['busy']} busy of {r['samples']} samples; {stages}")
    if rows:
        most = max(rows, key=lambda r: r["busy"])
        print(f"\nbusiest ({most['profile']}), inclusive busy samples:")
        for frame, n in most["top"][: args.top]:
            print(f"{n:8d}  {frame[:140]}")
    if args.json is not None:
        args.json.write_text(json.dumps([{**r, "top": r["top"][:200]} for r in rows], indent=1))


if __name__ == "__main__":
    main()
