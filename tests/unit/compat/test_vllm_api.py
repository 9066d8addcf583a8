"""The connector's use of vLLM, checked against the source of every vLLM release we claim (``API_CHECKED``).

Each release's sdist is fetched from the package index on first use and cached outside the checkout
(``bench/_upstream.py``, ``~/.cache/agentkv/upstream/``); the source is parsed with ``ast``, never
imported, so one machine checks CUDA releases it could not install. What we use is read from our own
connector modules (``_api.uses``): a new override, ``super()`` call or ``self.x`` of vLLM's is checked the
moment it is written. When the index cannot be reached the tests are skipped, saying so.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from agentkv.server.launch._versions import API_CHECKED, is_supported

from ._api import REPO, Tree, Use, check, has_member, uses, vllm_modules

if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the installed distribution
    sys.path.insert(0, str(REPO))

from bench._upstream import fetch_upstream_source, upstream_cache

CACHE = upstream_cache()
USES = uses()


@pytest.fixture(scope="module", params=API_CHECKED)
def source(request: pytest.FixtureRequest) -> tuple[str, Path]:
    version = str(request.param)
    try:
        return version, fetch_upstream_source(version, cache=CACHE)
    except httpx.HTTPError as exc:
        pytest.skip(f"vLLM {version}'s source could not be fetched from the package index: {exc!r}")


def test_our_connector_uses_what_we_expect_to_check() -> None:
    # The extraction itself: if it silently found nothing, every release would pass.
    assert set(vllm_modules()) >= {
        "agentkv/server/engine/connector.py",
        "agentkv/server/engine/_connector/_vllm.py",
        "agentkv/server/engine/_connector/_scheduler.py",
        "agentkv/server/engine/_connector/_worker.py",
    }
    kinds = {(u.kind, u.owner.split(".")[0], u.name) for u in USES}
    assert ("override", "NixlPullConnectorScheduler", "request_finished") in kinds
    assert ("call", "NixlBaseConnector", "__init__") in kinds
    assert ("member", "NixlPullConnectorScheduler", "_reqs_need_send") in kinds
    assert ("member", "KVConnectorOutput", "finished_sending") in kinds
    assert ("override", "NixlPullConnectorWorker", "__init__") in kinds
    assert ("attr", "nixl_utils", "NixlWrapper") in kinds
    assert ("sets", "NixlPullConnector", "connector_scheduler") in kinds
    assert len(USES) > 80


def test_every_vllm_name_signature_and_attribute_we_use_exists(source: tuple[str, Path]) -> None:
    version, root = source
    tree = Tree(root)
    problems = sorted({f"{u}: {why}" for u in USES if (why := check(u, tree))})
    assert not problems, f"vLLM {version}:\n" + "\n".join(problems)


def test_attributes_we_set_for_vllm_exist_in_every_release() -> None:
    # ``connector_scheduler``/``connector_worker`` are vLLM's, read by its base connector; ``self.leases`` is
    # ours. An attribute one release has and another lacks is one vLLM renamed under us.
    trees = {}
    for version in API_CHECKED:
        try:
            trees[version] = Tree(fetch_upstream_source(version, cache=CACHE))
        except httpx.HTTPError as exc:
            pytest.skip(f"vLLM {version}'s source could not be fetched from the package index: {exc!r}")
    for use in (u for u in USES if u.kind == "sets"):
        present = {v for v, tree in trees.items() if has_member(use, tree)}
        assert present in (set(), set(API_CHECKED)), f"{use}: only in vLLM {sorted(present)}"


def test_the_methods_the_plugin_wraps_for_forwarded_ids_take_what_it_passes(source: tuple[str, Path]) -> None:
    """`agentkv/server/engine/plugin/_forwarded_ids.py` wraps two coroutine methods by position and keyword:
    the request and
    messages first in `preprocess_chat`, the conversations first and `prompt_extras` by keyword in
    `render_chat_async` (which `preprocess_chat` calls once, on `self.renderer`)."""
    version, root = source
    tree = Tree(root)
    preprocess = tree.cls("vllm.renderers.online_renderer", "OnlineRenderer")
    render = tree.cls("vllm.renderers.base", "BaseRenderer")
    assert preprocess is not None and render is not None, version
    pre, ren = preprocess.method("preprocess_chat"), render.method("render_chat_async")
    assert isinstance(pre, ast.AsyncFunctionDef) and isinstance(ren, ast.AsyncFunctionDef), version
    assert [a.arg for a in pre.args.args[:3]] == ["self", "request", "messages"], version
    assert [a.arg for a in ren.args.args[:2]] == ["self", "conversations"], version
    assert "prompt_extras" in [a.arg for a in ren.args.kwonlyargs], version
    assert "renderer.render_chat_async(" in ast.unparse(pre), version
    # ... and builds the engine input with vLLM's own constructor.
    engine = tree.module("vllm.inputs.engine")
    assert engine is not None, version
    tokens_input = [n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "tokens_input"]
    assert tokens_input and "cache_salt" in [a.arg for a in tokens_input[0].args.kwonlyargs], version
    # Where vLLM checks the engine input's ids in `BaseRenderer.validate_token_ids` (0.32+), it is handed the
    # list the render returned, unchanged (the wrapper skips that very list, which it checked itself).
    validate = render.method("validate_token_ids")
    processor = tree.cls("vllm.v1.engine.input_processor", "InputProcessor")
    assert processor is not None, version
    model_input = ast.unparse(processor.method("_validate_model_input"))
    if validate is not None:
        assert [a.arg for a in validate.args.args[:2]] == ["self", "token_ids"], version
        assert "self.renderer.validate_token_ids(prompt_ids)" in model_input, version
        assert "prompt_ids = None if" in model_input and "prompt_input['prompt_token_ids']" in model_input
    else:  # 0.26: the same check inline, left as it is
        assert "max(prompt_ids" in model_input, version


def test_the_engine_client_the_plugin_wraps_for_prefills_token_takes_and_yields_what_it_reads(
    source: tuple[str, Path],
) -> None:
    """`agentkv/server/engine/plugin/_prefill_token.py` wraps `AsyncLLM.generate` by position (prompt,
    sampling params,
    request id), reads the block size off `vllm_config.cache_config` and the tokenizer off the client, and
    rewrites `prompt_token_ids` on each `RequestOutput` and `token_ids`/`text` on its `CompletionOutput`s;
    the serving layers hand it a token engine input (a dict with `prompt_token_ids`)."""
    version, root = source
    tree = Tree(root)
    client = tree.cls("vllm.v1.engine.async_llm", "AsyncLLM")
    assert client is not None, version
    generate = client.method("generate")
    assert isinstance(generate, ast.AsyncFunctionDef), version
    assert [a.arg for a in generate.args.args[:4]] == ["self", "prompt", "sampling_params", "request_id"]
    assert client.has_member("vllm_config") and client.method("tokenizer") is not None, version
    for cls, names in (
        ("RequestOutput", ("prompt_token_ids", "outputs")),
        ("CompletionOutput", ("token_ids", "text")),
    ):
        info = tree.cls("vllm.outputs", cls)
        assert info is not None and all(info.has_member(n) for n in names), (version, cls)
    params = tree.cls("vllm.sampling_params", "SamplingParams")
    assert params is not None and params.method("clone") is not None, version
    for name in ("n", "temperature", "logprobs", "stop", "stop_token_ids", "max_tokens", "min_tokens"):
        assert params.has_member(name), (version, name)
    assert "DELTA" in ast.unparse(tree.cls("vllm.sampling_params", "RequestOutputKind").node), version
    engine = tree.module("vllm.inputs.engine")
    assert engine is not None and "prompt_token_ids" in ast.unparse(engine), version
    # Token 1's logprobs, built as vLLM's output processor builds a position.
    logprob = tree.cls("vllm.logprobs", "Logprob")
    assert logprob is not None and all(logprob.has_member(n) for n in ("logprob", "rank", "decoded_token"))
    names = tree.module("vllm.tokenizers.detokenizer_utils")
    assert names is not None and "def convert_ids_list_to_tokens(" in ast.unparse(names), version


def test_the_detokenizer_the_plugin_primes_reads_the_prompt_only_for_its_decode_stream(
    source: tuple[str, Path],
) -> None:
    """`agentkv/server/engine/plugin/_register.py` hands `FastIncrementalDetokenizer.__init__` a copy of the
    request
    holding only the prompt's tail (`msgspec.structs.replace`): sound only while that constructor reads the
    prompt for nothing but its `DecodeStream`, steps with `tokenizer._tokenizer`, and the request is a
    msgspec struct."""
    version, root = source
    tree = Tree(root)
    detokenizer = tree.cls("vllm.v1.engine.detokenizer", "FastIncrementalDetokenizer")
    assert detokenizer is not None, version
    init = detokenizer.method("__init__")
    assert init is not None, version
    body = ast.unparse(init)
    assert body.count("prompt_token_ids") == 1, version
    assert re.search(r"DecodeStream\(\s*ids=request\.prompt_token_ids", body), version
    assert "tokenizer._tokenizer" in body, version
    base = tree.cls("vllm.v1.engine.detokenizer", "BaseIncrementalDetokenizer")
    base_init = base.method("__init__") if base is not None else None
    assert base_init is not None and "prompt_token_ids" not in ast.unparse(base_init), version
    request = tree.cls("vllm.v1.engine", "EngineCoreRequest")
    assert request is not None, version
    assert "msgspec.Struct" in [ast.unparse(b) for b in request.node.bases], version


def test_a_decode_that_loads_less_than_the_prompt_computes_the_rest(source: tuple[str, Path]) -> None:
    """`_hashing.decode_loaded_tokens` (agentkv_decode_tail_tokens > 1) loads all but the prompt's last
    tokens: sound while vLLM's NIXL scheduler offers the prompt less what decode holds and its scheduler
    re-runs a token only after a load of the whole prompt."""
    version, root = source
    tree = Tree(root)
    pull = tree.cls(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler", "NixlPullConnectorScheduler"
    )
    assert pull is not None, version
    matched = pull.method("get_num_new_matched_tokens")
    assert matched is not None, version
    body = ast.unparse(matched)
    assert "count = actual - num_computed_tokens" in body, version
    assert "actual = self._get_remote_prefill_token_count(len(token_ids))" in body, version
    sched = tree.cls("vllm.v1.core.sched.scheduler", "Scheduler")
    assert sched is not None, version
    waiting = sched.method("_update_waiting_for_remote_kv")
    assert waiting is not None, version
    rerun = re.findall(
        r"if request\.num_computed_tokens == request\.num_tokens:\s*"
        r"request\.num_computed_tokens = request\.num_tokens - 1",
        ast.unparse(waiting),
    )
    assert len(rerun) == 1, version


def test_the_engine_core_builds_its_block_hasher_after_our_connector_and_from_the_name_we_wrap(
    source: tuple[str, Path],
) -> None:
    """`_connector/_block_hashes.install` wraps `vllm.v1.engine.core.get_request_block_hasher` from our
    scheduler's constructor and hands vLLM's hasher a request holding the reused hashes: sound while the
    engine core calls that module-level name after building its scheduler, the hasher starts after the
    hashes a request holds and chains from the last one, a request stores what the hasher returns, and a
    block hash mixes in no key but LoRA, multimodal inputs, the cache salt (first block) and prompt
    embeddings."""
    version, root = source
    tree = Tree(root)
    core = tree.module("vllm.v1.engine.core")
    assert core is not None, version
    imported = {
        alias.name
        for stmt in core.body
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "vllm.v1.core.kv_cache_utils"
        for alias in stmt.names
    }
    assert "get_request_block_hasher" in imported, version
    engine = tree.cls("vllm.v1.engine.core", "EngineCore")
    init = engine.method("__init__") if engine is not None else None
    assert init is not None, version
    body = ast.unparse(init)
    assert (
        0
        < body.index("self.scheduler: SchedulerInterface = Scheduler(")
        < body.index("self.request_block_hasher = get_request_block_hasher(")
    ), version
    utils = tree.module("vllm.v1.core.kv_cache_utils")
    assert utils is not None, version
    functions = {f.name: ast.unparse(f) for f in utils.body if isinstance(f, ast.FunctionDef)}
    hasher = functions["get_request_block_hasher"]
    assert "start_token_idx = len(request.block_hashes) * hash_block_size" in hasher, version
    assert "request.block_hashes[-1] if request.block_hashes else None" in hasher, version
    extra = functions["generate_block_hash_extra_keys"]
    keys = "extra_keys: list[Any] = lora_extra_keys + mm_extra_keys + cache_salt_keys + prompt_embeds_keys"
    assert keys in extra, version
    assert "start_token_idx == 0 and request.cache_salt" in extra, version
    request = tree.cls("vllm.v1.request", "Request")
    update = request.method("update_block_hashes") if request is not None else None
    assert update is not None, version
    assert "self.block_hashes.extend(self._block_hasher(self))" in ast.unparse(update), version
    for name in ("mm_features", "lora_request", "prompt_embeds", "cache_salt", "prompt_token_ids"):
        assert request is not None and request.has_member(name), (version, name)


def test_the_check_fails_on_a_real_break(source: tuple[str, Path]) -> None:
    """Mutations of vLLM's source (renamed method, changed signature, dropped attribute, moved class): each
    must be reported, so a pass above means something."""
    version, root = source
    rel = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
    original = {
        f"{rel}/{name}": (root / rel / name).read_text()
        for name in ("base_scheduler.py", "pull_scheduler.py")
    }
    # Applied to both files: a method defined in the base and overridden in the pull class goes from both.
    mutations = [
        (r"def request_finished\(\s*self,", "def request_done(self,", "request_finished"),
        (
            r"def get_num_new_matched_tokens\(\s*self,\s*request",
            "def get_num_new_matched_tokens(self, req",
            "get_num_new_matched_tokens",
        ),
        (r"self\._reqs_need_send\b", "self._sends_pending", "_reqs_need_send"),
    ]
    for pattern, replacement, reported in mutations:
        assert any(re.search(pattern, text) for text in original.values()), (
            f"{pattern!r} not in vLLM {version}"
        )
        tree = Tree(
            root, replaced={path: re.sub(pattern, replacement, text) for path, text in original.items()}
        )
        problems = [f"{u}: {why}" for u in USES if (why := check(u, tree))]
        assert any(reported in p for p in problems), f"{reported} mutation not reported"
    tree = Tree(root, replaced={f"{rel}/pull_worker.py": None})
    assert any("NixlPullConnectorWorker" in str(u) for u in USES if check(u, tree))


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items() if name.startswith("gpu")}


def _spec(reqs: list[Requirement], name: str) -> Requirement:
    return next(r for r in reqs if r.name == name)


def test_exactly_one_gpu_extra_admits_each_checked_release_with_the_nixl_it_needs(
    source: tuple[str, Path],
) -> None:
    version, root = source
    admitting = {n: reqs for n, reqs in _extras().items() if _spec(reqs, "vllm").specifier.contains(version)}
    assert len(admitting) == 1, f"vLLM {version} is admitted by extras {sorted(admitting)}"
    ((extra, reqs),) = admitting.items()
    nixl = _spec(reqs, "nixl").specifier
    # The NIXL vLLM builds and tests with (requirements/kv_connectors.txt) ...
    pinned = re.search(r"^nixl\s*==\s*([\w.]+)", (root / "requirements/kv_connectors.txt").read_text(), re.M)
    assert pinned is not None
    assert nixl.contains(pinned.group(1)), (
        f"[{extra}] {nixl} excludes NIXL {pinned.group(1)} (vLLM {version})"
    )
    # ... and never one its runtime check refuses (vLLM >= 0.33: check_nixl_version("1.5.0")).
    base_worker = (root / "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py").read_text()
    required = re.search(r'check_nixl_version\(\s*"([\w.]+)"', base_worker)
    if required is not None:
        lowest = [Version(s.version) for s in nixl if s.operator in (">=", "==", "~=")]
        assert lowest and min(lowest) >= Version(required.group(1)), (
            f"[{extra}] {nixl} admits NIXL < {required.group(1)}"
        )


@pytest.mark.parametrize("version", [*API_CHECKED, "0.25.0", "0.29.0", "0.35.0"])
def test_the_runtime_check_and_the_extras_agree(version: str) -> None:
    admitted = any(_spec(reqs, "vllm").specifier.contains(version) for reqs in _extras().values())
    assert is_supported(version) == admitted


def test_use_descriptions_name_our_source_line() -> None:
    use = Use("member", "vllm.v1.request", "Request", "request_id", where="agentkv/x.py:3")
    assert str(use) == "member vllm.v1.request.Request.request_id (agentkv/x.py:3)"
