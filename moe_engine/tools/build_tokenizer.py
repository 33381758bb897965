"""Train the built-in byte-level BPE tokenizer on the bundled corpus and write it in HF format.

Byte-level BPE (as GPT-2 / Llama-3 style tokenizers) maps any UTF-8 text, emoji and code
included, to tokens and back without an unknown token, so corpus rows never fail to tokenize.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
# Ids 0, 1, 2 as in Llama/Mixtral tokenizers.
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DEFAULT_CORPUS = ("sample_prompts.jsonl", "openai_batch_example.jsonl")

# Mixtral-instruct style prompt format: [INST] user [/INST] answer</s>; a system message is
# prepended to the first user turn. Raises on roles the format cannot express.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system_message = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' }}{% if loop.first and system_message %}{{ system_message + '\\n\\n' }}{% endif %}"
    "{{ message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unsupported chat role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
)


def corpus_texts(paths: Iterable[Path]) -> Iterator[str]:
    """Every text field of JSONL corpora: `prompt`, chat `messages`, or OpenAI batch bodies."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                row = json.loads(line)
                if isinstance(row.get("prompt"), str):
                    yield row["prompt"]
                messages = row.get("messages") or (row.get("body") or {}).get("messages") or []
                for message in messages:
                    if isinstance(message, dict) and isinstance(message.get("content"), str):
                        yield message["content"]


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE trained on texts; adds BOS to every encoded sequence like Mixtral's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)])
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int,
                    corpus_files: list[Path] | None = None) -> int:
    """Train on the corpus and write tokenizer.json + tokenizer_config.json; return vocab size."""
    files = corpus_files or [DATA_DIR / name for name in DEFAULT_CORPUS]
    tokenizer = train_tokenizer(corpus_texts(files), vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}, indent=2) + "\n")
    return tokenizer.get_vocab_size()
