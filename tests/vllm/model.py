"""A tiny Llama with real random weights, built at test time (no downloads).

Random weights on a fixed seed, not ``--load-format dummy``: with dummy
weights the output barely depends on the input, so identical tokens would
not show that the KV moved. 2 layers, hidden 128, 4 heads (head_dim 32: the
CPU attention rejects 16), a byte-level BPE tokenizer trained on a few
sentences (the model's vocabulary is the tokenizer's). A wider init than the
default sharpens the logits, so greedy decoding does not sit on near-ties
that float noise could flip.
"""

from __future__ import annotations

import json
from pathlib import Path

SEED = 20261201
VOCAB = 1024
CORPUS = [
    "The coordinator decides when the prefill may free its blocks.",
    "A decode engine pulls the key value cache over NIXL before it runs.",
    "Every handoff ends released or canceled, exactly once, whatever fails.",
    "Prefill computes the prompt; decode writes the answer one token at a time.",
    "The quick brown fox jumps over the lazy dog while the lease runs out.",
    "Numbers like 12345 and 67890 and words like alpha beta gamma delta.",
    "Disaggregated serving splits the prompt from the answer across machines.",
    "A frontend that disconnects cancels the handoff and frees both sides.",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build(directory: Path) -> Path:
    """Write the model and tokenizer to ``directory`` (once); return it."""
    marker = directory / ".built"
    if marker.exists():
        return directory
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        CORPUS * 4, vocab_size=VOCAB - 8, special_tokens=["<s>", "</s>", "<pad>"]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trainer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    marker.touch()
    return directory
