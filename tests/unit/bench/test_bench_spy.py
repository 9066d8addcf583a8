"""bench.spy_summary on `py-spy record --subprocesses` raw profiles: samples split by process and stage."""

from __future__ import annotations

from pathlib import Path

from bench.spy_summary import summarise_processes

API = 'process 10:"python3 -m vllm.entrypoints.openai.api_server --model m"'
CORE = f'{API};process 11:"VLLM::EngineCore"'
WORKER = f'{CORE};process 12:"VLLM::Worker"'


def test_samples_are_split_by_process_and_stage_and_waits_are_left_out(tmp_path: Path) -> None:
    raw = tmp_path / "chat-131073.txt"
    raw.write_text(
        "\n".join(
            [
                f"{API};run (uvloop/__init__.py:1);request_body_to_args (fastapi/dependencies/utils.py:9) 4",
                f"{API};run (uvloop/__init__.py:1);validate_token_ids (vllm/renderers/base.py:420) 2",
                f"{API};run (uvloop/__init__.py:1);select (selectors.py:468) 50",
                f"{CORE};process_input_sockets (vllm/v1/engine/core.py:1);decode (serial_utils.py:3) 3",
                f"{CORE};run_busy_loop (core.py:2);request_block_hasher (kv_cache_utils.py:5) 5",
                f"{WORKER};execute_model (gpu_worker.py:7);forward (qwen3.py:1) 7",
                f"{WORKER};worker_busy_loop (multiproc_executor.py:1);memory_fence (shm_broadcast.py:100) 90",
                "not a sample line",
            ]
        )
    )
    assert summarise_processes(raw) == {
        "API server": {"request JSON": 4, "id validation": 2},
        "engine core": {"block hashes": 5, "request intake": 3},
        "worker": {"model": 7},
    }
