"""A tiny Qwen3-architecture model made locally: random weights, a locally trained tokenizer.

No hub downloads exist where agentkv is tested, so integration tests and the demo use a model we build.
Everything is derived from ``seed``: the same seed gives byte-identical weights and tokenizer.

Why the larger init range: with transformers' default ``initializer_range=0.02`` a 2-layer random model
answers every prompt with the same token ("\\n"), so comparing token ids between runs (reuse ON vs OFF)
would prove nothing. With std 0.35 the logits depend strongly on the context and greedy outputs differ
from prompt to prompt.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from agentkv._exceptions import EngineNotInstalledError
from agentkv.server.launch._versions import check_torch_companions

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_MODEL_DIR",
    "TinyModelSpec",
    "ensure_tiny_model",
    "make_tiny_model",
    "tiny_serving",
]

DEFAULT_MODEL_DIR = Path(".agentkv/models/tiny")


# How the engines serve the tiny model (ClusterConfig fields). Its chat template writes hermes <tool_call>
# tags. Forced tool calls (tool_choice="required" or named) must terminate with random weights: vLLM 0.32's
# default structural tag for hermes lets the model pad the arguments with whitespace until max_tokens, so the
# engines take vLLM's JSON-schema path for forced calls (VLLM_ENFORCE_STRICT_TOOL_CALLING=0) with
# whitespace disabled; with parallel_tool_calls=false a forced call is then short and always parses.
def tiny_serving() -> dict[str, Any]:
    """ClusterConfig fields for the tiny model (a fresh dict each call: callers may extend the lists)."""
    return {
        "tool_call_parser": "hermes",
        "env": {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"},
        "extra_args": [
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}',
        ],
    }


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# ChatML with tool calls and tool results, close to Qwen3's template but small. Tool schemas are rendered
# into the system turn so that adding/removing tools changes the prompt (as with real models), and so is the
# `today` template kwarg (as Llama 3's `date_string`): both change the top of the prompt, not its end.
CHAT_TEMPLATE = (
    "{%- if today is defined %}<|im_start|>system\nToday is {{ today }}.<|im_end|>\n{%- endif %}"
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- elif message.content %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": '
    "{%- if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{%- else %}{{ tc.function.arguments | tojson }}{%- endif %}}</tool_call>"
    "{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


class TinyModelSpec:
    """Shape of the tiny model. Small enough for 2 CPU cores, big enough to exercise several KV blocks."""

    def __init__(
        self,
        *,
        seed: int = 0,
        num_layers: int = 2,
        hidden_size: int = 256,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 64,
        intermediate_size: int = 512,
        vocab_size: int = 4096,
        init_std: float = 0.35,
        max_position_embeddings: int = 32768,
    ) -> None:
        self.seed = seed
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.vocab_size = vocab_size
        self.init_std = init_std
        self.max_position_embeddings = max_position_embeddings


_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which "
    "agent tool call result search file database query table row column answer question user assistant "
    "system function arguments json name value error retry cache token prefill decode block lease "
    "conversation turn history summary report python number sum average count select where order"
).split()


def _corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic training text: words, made-up words, numbers, JSON and code-like punctuation."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ter", "an", "zu", "pre", "fil", "dec", "ode", "ra", "sen", "to", "qu"]
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(4, 18)):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(_WORDS))
            elif r < 0.8:
                parts.append("".join(rng.choice(syll) for _ in range(rng.randint(1, 3))))
            elif r < 0.9:
                parts.append(str(rng.randint(0, 10_000)))
            else:
                parts.append(
                    rng.choice(['{"name":', '"arguments":', "{", "}", "[", "]", "(", ")", ":", ",", "."])
                )
        lines.append(" ".join(parts))
    return lines


def make_tiny_model(out_dir: str | Path, *, spec: TinyModelSpec | None = None) -> Path:
    """Write config, bf16 safetensors weights, tokenizer and chat template to ``out_dir``."""
    spec = spec or TinyModelSpec()
    check_torch_companions()
    try:
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise EngineNotInstalledError(
            f"building the tiny model needs torch, tokenizers and transformers ({exc}): "
            "pip install 'agentkv[cpu]'"
        ) from exc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # --- tokenizer: byte-level BPE, so any text (tool JSON, unicode) tokenizes without <unk>.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    (out / _STAMP).write_text(_template_digest())
    vocab = max(spec.vocab_size, len(fast))

    # --- model: Qwen3 shape, random weights with a wide init (see module docstring).
    config: Any = Qwen3Config(  # type: ignore[call-arg]
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    model: Any = Qwen3ForCausalLM(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(spec.seed)
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * spec.init_std)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    gen_cfg = {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    (out / "agentkv_model.json").write_text(json.dumps({"seed": spec.seed, **vars(spec)}, indent=2))
    return out


def ensure_tiny_model(path: Path = DEFAULT_MODEL_DIR, *, seed: int = 0) -> Path:
    """The default model: built on first use (~15 s, with a spinner on stderr), reused afterwards, and built
    again when the chat template changed since (a stale template renders prompts the tests do not expect)."""
    if (path / "config.json").exists() and _stamp(path) == _template_digest():
        return path
    from rich.console import Console

    with Console(stderr=True).status(f"building the tiny model in {path} ..."):
        make_tiny_model(path, spec=TinyModelSpec(seed=seed))
    return path


_STAMP = "agentkv-chat-template.sha256"


def _template_digest() -> str:
    return hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()


def _stamp(path: Path) -> str | None:
    try:
        return (path / _STAMP).read_text().strip()
    except OSError:
        return None
