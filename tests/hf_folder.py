"""Build a small Llama-style Hugging Face folder in a test: a byte-level BPE trained with
`tokenizers` on a few KB of text (BOS added by its template, EOS `</s>`, a ChatML-like chat
template), random weights saved with transformers' `save_pretrained`. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus_text() -> str:
    """A few KB of English-like text with the words the test records use."""
    words = ("the model learns to answer questions about numbers and colors ; what is two plus three ? "
             "five . the sky is blue and grass is green . say hello to the user . hello ! ").split()
    return "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400))


def train_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text()], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def write_tokenizer_folder(folder: Path, chat_template: bool = True, vocab_size: int = 384) -> Path:
    tok = train_tokenizer(vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 128}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def write_llama_folder(folder: Path, vocab_size: int | None = None, seed: int = 0) -> Path:
    """Tokenizer + config.json + model.safetensors. `vocab_size`: the embedding's rows
    (default: the tokenizer's vocabulary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tokenizer_folder(folder)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=vocab_size or tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"), tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


def write_prompt_completion(path: Path, n: int = 48) -> Path:
    rows = [{"prompt": f"what is {i % 5} plus three ? ", "completion": f"{'five' if i % 2 else 'blue'} ."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_chat(path: Path, n: int = 24) -> Path:
    rows = [{"messages": [{"role": "system", "content": "say hello"},
                          {"role": "user", "content": f"what is {i % 4} plus three ?"},
                          {"role": "assistant", "content": "five ."},
                          {"role": "user", "content": "and the sky ?"},
                          {"role": "assistant", "content": "the sky is blue ."}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
