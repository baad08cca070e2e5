"""Build a tiny, deterministic Llama model and tokenizer locally (no model hub), for real vLLM on CPU.

    .venv-vllm/bin/python scripts/build_tiny_model.py --out var/tiny-model

- Tokenizer: byte-level BPE (vocab 1024) trained with `tokenizers` on generated text (math prompts,
  boxed answers, words, digits), wrapped as `PreTrainedTokenizerFast` with a ChatML-style chat template.
- Model: random-initialized `LlamaForCausalLM` (hidden 128, 2 layers, 4 heads), fixed seed, safetensors.

Output is gibberish (random weights): it exists to exercise the serving stack, not to be right.
Runs in the vLLM venv (needs torch, transformers, tokenizers). Same seed -> same files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # single-threaded BPE training: stable merges
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB_SIZE = 1024
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the a an of to and in is it that for on with as was be by this are or from at which what how many "
    "answer solve compute find value number sum product difference total each more less than equals "
    "step first then so therefore final result question user assistant system you are helpful please "
    "reason put your inside boxed let x y n apples books dollars hours minutes meters cost price half "
    "twice three four five six seven eight nine ten hundred thousand percent fraction integer prime"
).split()


def corpus(seed: int, n: int = 6000) -> list[str]:
    """Deterministic training text: math-style prompts and answers plus filler sentences."""
    rng = random.Random(seed)
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    lines = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        sym, fn = rng.choice(ops)
        lines.append(f"What is {a} {sym} {b}? Let's think step by step. The answer is \\boxed{{{fn(a, b)}}}.")
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        if i % 7 == 0:
            lines.append(f"Solve for x: {a}x + {b} = {a * 3 + b}. So x = \\frac{{{a * 3}}}{{{a or 1}}}, $x^2$ (x_{{{i % 10}}}).")
    return lines


def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",  # chat turns end with it; generation stops there
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer, seed: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created or overwritten)")
    p.add_argument("--seed", type=int, default=1234, help="seed for the corpus and the weights (default 1234)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(args.seed)
    tokenizer.save_pretrained(out)
    model = build_model(tokenizer, args.seed)
    model.save_pretrained(out, safe_serialization=True)

    # Sanity: the chat template renders and round-trips through the saved tokenizer.
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out)
    ids = reloaded.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True)
    text = reloaded.decode(ids)
    assert "<|im_start|>assistant\n" in text, text
    assert (out / "model.safetensors").exists(), "model.safetensors was not written"

    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16]
    info = {"vocab": len(reloaded), "params": sum(p.numel() for p in model.parameters()),
            "seed": args.seed, "weights_sha256": digest}
    print(f"tiny model written to {out}: {json.dumps(info)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
