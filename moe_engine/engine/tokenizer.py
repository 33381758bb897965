"""Turn prompts and chat messages into token ids with a checkpoint's own tokenizer.

One place does this for the whole system (shard statistics, the engine, the parity tests), so a
prompt is tokenized the same way everywhere, and the same way transformers does it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# Checkpoints without a usable model_max_length report a huge sentinel; the model's
# max_position_embeddings is the real limit then.
_UNSET_MAX_LENGTH = 10**12


@dataclass(frozen=True)
class PromptTokenizer:
    """A loaded HF tokenizer plus the facts the engine needs (EOS ids, context limit)."""

    hf: Any
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    model_max_length: int

    def encode_prompt(self, text: str) -> list[int]:
        """Plain prompt -> ids, with the tokenizer's special tokens (BOS for Mixtral)."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """Chat messages -> ids through the checkpoint's chat template, ready for generation."""
        if not self.hf.chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template; send `prompt` instead")
        ids = self.hf.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def _eos_ids(model_dir: Path, hf_tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (may be a list), else config.json, else the tokenizer."""
    import json

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
                break
    if not ids and hf_tokenizer.eos_token_id is not None:
        ids.add(hf_tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def _max_positions(model_dir: Path) -> int | None:
    import json

    path = model_dir / "config.json"
    if not path.exists():
        return None
    value = json.loads(path.read_text()).get("max_position_embeddings")
    return int(value) if value else None


def _tokenizer_class(model_dir: Path) -> Any:
    """The tokenizers-backed class tokenizer_config.json names, or None when AutoTokenizer has to
    decide (no class named, or one without a tokenizer.json backend).

    AutoTokenizer imports transformers' configuration machinery and with it torch (~1 s and a
    few hundred MB), which the light workflow stages (shard) must not pay for; the class it
    would pick is usually named right in tokenizer_config.json, and importing that alone is cheap.
    """
    import json

    import transformers
    from transformers import PreTrainedTokenizerFast

    config_path, backend = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (config_path.exists() and backend.exists()):
        return None
    name = json.loads(config_path.read_text()).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerFast):
        return cls
    return None


def load_tokenizer(model_dir: Path | str) -> PromptTokenizer:
    """Load tokenizer.json/tokenizer_config.json of a checkpoint directory (never remote code)."""
    model_dir = Path(model_dir)
    cls = _tokenizer_class(model_dir)
    if cls is not None:
        hf = cls.from_pretrained(str(model_dir))
    else:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    limit = int(getattr(hf, "model_max_length", _UNSET_MAX_LENGTH) or _UNSET_MAX_LENGTH)
    positions = _max_positions(model_dir)
    if positions is not None:
        limit = min(limit, positions)
    return PromptTokenizer(hf=hf, eos_token_ids=_eos_ids(model_dir, hf),
                           bos_token_id=hf.bos_token_id, model_max_length=limit)
